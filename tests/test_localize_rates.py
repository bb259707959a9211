"""Repeat rates: Wilson intervals against published values, planted nondeterminism,
and the observer arm withholding the verdict."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

from dmlib.errors import DmlibError
from dmlib.localize.rates import Z95, digest, repeat_rates, repeat_study, wilson_interval

# Newcombe (1998), Statistics in Medicine 17:857-872, Table I, method 3 (Wilson score
# interval without continuity correction), to the four decimals printed there
NEWCOMBE = [((81, 263), (0.2553, 0.3662)), ((15, 148), (0.0624, 0.1605)),
            ((0, 20), (0.0, 0.1611)), ((1, 29), (0.0061, 0.1718))]  # fmt: skip


@pytest.mark.parametrize(("kn", "expected"), NEWCOMBE)
def test_wilson_matches_published_values(kn, expected):
    lo, hi = wilson_interval(*kn)
    assert (round(lo, 4), round(hi, 4)) == expected


def quadratic_roots(k: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's interval as the roots of (p_hat - p)^2 = z^2 p (1 - p) / n, by hand."""
    ph = k / n
    a = 1 + z * z / n
    b = -(2 * ph + z * z / n)
    c = ph * ph
    d = math.sqrt(b * b - 4 * a * c)
    return (-b - d) / (2 * a), (-b + d) / (2 * a)


@pytest.mark.parametrize(("k", "n"), [(0, 1), (1, 1), (3, 10), (7, 7), (50, 1000), (999, 1000)])
def test_wilson_is_the_score_equation_root(k, n):
    lo, hi = wilson_interval(k, n)
    rlo, rhi = quadratic_roots(k, n, Z95)
    assert lo == pytest.approx(max(rlo, 0.0), abs=1e-12)
    assert hi == pytest.approx(min(rhi, 1.0), abs=1e-12)
    assert 0 <= lo <= k / n <= hi <= 1
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(DmlibError):
        wilson_interval(5, 3)


def test_planted_nondeterminism_rates():
    calls = {"a": 0, "b": 0}

    def fn(arm):
        calls[arm] += 1
        i = calls[arm] - 1  # 0 is the reference run
        if arm == "a":
            return np.float32([1.0, 2.0])  # always the same bits
        # arm b: repeats 3, 6, 9, ... (every third) give one of two other outputs
        extra = (i // 3) % 2 + 1 if i and i % 3 == 0 else 0
        return np.float32([1.0, 2.0 + extra * 2**-20])

    study = repeat_study(fn, n=12, arms={"a": "a", "b": "b"})
    t = study.table.set_index("arm")
    assert t.loc["a", "n_differ"] == 0 and t.loc["a", "n_distinct"] == 1
    assert t.loc["b", "n"] == 12 and t.loc["b", "n_differ"] == 4  # repeats 3, 6, 9, 12
    assert t.loc["b", "n_distinct"] == 3
    assert t.loc["b", "rate"] == pytest.approx(4 / 12)
    assert (t.loc["b", "ci_low"], t.loc["b", "ci_high"]) == pytest.approx(
        quadratic_roots(4, 12, Z95)
    )
    assert t.loc["a", "ci_high"] == pytest.approx(quadratic_roots(0, 12, Z95)[1])
    assert study.verdict == "nondeterministic" and "b: 4/12" in study.reason
    assert "no observer arm" in study.reason


def test_observer_arm_withholds_the_verdict():
    state = {"captured": False}

    def fn():
        return np.float64([0.1]) + (1e-17 if state["captured"] else 0.0) * 10

    @contextlib.contextmanager
    def perturbing(arm, i):  # a capture that changes what it measures
        state["captured"] = True
        try:
            yield
        finally:
            state["captured"] = False

    study = repeat_study(fn, n=3, observer=perturbing)
    assert study.verdict is None and "capturing changes the outputs" in study.reason
    assert study.observer == {"arm": "default", "n": 3, "n_differ": 3, "held": False}
    quiet = repeat_study(fn, n=3, observer=lambda arm, i: contextlib.nullcontext())
    assert quiet.verdict == "deterministic" and quiet.observer["held"]


def test_observer_with_a_real_capture(tmp_path):
    torch = pytest.importorskip("torch")
    import dmlib

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))

    def fn():
        with torch.no_grad():
            return model(x)

    study = repeat_study(fn, n=2, observer=lambda arm, i: dmlib.capture(
        model, tmp_path / f"c{i}", ops=True))  # fmt: skip
    assert study.observer["held"] and study.observer["n"] == 2
    assert study.verdict in ("deterministic", "nondeterministic")  # this CPU's business
    assert (tmp_path / "c1" / "manifest.json").is_file()


def test_rates_from_files_and_digest_rules(tmp_path):
    a = tmp_path / "a.npy"
    b = tmp_path / "b.npy"
    np.save(a, np.float32([1, 2, 3]))
    np.save(b, np.float32([1, 2, 4]))
    study = repeat_rates({"files": [a, a, b, a]})
    t = study.table.set_index("arm")
    assert (t.loc["files", "n"], t.loc["files", "n_differ"], t.loc["files", "n_distinct"]) == (
        3,
        1,
        2,
    )
    # digests see dtype and shape, not only bytes
    assert digest(np.float32([1.0])) != digest(np.int32([1065353216]))
    assert digest(np.zeros((2, 3))) != digest(np.zeros((3, 2)))
    assert digest(np.float32([-0.0])) != digest(np.float32([0.0]))  # bits, not values
    with pytest.raises(DmlibError, match="need a reference and a repeat"):
        repeat_rates({"x": [a]})
    with pytest.raises(DmlibError, match="cannot hash"):
        digest(object())


def test_wilson_bounds_at_zero_and_all_are_exact():
    # by hand: at k = 0 the centre equals the half-width, so the lower bound is 0 exactly
    # (the rounded difference was 1.39e-17); at k = n the upper bound is 1 exactly
    assert wilson_interval(0, 20)[0] == 0.0
    assert wilson_interval(20, 20)[1] == 1.0
    assert f"{wilson_interval(0, 20)[0]:.3g}" == "0"


def test_digest_takes_token_lists_numbers_and_nested_python_data():
    same = [([1, 2, 3], [1, 2, 3]), (5, 5), (2.5, 2.5), (np.int64(3), np.int64(3)),
            ({"ids": [[1, 2], [3]], "text": "ab"}, {"text": "ab", "ids": [[1, 2], [3]]}),
            (10**40, 10**40), (None, None)]  # fmt: skip
    for x, y in same:
        assert digest(x) == digest(y)
    # each pair differs in value or in type: never one digest
    apart = [([1, 2, 3], [1, 2, 4]), ([1, 2], [[1, 2]]), (1, 1.0), (1, True), (0.0, -0.0),
             (["1"], [1]), (np.int64(3), np.int32(3)), ([[1, 2], [3]], [[1], [2, 3]])]  # fmt: skip
    for x, y in apart:
        assert digest(x) != digest(y), (x, y)
    for bad in ({1, 2}, object(), [1, {2}]):
        with pytest.raises(DmlibError, match="cannot hash an output of type"):
            digest(bad)
    # a str inside a container is text, never opened as a file
    assert digest(["/etc/passwd"]) != digest(["/etc/hosts"])


def test_distinct_outputs_their_frequencies_and_the_share_off_the_most_common():
    """10 runs of one arm, token-id lists: 7 alike, 2 alike, 1 alone. Off the most common
    output: 3 of 10, Wilson 95% [0.1078, 0.6032] (the textbook interval for 3/10)."""
    runs = [[1, 2, 3]] * 7 + [[1, 2, 4]] * 2 + [[9]]
    study = repeat_rates({"a": [runs[0], *runs[1:]]})
    t = study.table.set_index("arm")
    assert t.loc["a", "n_distinct"] == 3
    assert t.loc["a", "counts"] == [7, 2, 1]
    assert t.loc["a", "n_off_mode"] == 3 and t.loc["a", "off_mode_rate"] == pytest.approx(0.3)
    lo, hi = t.loc["a", "off_mode_low"], t.loc["a", "off_mode_high"]
    assert (round(lo, 4), round(hi, 4)) == (0.1078, 0.6032)
    assert "runs per output [7, 2, 1]" in study.reason and "3 of 10" in study.reason
    # the most common output need not be the reference: a reference alone against four
    # repeats alike differs from all four, yet only one run in five is off the mode
    t = repeat_rates({"b": [[5], [1], [1], [1], [1]]}).table.set_index("arm")
    assert t.loc["b", "n_differ"] == 4 and t.loc["b", "counts"] == [4, 1]
    assert t.loc["b", "n_off_mode"] == 1
    assert (t.loc["b", "off_mode_low"], t.loc["b", "off_mode_high"]) == pytest.approx(
        quadratic_roots(1, 5, Z95)
    )
    # ints and floats as outputs, too
    t = repeat_rates({"c": [1.5, 1.5, 1.5000001], "d": [7, 7]}).table.set_index("arm")
    assert t.loc["c", "counts"] == [2, 1] and t.loc["d", "n_distinct"] == 1

"""Helpers of :mod:`dmlib.io.hf_trainer`: optimizer moments named after their parameters,
and RNG state files whose numpy arrays the torch reader does not read.

Naming. ``optimizer.pt`` keys its state by parameter index (``state.9.exp_avg``). The
Trainer builds its optimizer from two groups (``Trainer.create_optimizer``): the parameters
that take weight decay, then those that do not (biases, norms), each in
``model.named_parameters()`` order. The names follow when that order is known:

1. from the architecture ``config.json`` names, rebuilt by transformers itself on the meta
   device (no weights are read, no code from the folder is run: the class must be one of
   transformers' own ``PreTrainedModel`` classes), its decay rule
   ``Trainer.get_decay_parameter_names``; or
2. from a weights file that keeps the state dict's order (``pytorch_model.bin``), with the
   decay rule applied to the names (``bias``, ``layernorm``, ``rmsnorm``, ``norm``).

Either way every moment's shape must equal its parameter's, and the group sizes must
match; otherwise, and where no order is known (``model.safetensors`` stores its tensors
sorted by name), the ids stay and ``metadata["optimizer_state_names"]`` says why.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from dmlib.tensor import ArrayTensorSet, TensorSet

# Trainer.get_decay_parameter_names' name patterns (transformers 4.5x-5.x)
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
_STATE = re.compile(r"^state\.(\d+)\.(.+)$")
_GROUP_PARAM = re.compile(r"^param_groups\.(\d+)\.params\.(\d+)$")

Order = tuple[list[tuple[str, tuple[int, ...]]], set[str], str]


def name_optimizer_state(
    ts: TensorSet, model: TensorSet | None, folder: str
) -> tuple[TensorSet, str]:
    """The optimizer's set with ``state.<id>.`` renamed ``state.<parameter name>.``, and a note."""
    ids_shape: dict[int, tuple[int, ...]] = {}
    for name, t in ts.items():
        m = _STATE.match(name)
        if m and t.shape:
            ids_shape.setdefault(int(m.group(1)), t.shape)
    if not ids_shape:
        return ts, ts.metadata.get("optimizer_state_names") or "no per-parameter state to name"
    groups = _groups(ts.scalars)
    order, why = _order(folder, model, sum(map(len, groups)) or len(ids_shape))
    if order is None:
        return ts, f"state keeps numeric parameter ids ({why})"
    names, problem = _assign(groups, order, ids_shape, model)
    if names is None:
        return ts, f"state keeps numeric parameter ids ({problem})"
    mapping = {}
    for name in ts:
        m = _STATE.match(name)
        if m and int(m.group(1)) in names:
            mapping[name] = f"state.{names[int(m.group(1))]}.{m.group(2)}"
    if len(set(mapping.values()) | (set(ts) - set(mapping))) != len(ts):
        return ts, "state keeps numeric parameter ids (parameter names would collide)"
    return ts.renamed(mapping), f"state named after parameters ({order[2]}; shapes checked)"


def _groups(scalars: Mapping[str, Any]) -> list[list[int]]:
    found: dict[int, dict[int, int]] = {}
    for k, v in scalars.items():
        m = _GROUP_PARAM.match(k)
        if m and isinstance(v, int) and not isinstance(v, bool):
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = v
    return [[g[i] for i in sorted(g)] for _, g in sorted(found.items())]


def _assign(
    groups: list[list[int]],
    order: Order,
    ids_shape: Mapping[int, tuple[int, ...]],
    model: TensorSet | None,
) -> tuple[dict[int, str] | None, str]:
    """id -> name by the Trainer's grouping (two groups) or by order (one group)."""
    params, decay, _ = order
    shape_of = dict(params)
    if len(groups) == 2:
        want = [[n for n, _ in params if n in decay], [n for n, _ in params if n not in decay]]
        rule = "the Trainer's decay / no-decay grouping"
    elif len(groups) == 1:
        want, rule = [[n for n, _ in params]], "the parameter order"
    else:
        return None, f"{len(groups)} parameter groups: neither the Trainer's two nor a single one"
    sizes = [len(g) for g in groups]
    if sizes != [len(w) for w in want]:
        return None, f"group sizes {sizes} do not match {rule} ({[len(w) for w in want]})"
    names: dict[int, str] = {}
    for ids, wanted in zip(groups, want, strict=True):
        for i, n in zip(ids, wanted, strict=True):
            if i in ids_shape and ids_shape[i] != shape_of[n]:
                return None, (
                    f"by {rule}, id {i} would be {n!r} of shape {list(shape_of[n])}, but its "
                    f"state has shape {list(ids_shape[i])}"
                )
            if model is not None and n in model and model[n].shape != shape_of[n]:
                return None, f"{n!r} has shape {list(model[n].shape)} in the weights file"
            names[i] = n
    return names, ""


def _order(folder: str, model: TensorSet | None, n_params: int) -> tuple[Order | None, str]:
    """The parameters in ``named_parameters()`` order, the decay set, and how it is known."""
    built, why = _architecture(folder, n_params)
    if built is not None:
        return built, ""
    if model is not None and model.format == "torch":
        params = [(n, t.shape) for n, t in model.items() if t.dtype.kind == "f"]
        decay = {n for n, _ in params if not _NO_DECAY.search(n)}
        return (params, decay, "the order of the torch weights file"), ""
    where = "no weights file" if model is None else f"the {model.format} weights file"
    return None, f"{where} does not record the parameter order, and {why}"


def _architecture(folder: str, n_params: int) -> tuple[Order | None, str]:
    """The order rebuilt from ``config.json``, unless the config declares more layers than
    the optimizer holds parameters (``n_params``): each layer has at least one, and building
    a config's model takes time and memory in proportion to its layers (2,000 layers: 24 s
    on the meta device), so a file cannot make dmlib build a model of a million layers."""
    from dmlib.errors import DmlibError
    from dmlib.io._folderfiles import json_member

    # a regular file inside the folder, of bounded size, keys and nesting (a FIFO is not
    # waited on)
    try:
        config, text = json_member(folder, "config.json", "config")
    except DmlibError:
        return None, "there is no readable config.json naming the architecture"
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        return None, "config.json does not name one architecture"
    layers = _declared_layers(config)
    if layers > n_params:
        return None, (
            f"config.json declares {layers:,} layers, more than the {n_params:,} parameters "
            "the optimizer holds: not rebuilt"
        )
    return _built(text, archs[0])


def _declared_layers(config: Any) -> int:
    """The largest layer count a config declares (``num_hidden_layers``, ``n_layer``,
    ``encoder_layers``...: any integer under a key naming layers), nested configs included."""
    most, stack = 0, [config]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, (dict, list)):
                    stack.append(v)
                elif "layer" in str(k).lower() and type(v) is int:
                    most = max(most, v)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return most


@functools.lru_cache(maxsize=8)
def _built(config_text: str, arch: str) -> tuple[Order | None, str]:
    """:func:`_rebuild`, kept on disk between processes (:func:`order_cache_dir`).

    Rebuilding imports transformers and the model's class (about 5 s of a 6 s
    ``dmlib compare`` of two Trainer checkpoints); its result depends only on the config
    text, the architecture and transformers' version, which key the cached file.
    """
    path = _cache_file(config_text, arch)
    cached = _read_order(path) if path is not None else None
    if cached is not None:
        return cached, ""
    order, why = _rebuild(config_text, arch)
    if order is not None and path is not None:
        _write_order(path, order)
    return order, why


#: the environment variable naming the cache folder ("off": no cache)
CACHE_ENV = "DMLIB_CACHE_DIR"
_ORDER_FORMAT = "dmlib-hf-param-order-v1"


def order_cache_dir() -> str | None:
    """Where rebuilt parameter orders are kept: ``$DMLIB_CACHE_DIR/hf-param-order`` (``off``:
    nowhere), else ``$XDG_CACHE_HOME/dmlib/...``, else ``~/.cache/dmlib/...``."""
    root = os.environ.get(CACHE_ENV)
    if root is not None and root.strip().lower() in ("off", "0", "none", ""):
        return None
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "dmlib")
    return os.path.join(root, "hf-param-order")


def _cache_file(config_text: str, arch: str) -> str | None:
    import hashlib
    import importlib.metadata

    where = order_cache_dir()
    if where is None:
        return None
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None  # not installed: nothing to rebuild with, nothing cached
    key = json.dumps([_ORDER_FORMAT, version, arch, config_text])
    return os.path.join(where, hashlib.sha256(key.encode()).hexdigest() + ".json")


def _read_order(path: str) -> Order | None:
    """A cached order, or None: absent, unreadable, or not exactly what :func:`_write_order`
    writes (a damaged or foreign file is rebuilt over, never half used)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.loads(f.read(1 << 24))
        if not isinstance(doc, dict) or doc.get("format") != _ORDER_FORMAT:
            return None
        params, decay, how = doc["params"], doc["decay"], doc["how"]
        out = [(n, tuple(shape)) for n, shape in params]
        ok = (
            isinstance(how, str) and isinstance(decay, list)
            and all(isinstance(n, str) for n in decay)
            and all(isinstance(n, str) and all(type(d) is int and d >= 0 for d in sh)
                    for n, sh in out)
        )  # fmt: skip
        return (out, set(decay), how) if ok else None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def _write_order(path: str, order: Order) -> None:
    """Keep ``order`` at ``path`` (atomically); a folder that cannot be written is skipped."""
    from dmlib._atomic import atomic_write_text

    params, decay, how = order
    doc = {"format": _ORDER_FORMAT, "params": [[n, list(s)] for n, s in params],
           "decay": sorted(decay), "how": how}  # fmt: skip
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_text(path, json.dumps(doc))
    except OSError:
        pass  # a read-only home: rebuilt next time


def _rebuild(config_text: str, arch: str) -> tuple[Order | None, str]:
    """The parameters of ``arch`` built by transformers on the meta device."""
    try:
        import torch
        import transformers
    except ImportError:
        return None, "transformers is not installed to rebuild it from config.json"
    cls = getattr(transformers, arch, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return None, f"config.json names {arch!r}, not a transformers model class"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = json.loads(config_text)
            config = transformers.AutoConfig.for_model(**raw)
            with torch.device("meta"):
                model = cls(config)
            decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    except Exception as err:  # a config this transformers cannot build: no order, said why
        return None, f"transformers could not build {arch} from config.json ({type(err).__name__})"
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    return (params, decay, f"{arch} rebuilt from config.json by transformers"), ""


# -- RNG states -----------------------------------------------------------------------------


def read_rng_states(path: str) -> TensorSet | None:
    """An RNG state file (``rng_state.pth``, ``random_states_0.pkl``) through torch's
    ``weights_only`` unpickler with exactly numpy's array constructors allowed; numpy arrays
    and torch tensors as tensors, plain values as scalars, named by key path. None when
    torch is absent or refuses the file."""
    try:
        import numpy as np
        import torch
    except ImportError:
        return None
    allowed: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    core: Any = getattr(np, "_core", None) or getattr(np, "core", None)  # numpy 2.x, 1.x
    allowed.append(core.multiarray._reconstruct)
    try:
        with torch.serialization.safe_globals(allowed):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return None
    arrays: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    _flat(obj, (), arrays, scalars)
    return ArrayTensorSet(arrays, path=path, format="torch", scalars=scalars)


def _flat(obj: Any, keys: tuple[Any, ...], arrays: dict[str, Any], scalars: dict[str, Any]) -> None:
    import numpy as np
    import torch

    name = ".".join(map(str, keys))
    if isinstance(obj, torch.Tensor):
        arrays[name] = obj.detach().cpu().contiguous().numpy()
    elif isinstance(obj, np.ndarray):
        arrays[name] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flat(v, (*keys, k), arrays, scalars)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flat(v, (*keys, i), arrays, scalars)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        scalars[name] = obj
    else:
        scalars[name] = f"<{type(obj).__name__}>"

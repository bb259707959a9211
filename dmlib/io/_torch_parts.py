"""torch tensors as dmlib Tensors: every dtype torch saves, and tensors stored in parts.

A plain (strided) tensor becomes one Tensor over its memory (memory-mapped when torch
loaded the file with ``mmap=True``). Tensors that are more than one array become named
parts, so that each part is compared on its own and nothing is silently densified:

- quantized: ``{name}.int_repr`` (the stored integers) and ``{name}.scale`` /
  ``{name}.zero_point`` (per tensor) or ``{name}.scales`` / ``{name}.zero_points`` /
  ``{name}.axis`` (per channel);
- sparse COO: ``{name}.indices``, ``{name}.values``; CSR/BSR: ``{name}.crow_indices``,
  ``{name}.col_indices``, ``{name}.values``; CSC/BSC: ``{name}.ccol_indices``,
  ``{name}.row_indices``, ``{name}.values``; each with ``{name}.shape`` (the dense shape).
  Indices are taken as stored (an uncoalesced COO tensor is not coalesced).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dmlib.errors import UnsupportedError
from dmlib.tensor import Tensor

# torch dtype name -> ml_dtypes type of its bits (one byte per value)
_ONE_BYTE_FLOATS = {
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
}

# sparse layout -> (names of its index parts, the methods that return them as stored)
_SPARSE = {
    "sparse_csr": (("crow_indices", "col_indices"), ("crow_indices", "col_indices")),
    "sparse_bsr": (("crow_indices", "col_indices"), ("crow_indices", "col_indices")),
    "sparse_csc": (("ccol_indices", "row_indices"), ("ccol_indices", "row_indices")),
    "sparse_bsc": (("ccol_indices", "row_indices"), ("ccol_indices", "row_indices")),
}


def dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tensor(name: str, arr: np.ndarray, path: str, dname: str, **kw: Any) -> Tensor:
    return Tensor(
        name, arr.dtype, arr.shape, nbytes=arr.nbytes, source=arr, path=path, dtype_name=dname, **kw
    )


def _dense(name: str, t: Any, path: str) -> Tensor:
    import ml_dtypes  # here, not at import: only torch files need it
    import torch

    t = t.detach().cpu().contiguous()
    dname = dtype_name(t)
    if t.dtype == torch.bfloat16:
        return _tensor(name, t.view(torch.int16).numpy().view(ml_dtypes.bfloat16), path, dname)
    if dname in _ONE_BYTE_FLOATS and hasattr(ml_dtypes, _ONE_BYTE_FLOATS[dname]):
        arr = t.view(torch.uint8).numpy().view(getattr(ml_dtypes, _ONE_BYTE_FLOATS[dname]))
        return _tensor(name, arr, path, dname)
    if dname == "float4_e2m1fn_x2":
        # two float4 values a byte, the first in the low nibble (PyTorch's Float4_e2m1fn_x2.h)
        raw = t.view(torch.uint8).numpy()
        shape = (*t.shape[:-1], 2 * t.shape[-1]) if t.dim() else (2,)
        return Tensor(
            name, np.dtype(ml_dtypes.float4_e2m1fn), shape, nbytes=raw.nbytes, source=raw,
            path=path, dtype_name=dname, packing="fp4x2",
        )  # fmt: skip
    if t.dtype == torch.complex32:
        # numpy has no complex32: its (real, imaginary) float16 pairs, one more axis
        return _tensor(name, torch.view_as_real(t).numpy(), path, dname)
    try:
        return _tensor(name, t.numpy(), path, dname)
    except (TypeError, RuntimeError):
        pass
    try:  # a dtype numpy does not know: its stored bytes, compared byte by byte
        raw = t.view(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    except (TypeError, RuntimeError) as err:
        raise UnsupportedError(
            f"tensor {name!r}: dtype {dname} cannot be read ({err})", path=path
        ) from None
    return Tensor(
        name,
        np.dtype("u1"),
        tuple(t.shape),
        nbytes=raw.nbytes,
        source=raw,
        path=path,
        dtype_name=dname,
        opaque=True,
    )


def entries(name: str, t: Any, path: str) -> dict[str, Tensor]:
    """The Tensor(s) that stand for torch tensor ``t`` saved under ``name``."""
    import torch

    layout = str(t.layout).removeprefix("torch.")
    shape = np.array(list(t.shape), np.int64)
    if layout == "sparse_coo":
        parts = {"indices": t._indices(), "values": t._values()}
    elif layout in _SPARSE:
        names, methods = _SPARSE[layout]
        parts = {n: getattr(t, m)() for n, m in zip(names, methods)}
        parts["values"] = t.values()
    elif layout != "strided":
        raise UnsupportedError(f"tensor {name!r}: layout {layout} is not supported", path=path)
    elif t.is_quantized:
        scheme = str(t.qscheme()).removeprefix("torch.")
        parts = {"int_repr": t.int_repr()}
        if scheme in ("per_tensor_affine", "per_tensor_symmetric"):
            parts["scale"] = torch.tensor(t.q_scale(), dtype=torch.float64)
            parts["zero_point"] = torch.tensor(t.q_zero_point(), dtype=torch.int64)
        elif scheme in (
            "per_channel_affine",
            "per_channel_symmetric",
            "per_channel_affine_float_qparams",
        ):
            parts["scales"] = t.q_per_channel_scales()
            parts["zero_points"] = t.q_per_channel_zero_points()
            parts["axis"] = torch.tensor(t.q_per_channel_axis(), dtype=torch.int64)
        else:
            raise UnsupportedError(
                f"tensor {name!r}: quantization scheme {scheme} is not supported", path=path
            )
        return {f"{name}.{k}": _dense(f"{name}.{k}", v, path) for k, v in parts.items()}
    else:
        return {name: _dense(name, t, path)}
    out = {f"{name}.{k}": _dense(f"{name}.{k}", v, path) for k, v in parts.items()}
    out[f"{name}.shape"] = _tensor(f"{name}.shape", shape, path, "int64")
    return out


def stored_entries(name: str, st: Any, path: str) -> dict[str, Tensor]:
    """The Tensor of a tensor read without torch (a ``torch_zip.StoredTensor``), exactly as
    :func:`_dense` makes it from the same tensor loaded by torch: same dtype, shape, bytes."""
    from dmlib.io.torch_zip import DTYPES, numpy_dtype

    dname = st.dtype_name
    item = DTYPES[dname][0]
    shape = tuple(st.shape)
    numel = st.numel

    def contiguous() -> np.ndarray:
        return np.ascontiguousarray(st.array(path)).reshape(-1).view(np.uint8)

    if dname == "float4_e2m1fn_x2":
        import ml_dtypes

        logical = (*shape[:-1], 2 * shape[-1]) if shape else (2,)
        return {name: Tensor(
            name, np.dtype(ml_dtypes.float4_e2m1fn), logical, nbytes=numel, source=contiguous,
            path=path, dtype_name=dname, packing="fp4x2",
        )}  # fmt: skip
    base = numpy_dtype(dname)
    if base is None:  # a dtype numpy does not know: its stored bytes
        return {name: Tensor(
            name, np.dtype("u1"), shape, nbytes=numel * item, source=contiguous, path=path,
            dtype_name=dname, opaque=True,
        )}  # fmt: skip
    if dname == "complex32":  # (real, imaginary) float16 pairs, one more axis
        base, shape = np.dtype("<f2"), (*shape, 2)
    return {name: Tensor(
        name, base, shape, nbytes=numel * item, source=contiguous, path=path, dtype_name=dname
    )}  # fmt: skip


def array_entry(name: str, arr: np.ndarray, path: str) -> dict[str, Tensor]:
    """A numpy array pickled inside a torch file (an RNG state) as a Tensor."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr.flags.writeable = False
    return {name: _tensor(name, arr, path, arr.dtype.name)}

"""The dtype table: every dtype astate-store moves, by wire name and by wire code.

Names, not torch objects, go to etcd and checkpoints; a manifest's ``dtypes`` column (and the
planner's ``src_dtype``/``dst_dtype`` fields) carry a dtype's *code*, its index in
:data:`DTYPE_NAMES`. Codes are on the wire: new dtypes go at the end, none is ever reordered.

Lookups by name: :func:`torch_dtype`, :func:`itemsize`, :func:`is_floating`; by torch dtype:
:func:`dtype_name`. By code (numpy arrays, for column-wise work): :data:`ITEMSIZES`,
:data:`FLOATING`. This module imports nothing of the package but ``errors``.
"""

from __future__ import annotations

import numpy as np
import torch

from astate_store.errors import LayoutError

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "DTYPE_CODES",
    "ITEMSIZES",
    "FLOATING",
    "TORCH_NAMES",
    "dtype_name",
    "torch_dtype",
    "itemsize",
    "is_floating",
]

#: Wire name -> torch dtype, in code order.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)  #: wire code -> name
DTYPE_CODES: dict[str, int] = {n: i for i, n in enumerate(DTYPE_NAMES)}  #: name -> wire code
TORCH_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}  #: torch dtype -> name
_ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
ITEMSIZES = np.array([_ITEMSIZE[n] for n in DTYPE_NAMES], dtype=np.int64)  #: bytes per element, by code
FLOATING = np.array([DTYPES[n].is_floating_point for n in DTYPE_NAMES], dtype=bool)  #: by code


def dtype_name(dtype: torch.dtype, *, tensor: str = "?") -> str:
    """Wire name of a torch dtype.

    Raises:
        LayoutError: the dtype is not one astate-store moves (complex, quantized, ...).
    """
    try:
        return TORCH_NAMES[dtype]
    except KeyError:
        raise LayoutError(
            f"tensor {tensor!r}: unsupported dtype {dtype}; supported: {', '.join(DTYPES)}"
        ) from None


def torch_dtype(name: str, *, tensor: str = "?") -> torch.dtype:
    """The torch dtype of a wire name.

    Raises:
        LayoutError: no dtype has that name.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise LayoutError(f"tensor {tensor!r}: unknown dtype name {name!r}") from None


def itemsize(name: str) -> int:
    """Bytes per element of the dtype named ``name``."""
    return _ITEMSIZE[name]


def is_floating(name: str) -> bool:
    """Whether the dtype named ``name`` is a floating-point one (conversions go between those)."""
    return DTYPES[name].is_floating_point

"""The ``astate_store._delta`` extension (``native/astate_delta.c``): loading it, with XXH3 taken
from the ``xxhash`` package's extension, and the column layouts of the tables it reads.

Tables are int64/uint64 numpy arrays, one row per item; the columns are named here once.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

__all__ = ["native", "hashing", "threads", "SH_COLS", "TL_COLS", "GE_COLS", "TD_COLS"]

# stage(): per shard (src, dst, prev or 0, esize, C, TC, gc, P, TB, gb, nbands, first tile row)
SH_COLS = 12
# stage() fills per tile (count | enc << 56, encoded length, digest, arena location)
TL_COLS = 4
# decode()/digest(): per (shard, box) geometry (esize, C, TC, nbands, gb, P, TB, row_map address,
# c0, c1, col_stride, destination address or 0 for output arrays)
GE_COLS = 12
# decode(): per tile (geometry, tile id, data address, count | enc << 56, data length, out_off
# address, out_val address)
TD_COLS = 7

_mod: Any = None
_hashing = False
_lock = threading.Lock()


def native() -> Any:
    """The extension, with XXH3 loaded when the ``xxhash`` package exports it."""
    global _mod, _hashing
    if _mod is None:
        with _lock:
            if _mod is None:
                from astate_store import _delta

                try:
                    import xxhash._xxhash as xx

                    _hashing = bool(_delta.load_xxh3(xx.__file__))
                except (ImportError, AttributeError, OSError):
                    _hashing = False
                _mod = _delta
    return _mod


def hashing() -> bool:
    """Whether tile digests are computed (XXH3 found in the ``xxhash`` package's extension)."""
    native()
    return _hashing


def threads() -> int:
    """Threads for the native passes: ``$ASTATE_COPY_THREADS``, else this process's CPUs (at
    most 8), as the put's plain copy uses."""
    env = os.environ.get("ASTATE_COPY_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return min(int(env), 16)
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return max(1, min(8, os.cpu_count() or 1))


def table(n: int, cols: int, dtype: Any = np.int64) -> np.ndarray:
    return np.zeros((n, cols), dtype=dtype)

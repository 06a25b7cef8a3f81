"""Helpers every planning stage shares: deterministic ordering of caller ids, vectorized segment
and row primitives (so no stage loops in Python per piece), and a GC pause for bulk allocation."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import numpy as np


def sort_key(x: Any) -> tuple:
    """Total order over mixed id types (ints, strings, tuples...) so plans never depend on the
    caller's mapping order."""
    return (type(x).__name__, x if isinstance(x, (int, float, str)) else repr(x))


def sorted_ids(ids: Iterable[Hashable]) -> list:
    """``ids`` sorted naturally when comparable, else by ``sort_key``."""
    ids = list(ids)
    try:
        return sorted(ids)
    except TypeError:
        return sorted(ids, key=sort_key)


def concat(parts: list[np.ndarray], shape: tuple) -> np.ndarray:
    """Concatenate chunked int64 parts; an empty int64 array of ``shape`` when there are none."""
    return np.concatenate(parts) if parts else np.zeros(shape, np.int64)


def segment_arange(counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(c) for c in counts])`` without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(a, axis=0, return_index=True, return_inverse=True)`` via a 64-bit row hash
    (verified; falls back to the exact method on a collision). Unique rows come in first-seen order."""
    n = len(a)
    if n == 0:
        return a[:0], np.zeros(0, np.int64), np.zeros(0, np.int64)
    a = np.ascontiguousarray(a, dtype=np.int64)
    h = np.zeros(n, np.int64)
    with np.errstate(over="ignore"):
        for j in range(a.shape[1]):
            h = (h ^ a[:, j]) * np.int64(-7046029254386353131) + np.int64(
                (j * 0x9E3779B97F4A7C1 + 1) & 0x3FFFFFFFFFFFFFFF
            )
            h ^= h >> np.int64(29)
    uh, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    if not (a[first][inv] == a).all():
        _, first, inv = np.unique(a, axis=0, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
    # first-seen order
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    first = first[order]
    return a[first], first, rank[inv]

"""Byte ranges merged into runs: what a pull reads from each source region, as few spans.

A column-split consumer reads only some of a slot's bytes (its own pre-packed copies and the
shards it needs, not the other consumers' copies between them). Prefaulting from the first
byte it reads to the last mapped up to three times what it read (page tables filled for
bytes it never reads, on each consumer). Runs follow the reads instead: ranges closer than
``gap`` bytes merge (mapping a 64 KiB gap costs about as much as one more ``madvise`` call),
and at most ``max_runs`` runs per key come out (the widest gaps are kept), so 10^5 tiny reads
cost a bounded number of calls. Pure numpy; imports nothing above it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GAP", "MAX_RUNS", "span_runs"]

GAP = 64 << 10
MAX_RUNS = 256


def span_runs(
    key: np.ndarray, lo: np.ndarray, hi: np.ndarray, *, gap: int = GAP, max_runs: int = MAX_RUNS
) -> list[tuple[int, int, int]]:
    """``(key, lo, hi)`` runs covering every range ``[lo[i], hi[i])`` of ``key[i]``, sorted,
    disjoint per key; ranges less than ``gap`` bytes apart share a run, and each key has at
    most ``max_runs`` runs (beyond that the narrowest gaps are closed too)."""
    if max_runs < 1:
        raise ValueError(f"max_runs must be >= 1, got {max_runs}")
    key, lo, hi = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (key, lo, hi))
    keep = hi > lo
    if not keep.all():
        key, lo, hi = key[keep], lo[keep], hi[keep]
    n = len(lo)
    if n == 0:
        return []
    order = np.lexsort((lo, key))
    k, a, b = key[order], lo[order], hi[order]
    new_key = np.ones(n, dtype=bool)
    new_key[1:] = k[1:] != k[:-1]
    reach = _running_max(b, new_key)  # the furthest byte any earlier range of this key reaches
    gaps = np.zeros(n, dtype=np.int64)
    gaps[1:] = a[1:] - reach[:-1]
    starts = np.flatnonzero(new_key | (gaps >= gap))
    starts = _thin(starts, gaps, new_key, max_runs)
    ends = np.maximum.reduceat(b, starts)
    return list(zip(k[starts].tolist(), a[starts].tolist(), ends.tolist()))


def _running_max(b: np.ndarray, new_key: np.ndarray) -> np.ndarray:
    """Running maximum of ``b`` restarting where ``new_key``: one accumulate over values lifted
    by a per-key offset (each key's values above every earlier key's), per key if that could
    overflow."""
    rank = np.cumsum(new_key) - 1
    span = int(b.max()) + 1
    if (int(rank[-1]) + 1) * span < (1 << 62):
        lift = rank * span
        return np.maximum.accumulate(b + lift) - lift
    cuts = np.flatnonzero(new_key)[1:]
    return np.concatenate([np.maximum.accumulate(part) for part in np.split(b, cuts)])


def _thin(starts: np.ndarray, gaps: np.ndarray, new_key: np.ndarray, max_runs: int) -> np.ndarray:
    """Drop run starts (closing their gaps, narrowest first) until no key has more than
    ``max_runs`` runs; a key's first start always stays."""
    key_of = np.cumsum(new_key)[starts]
    counts = np.bincount(key_of)
    if counts.max() <= max_runs:
        return starts
    firsts = new_key[starts]
    inner = np.flatnonzero(~firsts)  # starts that may go
    kk, width = key_of[inner], gaps[starts[inner]]
    order = np.lexsort((-width, kk))  # per key, widest gap first (stable among equals)
    sk = kk[order]
    group = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    rank = np.arange(len(order)) - np.repeat(group, np.diff(np.r_[group, len(order)]))
    keep = np.ones(len(starts), dtype=bool)
    keep[inner[order[rank >= max_runs - 1]]] = False
    return starts[keep]

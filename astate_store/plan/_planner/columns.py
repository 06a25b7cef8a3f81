"""The reads of whole-tensor buffers, planned from the sources' shard columns.

The common first pull — a rollout holding every tensor whole, publishers whose shards tile each
tensor along one dim (FSDP, dim-0 tensor parallelism, replicas) — needs one read per shard: the
shard's bytes are one contiguous range at both ends. ``whole_buffer_reads`` finds those reads in
numpy over the layouts' columns, without the per-shard and per-tensor objects the general planner
starts from (Python objects, one per shard: the bulk of a large model's first plan). Anything else —
a grid tiling, a strided shard, a buffer that is not a whole contiguous tensor, another dtype —
returns None and the general planner decides (and names any error). Pure: no catalog, no transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, repeat

import numpy as np

from astate_store.model.dtypes import ITEMSIZES
from astate_store.model.layout import ShardColumns

__all__ = ["whole_buffer_reads", "READ_COLUMNS"]

# columns of the reads: source index, source region, byte offset in it, buffer index, byte offset
# in the buffer, length
READ_COLUMNS = ("source", "region", "src_offset", "buffer", "dst_offset", "length")
_MAX_NDIM = 16


def whole_buffer_reads(
    sources: Sequence[ShardColumns],
    names: Sequence[str],
    dtypes: np.ndarray,
    shapes: Sequence[tuple[int, ...]],
    rotation: int = 0,
) -> np.ndarray | None:
    """One read per shard a buffer takes: ``(n, 6)`` int64 rows (``READ_COLUMNS``), every byte of
    every buffer read once, replicas chosen by ``(rotation + box index) % replicas``, the rows of
    the sources interleaved in proportion to their bytes. ``names`` / ``dtypes`` (codes, as in
    ``ShardColumns``) / ``shapes``: the buffers, each a whole contiguous tensor, one per name.
    None when any of it is not that simple case (the general planner's)."""
    cols = _concat(sources)
    if cols is None or not len(names):
        return None
    src, names_all, dt, nd, gs, off, sz, st, region, boff = cols
    index = dict(zip(names, range(len(names))))
    buf = np.fromiter(map(index.get, names_all, repeat(-1)), np.int64, len(names_all))
    keep = buf >= 0
    if not keep.any() or len(np.unique(buf[keep])) != len(names):
        return None  # a buffer no source holds: the planner names it
    src, buf, dt, nd, gs, off, sz, st, region, boff = (
        a[keep] for a in (src, buf, dt, nd, gs, off, sz, st, region, boff)
    )
    want_nd = np.fromiter(map(len, shapes), np.int64, len(shapes))
    if int(want_nd.max()) > gs.shape[1]:
        return None
    want_gs = _padded_rows(shapes, want_nd, gs.shape[1])
    if not ((dt == dtypes[buf]) & (nd == want_nd[buf]) & (gs == want_gs[buf]).all(1)).all():
        return None  # another dtype (a conversion) or shape: the planner's
    order = np.lexsort((np.arange(len(buf)), region, src, *sz.T[::-1], *off.T[::-1], buf))
    src, buf, dt, gs, off, sz, st, region, boff = (
        a[order] for a in (src, buf, dt, gs, off, sz, st, region, boff)
    )
    chosen = _tiled(buf, gs, off, sz, src, rotation)
    if chosen is None or not _contiguous(gs, off, sz, st)[chosen].all():
        return None
    item = ITEMSIZES[dt[chosen]]
    dst_strides = _row_major(gs[chosen])
    length = item * np.prod(sz[chosen], axis=1)
    rows = np.stack(
        [
            src[chosen],
            region[chosen],
            boff[chosen],
            buf[chosen],
            item * (off[chosen] * dst_strides).sum(1),
            length,
        ],
        axis=1,
    )
    return _interleaved(rows[length > 0])


def _concat(sources: Sequence[ShardColumns]) -> tuple[np.ndarray, ...] | None:
    """Every source's shards in one table, dims padded to the widest (size 1, offset 0)."""
    if not sources or not all(c.bounded for c in sources):
        return None
    nd = np.concatenate([c.ndims.astype(np.int64) for c in sources])
    if not len(nd):
        return None
    width = max(1, int(nd.max()))
    if width > _MAX_NDIM:
        return None
    flat = [
        np.concatenate([getattr(c, f) for c in sources])
        for f in ("global_shapes", "offsets", "sizes", "strides")
    ]
    gs, off, sz, st = (_padded(a, nd, width, fill) for a, fill in zip(flat, (1, 0, 1, 0)))
    src = np.repeat(np.arange(len(sources)), [len(c.names) for c in sources])
    names = list(chain.from_iterable(c.names for c in sources))
    dt = np.concatenate([c.dtypes.astype(np.int64) for c in sources])
    region = np.concatenate([c.regions for c in sources])
    boff = np.concatenate([c.byte_offsets for c in sources])
    return src, names, dt, nd, gs, off, sz, st, region, boff  # type: ignore[return-value]


def _padded(flat: np.ndarray, nd: np.ndarray, width: int, fill: int) -> np.ndarray:
    out = np.full((len(nd), width), fill, dtype=np.int64)
    starts = np.cumsum(nd) - nd
    out[np.repeat(np.arange(len(nd)), nd), np.arange(len(flat)) - np.repeat(starts, nd)] = flat
    return out


def _padded_rows(shapes: Sequence[tuple[int, ...]], nd: np.ndarray, width: int) -> np.ndarray:
    flat = np.fromiter(chain.from_iterable(shapes), np.int64, int(nd.sum()))
    return _padded(flat, nd, width, 1)


def _tiled(
    buf: np.ndarray, gs: np.ndarray, off: np.ndarray, sz: np.ndarray, src: np.ndarray, rotation: int
) -> np.ndarray | None:
    """Indices (into the rows, sorted by buffer, box, source) of one replica of each distinct
    box, when every buffer's distinct boxes are its whole tensor alone or tile it along one dim
    in order; else None. Replicas: the boxes held by the same sources are taken from each of
    them in turn (``rotation`` + the box's index among those), so DP replicas share the reads."""
    n = len(buf)
    first = np.ones(n, dtype=bool)
    first[1:] = buf[1:] != buf[:-1]
    distinct = first.copy()
    distinct[1:] |= (off[1:] != off[:-1]).any(1) | (sz[1:] != sz[:-1]).any(1)
    d = np.flatnonzero(distinct)
    partial = (off[d] != 0) | (sz[d] != gs[d])
    n_partial = partial.sum(1)
    k = partial.argmax(1)
    rows = np.arange(len(d))
    lo, size, full = off[d][rows, k], sz[d][rows, k], gs[d][rows, k]
    d_first = first[d]
    d_last = np.ones(len(d), dtype=bool)
    d_last[:-1] = d_first[1:]
    prev_end = np.zeros(len(d), dtype=np.int64)
    prev_end[1:] = lo[:-1] + size[:-1]
    same_k = np.ones(len(d), dtype=bool)
    same_k[1:] = k[1:] == k[:-1]
    alone = d_first & d_last & (n_partial == 0)
    chained = (
        (n_partial == 1)
        & (size > 0)
        & (lo == np.where(d_first, 0, prev_end))
        & (same_k | d_first)
        & (~d_last | (lo + size == full))
    )
    if not (alone | chained).all():
        return None
    replicas = np.diff(np.append(d, n))
    family = (
        src[d] * (int(replicas.max()) + 1) + replicas
    )  # (first holder, holders): the same replica set, mostly
    by = np.argsort(family, kind="stable")
    fam_sorted = family[by]
    starts = np.flatnonzero(np.concatenate(([True], fam_sorted[1:] != fam_sorted[:-1])))
    turn = np.empty(len(d), dtype=np.int64)
    turn[by] = np.arange(len(d)) - np.repeat(starts, np.diff(np.append(starts, len(d))))
    return d + (rotation + turn) % replicas


def _contiguous(gs: np.ndarray, off: np.ndarray, sz: np.ndarray, st: np.ndarray) -> np.ndarray:
    """Per row: the box is one range of its row-major tensor (dims before the split dim are 1
    wide) and the shard is dense in its region (strides of the dims wider than 1 are row-major)."""
    partial = (off != 0) | (sz != gs)
    before = np.cumsum(partial[:, ::-1], axis=1)[:, ::-1] - partial  # partial dims after each dim
    one_range = ((sz == 1) | (before == 0)).all(1)  # wider than 1 only where no later dim is partial
    dense = ((sz <= 1) | (st == _row_major(sz))).all(1)
    return one_range & dense


def _row_major(sizes: np.ndarray) -> np.ndarray:
    """Row-major element strides of each row's sizes (padding dims are 1 wide at the end)."""
    out = np.ones_like(sizes)
    if sizes.shape[1] > 1:
        out[:, :-1] = np.cumprod(np.maximum(sizes[:, :0:-1], 1), axis=1)[:, ::-1]
    return out


def _interleaved(rows: np.ndarray) -> np.ndarray:
    """Each source's rows in address order, the sources interleaved in proportion to the bytes
    each serves (every publisher busy from the first read to the last)."""
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    if not len(rows):
        return rows
    src, length = rows[:, 0], rows[:, 5].astype(np.float64)
    total = np.bincount(src, weights=length)
    before = np.cumsum(length) - length
    start = np.zeros(len(total))
    start[1:] = np.cumsum(total)[:-1]
    share = (before - start[src]) / np.maximum(total[src], 1.0)
    return rows[np.lexsort((src, share))]

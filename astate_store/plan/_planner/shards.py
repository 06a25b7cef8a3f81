"""Stage 1, publisher shards: compile the committed layouts into flat arrays of distinct source
boxes per tensor and their replica records, so later stages join boxes without Python objects.

Compiled once per set of layout objects (memoized by identity): a steady-state replan skips it.
"""

from __future__ import annotations

import copy
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from itertools import chain, repeat
from operator import attrgetter, is_, ne

import numpy as np

from astate_store.errors import PlanError
from astate_store.model.dtypes import DTYPE_CODES
from astate_store.model.layout import ShardRecord, TensorLayout
from astate_store.plan._planner.util import sorted_ids

_GET_META = attrgetter("name", "dtype", "global_shape")
_GET_OFFS = attrgetter("box.offsets")
_GET_SIZES = attrgetter("box.sizes")
_GET_STRIDES = attrgetter("strides")
_GET_RANK = attrgetter("rank")
_GET_REGION = attrgetter("region")
_GET_BOFF = attrgetter("byte_offset")
_GET_DTYPE = attrgetter("dtype")
_GET_GSHAPE = attrgetter("global_shape")
_GET_SHARDS = attrgetter("shards")
_GET_NAME = attrgetter("name")


def _layout_ndim(n: str, lay: object) -> int:
    if not isinstance(lay, TensorLayout):
        raise PlanError(f"tensor {n!r}: layout must be a TensorLayout, got {type(lay).__name__}")
    if lay.name != n:
        raise PlanError(f"tensor {n!r}: layout mapping key differs from its name {lay.name!r}")
    return len(lay.global_shape)


def _padded(flat: np.ndarray, lens: np.ndarray, valid: np.ndarray, D: int, fill: int) -> np.ndarray:
    """Rows of varying length (``lens``, concatenated in ``flat``) right-aligned (left-padded with
    ``fill``) in a ``(len(lens), D)`` array; rows where ``valid`` is False stay all ``fill``."""
    m = len(lens)
    out = np.full((m, D), fill, np.int64)
    total = len(flat)
    if total == 0:
        return out
    # flat element j of row r goes to r * D + (D - lens[r]) + j
    start = np.cumsum(lens) - lens
    pos = np.arange(total, dtype=np.int64) + np.repeat(
        np.arange(m, dtype=np.int64) * D + D - lens - start, lens
    )
    if not valid.all():
        keep = np.repeat(valid, lens)
        pos, flat = pos[keep], flat[keep]
    out.reshape(-1)[pos] = flat
    return out


class _Columns:
    """Every attribute of every record as arrays: box offsets / sizes and strides as (lengths, flat
    values), rank, region, byte offset, and whether (name, dtype, global shape) differs from the
    record's tensor (``meta``: per record, the expected triple).

    Gathered in chunks of records, every column of a chunk together: the records and their tuples
    are scattered in memory, and one pass over all of them per column would miss the cache on
    every object of every pass."""

    CHUNK = 2048

    def __init__(self, recs: list, meta: list):
        parts: list[list[np.ndarray]] = [[] for _ in range(10)]
        for a in range(0, len(recs), self.CHUNK):
            ch = recs[a : a + self.CHUNK]
            m = len(ch)
            cols = []
            for get in (_GET_OFFS, _GET_SIZES, _GET_STRIDES):
                rows = list(map(get, ch))
                lens = np.fromiter(map(len, rows), np.int64, m)
                cols += [lens, np.fromiter(chain.from_iterable(rows), np.int64, int(lens.sum()))]
            for get in (_GET_RANK, _GET_REGION, _GET_BOFF):
                cols.append(np.fromiter(map(get, ch), np.int64, m))
            cols.append(np.fromiter(map(ne, map(_GET_META, ch), meta[a : a + m]), bool, m))
            for part, col in zip(parts, cols):
                part.append(col)
        cat = [
            np.concatenate(p) if p else np.zeros(0, bool if i == 9 else np.int64) for i, p in enumerate(parts)
        ]
        (
            self.l_lo,
            self.lo,
            self.l_sz,
            self.sz,
            self.l_st,
            self.st,
            self.rank,
            self.region,
            self.boff,
            self.meta_bad,
        ) = cat


def _first_error(
    names: list,
    dts: list,
    shapes: list,
    recs: list,
    rt: np.ndarray,
    t_unknown: np.ndarray,
    flags: list[np.ndarray],
) -> None:
    """Raise the error of the first bad tensor in name order, its checks in the order: dtype, shard
    metadata, box/strides ndim, bounds, strides/byte offset (``flags``: per-record masks of the last
    four)."""
    T = len(names)
    per_t = [t_unknown] + [np.bincount(rt[f], minlength=T) > 0 for f in flags]
    bad_t = np.logical_or.reduce(per_t)
    ti = int(np.flatnonzero(bad_t)[0])
    n, dt, gs = names[ti], dts[ti], shapes[ti]
    kind = next(k for k, f in enumerate(per_t) if f[ti])
    if kind == 0:
        raise PlanError(f"tensor {n!r}: unknown dtype {dt!r}")
    if kind == 1:
        s = recs[int(np.flatnonzero(flags[0] & (rt == ti))[0])]
        raise PlanError(
            f"tensor {n!r}: rank {s.rank} shard ({s.name!r}, {s.dtype}, {tuple(s.global_shape)}) "
            f"disagrees with the layout ({dt}, {gs})"
        )
    if kind == 2:
        raise PlanError(f"tensor {n!r}: a publisher shard has a box/strides of the wrong ndim for {gs}")
    if kind == 3:
        raise PlanError(f"tensor {n!r}: a publisher shard box is out of bounds of {gs}")
    raise PlanError(f"tensor {n!r}: a publisher shard has negative strides or byte offset")


class Sources:
    """Publisher layouts as arrays: distinct boxes per tensor and their replica records.

    Dims are left-padded to the widest tensor (``D``: offset 0, size 1, stride 0) so every
    tensor shares one array shape. Box ``b`` of tensor ``t`` lies in ``t_bs[t] .. t_bs[t] +
    t_bc[t]``; its replicas are records ``box_rs[b] .. box_rs[b] + box_rc[b]``. Within a tensor,
    records are sorted by (box offsets, box sizes, rank, region, byte offset); records with an
    empty box are left out.

    Compiled column-wise: every attribute of every shard record is gathered once and checked,
    sorted and grouped with array operations over all tensors together (no per-tensor numpy).
    """

    def __init__(self, layouts: Mapping[str, TensorLayout]):
        names = sorted_ids(layouts)
        self.names = tuple(names)
        self.tid = dict(zip(names, range(len(names))))
        T = len(names)
        lays = list(map(layouts.__getitem__, names))
        if not all(map(isinstance, lays, repeat(TensorLayout))) or list(map(_GET_NAME, lays)) != names:
            for n, lay in zip(names, lays):
                _layout_ndim(n, lay)
        dts = list(map(_GET_DTYPE, lays))
        shapes = list(map(tuple, map(_GET_GSHAPE, lays)))
        shard_lists = list(map(_GET_SHARDS, lays))
        nds = np.fromiter(map(len, shapes), np.int64, T)
        D = max(int(nds.max()) if T else 0, 1)
        self.D = D
        self.shapes: list[tuple] = shapes
        self.dtypes: list[str] = dts
        codes = np.fromiter(map(DTYPE_CODES.get, dts, repeat(-1)), np.int64, T)
        t_unknown = codes < 0
        self.t_code = np.where(t_unknown, 0, codes)
        self.t_shape = _padded(
            np.fromiter(chain.from_iterable(shapes), np.int64, int(nds.sum())), nds, np.ones(T, bool), D, 1
        )
        # every record of every tensor, in tensor (name) order, then shard order
        cnt = np.fromiter(map(len, shard_lists), np.int64, T)
        recs = list(chain.from_iterable(shard_lists))
        rt = np.repeat(np.arange(T, dtype=np.int64), cnt)
        t_meta = list(zip(names, dts, shapes))
        c = _Columns(recs, list(map(t_meta.__getitem__, rt.tolist())))
        nd_r = nds[rt]
        valid = (c.l_lo == nd_r) & (c.l_sz == nd_r) & (c.l_st == nd_r)
        lo = _padded(c.lo, c.l_lo, valid, D, 0)
        sz = _padded(c.sz, c.l_sz, valid, D, 1)
        st = _padded(c.st, c.l_st, valid, D, 0)
        oob = ((lo < 0) | (sz < 0) | (lo + sz > self.t_shape[rt])).any(axis=1)
        neg = (st < 0).any(axis=1) | (c.boff < 0)
        if t_unknown.any() or c.meta_bad.any() or not valid.all() or oob.any() or neg.any():
            _first_error(names, dts, shapes, recs, rt, t_unknown, [c.meta_bad, ~valid, oob, neg])
        self._group(T, recs, rt, lo, sz, st, c)
        # per-tensor salt of the rotation balancer: stable across processes (not ``hash``)
        self.tensor_salt = np.fromiter(map(zlib.crc32, map(str.encode, names)), np.int64, T)

    def _group(
        self, T: int, recs: list, rt: np.ndarray, lo: np.ndarray, sz: np.ndarray, st: np.ndarray, c: _Columns
    ) -> None:
        """Sort the (checked, padded) records, drop empty boxes, and delimit distinct boxes and tensors."""
        M = len(recs)
        # one sort of all records by (tensor, box offsets, box sizes, rank, region, byte offset);
        # padded dims are constant within a tensor, so each tensor's order is its own
        D = self.D
        keys = (
            [c.boff, c.region, c.rank]
            + [sz[:, d] for d in reversed(range(D))]
            + [lo[:, d] for d in reversed(range(D))]
            + [rt]
        )
        order = np.lexsort(keys) if M else np.zeros(0, np.int64)
        # empty boxes hold nothing (a 0-d box, all pads 1, is never empty)
        order = order[sz[order].min(axis=1) > 0] if M else order
        m = len(order)
        lo, sz, st, rt = lo[order], sz[order], st[order], rt[order]
        new = np.ones(m, bool)
        if m > 1:
            new[1:] = (rt[1:] != rt[:-1]) | (lo[1:] != lo[:-1]).any(axis=1) | (sz[1:] != sz[:-1]).any(axis=1)
        starts = np.flatnonzero(new).astype(np.int64)
        self.box_lo = lo[starts]
        self.box_sz = sz[starts]
        self.box_rs = starts
        self.box_rc = np.diff(np.append(starts, np.int64(m))).astype(np.int64)
        self.t_bc = np.bincount(rt[starts], minlength=T).astype(np.int64)
        self.t_bs = (np.cumsum(self.t_bc) - self.t_bc).astype(np.int64)
        self.n_layout_recs = m
        self.rec_rank = c.rank[order]
        self.rec_region = c.region[order]
        self.rec_off = c.boff[order]
        self.rec_str = st
        self.rec_lo = lo
        self.rec_t = rt
        self.rec_obj: list[ShardRecord] = list(map(recs.__getitem__, order.tolist()))

    def with_packed(self, recs: list[ShardRecord]) -> tuple[Sources, np.ndarray, np.ndarray]:
        """A copy with packed records appended as extra source records; returns
        ``(sources, record indices, padded box sizes)``.

        The records are gathered and checked column-wise like the layout's (``_Columns``): a
        fleet's pre-pack round trip brings back one record per packed box, tens of thousands."""
        D = self.D
        m = len(recs)
        new = copy.copy(self)
        if m == 0:
            return new, np.zeros(0, np.int64), np.zeros((0, D), np.int64)
        if not all(map(isinstance, recs, repeat(ShardRecord))):
            r = next(r for r in recs if not isinstance(r, ShardRecord))
            raise PlanError(f"packed source must be a ShardRecord, got {type(r).__name__}")
        tids = np.fromiter(map(self.tid.get, map(_GET_NAME, recs), repeat(-1)), np.int64, m)
        if (tids < 0).any():
            r = recs[int(np.flatnonzero(tids < 0)[0])]
            raise PlanError(f"tensor {r.name!r}: packed source for a tensor not in the layout")
        t_meta = list(zip(self.names, self.dtypes, self.shapes))
        c = _Columns(recs, list(map(t_meta.__getitem__, tids.tolist())))
        nd = np.fromiter(map(len, self.shapes), np.int64, len(self.shapes))[tids]
        valid = (c.l_lo == nd) & (c.l_sz == nd) & (c.l_st == nd)
        if c.meta_bad.any() or not valid.all():
            r = recs[int(np.flatnonzero(c.meta_bad | ~valid)[0])]
            t = self.tid[r.name]
            raise PlanError(
                f"tensor {r.name!r}: packed source ({r.dtype}, {tuple(r.global_shape)}, box "
                f"{r.box.offsets}+{r.box.sizes}) disagrees with the layout ({self.dtypes[t]}, "
                f"{self.shapes[t]})"
            )
        lo = _padded(c.lo, c.l_lo, valid, D, 0)
        sz = _padded(c.sz, c.l_sz, valid, D, 1)
        st = _padded(c.st, c.l_st, valid, D, 0)
        offs = c.boff
        bad = (
            (lo < 0).any(axis=1)
            | (sz < 0).any(axis=1)
            | (lo + sz > self.t_shape[tids]).any(axis=1)
            | (st < 0).any(axis=1)
            | (offs < 0)
        )
        if bad.any():
            r = recs[int(np.flatnonzero(bad)[0])]
            raise PlanError(
                f"tensor {r.name!r}: packed source box {r.box.offsets}+{r.box.sizes} out of bounds of "
                f"{tuple(r.global_shape)} or with negative strides / byte offset"
            )
        base = len(self.rec_rank)
        new.rec_rank = np.concatenate([self.rec_rank, c.rank])
        new.rec_region = np.concatenate([self.rec_region, c.region])
        new.rec_off = np.concatenate([self.rec_off, offs])
        new.rec_str = np.concatenate([self.rec_str, st])
        new.rec_lo = np.concatenate([self.rec_lo, lo])
        new.rec_t = np.concatenate([self.rec_t, tids])
        new.rec_obj = self.rec_obj + list(recs)
        return new, base + np.arange(m, dtype=np.int64), sz


_SRC_MEMO: OrderedDict[tuple, tuple] = OrderedDict()


def compile_sources(layouts: Mapping[str, TensorLayout]) -> Sources:
    """``Sources(layouts)``, memoized on the identity of the layout objects (the memo keeps
    them alive, so ids stay valid): a replan with unchanged layouts skips recompiling."""
    names = sorted_ids(layouts)
    objs = tuple(map(layouts.__getitem__, names))
    key = (tuple(names), tuple(map(id, objs)))
    hit = _SRC_MEMO.get(key)
    if hit is not None and all(map(is_, hit[0], objs)):
        _SRC_MEMO.move_to_end(key)
        return hit[1]
    src = Sources(layouts)
    _SRC_MEMO[key] = (objs, src)
    while len(_SRC_MEMO) > 2:
        _SRC_MEMO.popitem(last=False)
    return src

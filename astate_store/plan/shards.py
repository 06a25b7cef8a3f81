"""Stage 1, publisher shards: compile the committed layouts into flat arrays of distinct source
boxes per tensor and their replica records, so later stages join boxes without Python objects.

Compiled once per set of layout objects (memoized by identity): a steady-state replan skips it.
"""

from __future__ import annotations

import copy
import zlib
from collections import OrderedDict
from operator import attrgetter
from typing import Mapping, NamedTuple, Optional, Sequence

import numpy as np

from ..errors import PlanError
from ..layout import ShardRecord, TensorLayout
from .contracts import _CODE
from .util import _cat, _sorted_ids

_GET_META = attrgetter("name", "dtype", "global_shape")
_GET_OFFS = attrgetter("box.offsets")
_GET_SIZES = attrgetter("box.sizes")
_GET_STRIDES = attrgetter("strides")
_GET_RANK = attrgetter("rank")
_GET_REGION = attrgetter("region")
_GET_BOFF = attrgetter("byte_offset")


class _TensorBoxes(NamedTuple):
    """One tensor's non-empty shards, sorted by (box, rank, region, byte offset); records with
    the same box are consecutive: ``starts`` / ``counts`` delimit each distinct box's replicas."""

    order: np.ndarray
    offs: np.ndarray
    szs: np.ndarray
    strs: np.ndarray
    ranks: np.ndarray
    regs: np.ndarray
    boffs: np.ndarray
    starts: np.ndarray
    counts: np.ndarray


def _layout_ndim(n: str, lay: object) -> int:
    if not isinstance(lay, TensorLayout):
        raise PlanError(f"tensor {n!r}: layout must be a TensorLayout, got {type(lay).__name__}")
    if lay.name != n:
        raise PlanError(f"tensor {n!r}: layout mapping key differs from its name {lay.name!r}")
    return len(lay.global_shape)


def _check_shard_meta(n: str, dt: str, gs: tuple, shards: Sequence[ShardRecord]) -> None:
    # one set comprehension in the common case; the loop only runs to name the culprit
    if set(map(_GET_META, shards)) - {(n, dt, gs)}:
        for s in shards:
            if (s.name, s.dtype, s.global_shape) != (n, dt, gs):
                raise PlanError(
                    f"tensor {n!r}: rank {s.rank} shard ({s.name!r}, {s.dtype}, {tuple(s.global_shape)}) "
                    f"disagrees with the layout ({dt}, {gs})")


def _distinct_boxes(n: str, gs: tuple, shards: Sequence[ShardRecord]) -> Optional[_TensorBoxes]:
    """Validate one tensor's shards and group them by box; None when no shard has elements."""
    m = len(shards)
    nd = len(gs)
    try:
        offs = np.array(list(map(_GET_OFFS, shards)), np.int64).reshape(m, nd)
        szs = np.array(list(map(_GET_SIZES, shards)), np.int64).reshape(m, nd)
        strs = np.array(list(map(_GET_STRIDES, shards)), np.int64).reshape(m, nd)
    except ValueError:
        raise PlanError(f"tensor {n!r}: a publisher shard has a box/strides of the wrong ndim for {gs}") from None
    ranks = np.fromiter(map(_GET_RANK, shards), np.int64, m)
    regs = np.fromiter(map(_GET_REGION, shards), np.int64, m)
    boffs = np.fromiter(map(_GET_BOFF, shards), np.int64, m)
    gsa = np.array(gs, np.int64)
    if (offs < 0).any() or (szs < 0).any() or (offs + szs > gsa).any():
        raise PlanError(f"tensor {n!r}: a publisher shard box is out of bounds of {gs}")
    if (strs < 0).any() or (boffs < 0).any():
        raise PlanError(f"tensor {n!r}: a publisher shard has negative strides or byte offset")
    # sort by (box offsets, box sizes, rank, region, byte offset): replicas order deterministically
    keys = [boffs, regs, ranks] + [szs[:, d] for d in reversed(range(nd))] + \
           [offs[:, d] for d in reversed(range(nd))]
    order = np.lexsort(keys)
    keep = szs[order].min(axis=1) > 0 if nd else np.ones(m, bool)
    order = order[keep]
    m = len(order)
    if m == 0:
        return None
    offs, szs, strs = offs[order], szs[order], strs[order]
    ranks, regs, boffs = ranks[order], regs[order], boffs[order]
    bx = np.concatenate([offs, szs], axis=1)
    new = np.ones(m, bool)
    if m > 1:
        new[1:] = (bx[1:] != bx[:-1]).any(axis=1) if bx.shape[1] else False
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, m))
    return _TensorBoxes(order, offs, szs, strs, ranks, regs, boffs, starts, counts)


class _Parts:
    """Per-tensor chunks of the ``_Sources`` arrays, concatenated once at the end."""

    def __init__(self) -> None:
        self.box_lo: list[np.ndarray] = []
        self.box_sz: list[np.ndarray] = []
        self.box_rs: list[np.ndarray] = []
        self.box_rc: list[np.ndarray] = []
        self.rank: list[np.ndarray] = []
        self.region: list[np.ndarray] = []
        self.off: list[np.ndarray] = []
        self.str: list[np.ndarray] = []
        self.lo: list[np.ndarray] = []
        self.t: list[np.ndarray] = []
        self.nb = 0  # distinct boxes so far
        self.nr = 0  # records so far


class _Sources:
    """Publisher layouts as arrays: distinct boxes per tensor and their replica records.

    Dims are left-padded to the widest tensor (``D``: offset 0, size 1, stride 0) so every
    tensor shares one array shape. Box ``b`` of tensor ``t`` lies in ``t_bs[t] .. t_bs[t] +
    t_bc[t]``; its replicas are records ``box_rs[b] .. box_rs[b] + box_rc[b]``.
    """

    def __init__(self, layouts: Mapping[str, TensorLayout]):
        names = _sorted_ids(layouts)
        self.names = tuple(names)
        self.tid = {n: i for i, n in enumerate(names)}
        T = len(names)
        nds = [_layout_ndim(n, layouts[n]) for n in names]
        D = max(nds + [1])
        self.D = D
        self.t_shape = np.ones((T, D), np.int64)
        self.shapes: list[tuple] = []
        self.dtypes: list[str] = []
        self.t_code = np.zeros(T, np.int64)
        self.rec_obj: list[ShardRecord] = []
        self.t_bs = np.zeros(T, np.int64)
        self.t_bc = np.zeros(T, np.int64)
        parts = _Parts()
        for ti, n in enumerate(names):
            self._add_tensor(ti, n, layouts[n], parts)
        self.box_lo = _cat(parts.box_lo, (0, D))
        self.box_sz = _cat(parts.box_sz, (0, D))
        self.box_rs = _cat(parts.box_rs, (0,))
        self.box_rc = _cat(parts.box_rc, (0,))
        self.n_layout_recs = parts.nr
        self.rec_rank = _cat(parts.rank, (0,))
        self.rec_region = _cat(parts.region, (0,))
        self.rec_off = _cat(parts.off, (0,))
        self.rec_str = _cat(parts.str, (0, D))
        self.rec_lo = _cat(parts.lo, (0, D))
        self.rec_t = _cat(parts.t, (0,))
        # per-tensor salt of the rotation balancer: stable across processes (not ``hash``)
        self.tensor_salt = np.array([zlib.crc32(n.encode()) for n in names], np.int64) if T else np.zeros(0, np.int64)

    def _add_tensor(self, ti: int, n: str, lay: TensorLayout, parts: _Parts) -> None:
        D = self.D
        gs = tuple(lay.global_shape)
        nd = len(gs)
        dt = lay.dtype
        code = _CODE.get(dt)
        if code is None:
            raise PlanError(f"tensor {n!r}: unknown dtype {dt!r}")
        self.shapes.append(gs)
        self.dtypes.append(dt)
        self.t_code[ti] = code
        self.t_shape[ti, D - nd:] = gs
        shards = lay.shards
        _check_shard_meta(n, dt, gs, shards)
        self.t_bs[ti] = parts.nb
        if len(shards) == 0:
            return
        tb = _distinct_boxes(n, gs, shards)
        if tb is None:
            return
        m = len(tb.order)
        nbx = len(tb.starts)
        lo_p = np.zeros((m, D), np.int64)
        lo_p[:, D - nd:] = tb.offs
        sz_p = np.ones((nbx, D), np.int64)
        sz_p[:, D - nd:] = tb.szs[tb.starts]
        st_p = np.zeros((m, D), np.int64)
        st_p[:, D - nd:] = tb.strs
        parts.box_lo.append(lo_p[tb.starts])
        parts.box_sz.append(sz_p)
        parts.box_rs.append(parts.nr + tb.starts)
        parts.box_rc.append(tb.counts)
        parts.rank.append(tb.ranks)
        parts.region.append(tb.regs)
        parts.off.append(tb.boffs)
        parts.str.append(st_p)
        parts.lo.append(lo_p)
        parts.t.append(np.full(m, ti, np.int64))
        self.rec_obj.extend(shards[i] for i in tb.order.tolist())
        self.t_bc[ti] = nbx
        parts.nb += nbx
        parts.nr += m

    def with_packed(self, recs: list[ShardRecord]) -> tuple["_Sources", np.ndarray, np.ndarray]:
        """A copy with packed records appended as extra source records; returns
        ``(sources, record indices, padded box sizes)``."""
        D = self.D
        m = len(recs)
        new = copy.copy(self)
        if m == 0:
            return new, np.zeros(0, np.int64), np.zeros((0, D), np.int64)
        tids = self._packed_tensor_ids(recs)
        pad0 = [(0,) * (D - k) for k in range(D + 1)]
        pad1 = [(1,) * (D - k) for k in range(D + 1)]
        lo = np.array([pad0[len(r.box.offsets)] + tuple(r.box.offsets) for r in recs], np.int64).reshape(m, D)
        sz = np.array([pad1[len(r.box.sizes)] + tuple(r.box.sizes) for r in recs], np.int64).reshape(m, D)
        st = np.array([pad0[len(r.strides)] + tuple(r.strides) for r in recs], np.int64).reshape(m, D)
        ts = np.array(tids, np.int64)
        offs = np.fromiter((r.byte_offset for r in recs), np.int64, m)
        bad = (lo < 0).any(axis=1) | (sz < 0).any(axis=1) | (lo + sz > self.t_shape[ts]).any(axis=1) | \
            (st < 0).any(axis=1) | (offs < 0)
        if bad.any():
            r = recs[int(np.flatnonzero(bad)[0])]
            raise PlanError(f"tensor {r.name!r}: packed source box {r.box.offsets}+{r.box.sizes} out of bounds of "
                            f"{tuple(r.global_shape)} or with negative strides / byte offset")
        base = len(self.rec_rank)
        new.rec_rank = np.concatenate([self.rec_rank, np.fromiter((r.rank for r in recs), np.int64, m)])
        new.rec_region = np.concatenate([self.rec_region, np.fromiter((r.region for r in recs), np.int64, m)])
        new.rec_off = np.concatenate([self.rec_off, offs])
        new.rec_str = np.concatenate([self.rec_str, st])
        new.rec_lo = np.concatenate([self.rec_lo, lo])
        new.rec_t = np.concatenate([self.rec_t, ts])
        new.rec_obj = self.rec_obj + list(recs)
        return new, base + np.arange(m, dtype=np.int64), sz

    def _packed_tensor_ids(self, recs: list[ShardRecord]) -> list[int]:
        """Tensor id of each packed record, checking it agrees with its tensor's layout."""
        for r in recs:
            if not isinstance(r, ShardRecord):
                raise PlanError(f"packed source must be a ShardRecord, got {type(r).__name__}")
        tids = [self.tid.get(r.name, -1) for r in recs]
        for r, t in zip(recs, tids):
            if t < 0:
                raise PlanError(f"tensor {r.name!r}: packed source for a tensor not in the layout")
        shapes, dtypes = self.shapes, self.dtypes
        for r, t in zip(recs, tids):
            if r.dtype != dtypes[t] or tuple(r.global_shape) != shapes[t] or \
                    len(r.box.offsets) != len(shapes[t]) or len(r.strides) != len(shapes[t]):
                raise PlanError(f"tensor {r.name!r}: packed source ({r.dtype}, {tuple(r.global_shape)}, box "
                                f"{r.box.offsets}+{r.box.sizes}) disagrees with the layout ({dtypes[t]}, {shapes[t]})")
        return tids


_SRC_MEMO: "OrderedDict[tuple, tuple]" = OrderedDict()


def _compile_sources(layouts: Mapping[str, TensorLayout]) -> _Sources:
    """``_Sources(layouts)``, memoized on the identity of the layout objects (the memo keeps
    them alive, so ids stay valid): a replan with unchanged layouts skips recompiling."""
    names = _sorted_ids(layouts)
    objs = tuple(layouts[n] for n in names)
    key = (tuple(names), tuple(id(o) for o in objs))
    hit = _SRC_MEMO.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], objs)):
        _SRC_MEMO.move_to_end(key)
        return hit[1]
    src = _Sources(layouts)
    _SRC_MEMO[key] = (objs, src)
    while len(_SRC_MEMO) > 2:
        _SRC_MEMO.popitem(last=False)
    return src

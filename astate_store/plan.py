"""Resharding planner: which bytes each consumer reads from which publisher, and in what order.

Pure code (numpy): no etcd, no transport, no I/O. Inputs are the frozen layout contracts of
``astate_store.layout``; outputs are numpy structured arrays of reads (``READ_DTYPE``) that a
native data path can walk without Python per read.

Pipeline (all vectorized over pieces, no Python loop per run):

1. *Pieces*: every destination box is intersected with the distinct publisher boxes of its
   tensor. Identical boxes on several ranks are replicas; a piece may be read from any of them.
2. *Assignment*: each (consumer, piece) is given one replica. ``balance="greedy"`` (global plan)
   water-fills bytes onto source links, largest pieces first, ties by index; ``"rotation"`` picks
   ``(rotation + salt(piece)) mod replicas`` so consumers planning alone still spread out.
   Topology (``Placement``) restricts the candidates to the best locality tier first.
3. *Runs*: per piece geometry a template of coalesced runs is built once (innermost dims that are
   dense in both source and destination merge into one run; outer dims that nest merge too) and
   reused by every consumer with that geometry. Whole-piece runs that are consecutive in both
   source and destination memory merge across pieces.
4. *Pre-pack*: a piece whose runs are many and small is marked for a contiguous copy on the
   publisher when ``saved_reads * per_read_seconds > bytes / copy rate`` (``CostModel``).
   ``pack_items()`` lists them per publisher rank; the packed copies come back as ``PackedShard``
   sources that the planner then prefers for exactly those consumers.
5. *Order*: each consumer's reads are interleaved over its source links in proportion to the
   bytes it takes from each, starting at a link rotated by the consumer's stagger index.

Reads are kept compact (a piece table plus run templates); ``GlobalPlan.reads(consumer)`` /
``ConsumerPlan.reads`` materialize one consumer's array on demand (cached). Counts are exact
without materializing.
"""

from __future__ import annotations

import copy
import gc
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Hashable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from .errors import PlanError
from .layout import DTYPES, Box, ShardRecord, TensorLayout, contiguous_strides, is_floating, itemsize

__all__ = [
    "READ_DTYPE",
    "COPY_DTYPE",
    "DTYPE_CODES",
    "CostModel",
    "Placement",
    "Topology",
    "PackItem",
    "PackedShard",
    "ConsumerPlan",
    "GlobalPlan",
    "Planner",
    "plan_global",
    "plan_consumer",
    "fingerprint",
    "execute_reads",
]

# ----------------------------------------------------------------------------------------------
# Public records

#: dtype codes used in the ``src_dtype`` / ``dst_dtype`` fields: index into this tuple.
DTYPE_CODES: tuple[str, ...] = tuple(DTYPES)
_CODE: dict[str, int] = {n: i for i, n in enumerate(DTYPE_CODES)}
_ISZ = np.array([itemsize(n) for n in DTYPE_CODES], dtype=np.int64)
_FLOAT = np.array([is_floating(n) for n in DTYPE_CODES], dtype=bool)

#: One read: copy ``length`` source bytes from ``src_offset`` of region ``src_region`` of
#: publisher ``src_rank`` to ``dst_offset`` of the consumer's buffer ``dst_region``. With
#: ``convert`` the bytes are ``length // itemsize(src_dtype)`` elements of ``src_dtype`` to be
#: written as ``dst_dtype`` (``length // isz_src * isz_dst`` destination bytes). ``tensor`` indexes
#: ``plan.tensors``; ``dst_index`` is the index of the destination record in the consumer's
#: request (for a read merged across records: the first one).
READ_DTYPE = np.dtype(
    [
        ("src_offset", "<i8"),
        ("dst_offset", "<i8"),
        ("length", "<i8"),
        ("src_rank", "<i4"),
        ("src_region", "<i4"),
        ("dst_region", "<i4"),
        ("tensor", "<i4"),
        ("dst_index", "<i4"),
        ("src_dtype", "u1"),
        ("dst_dtype", "u1"),
        ("convert", "?"),
    ],
    align=True,
)

#: A publisher-local copy run used to build a packed copy (``PackItem.copy_runs``).
COPY_DTYPE = np.dtype([("src_offset", "<i8"), ("dst_offset", "<i8"), ("length", "<i8")])


@dataclass(frozen=True)
class CostModel:
    """Costs the planner weighs (rates in 1e9 bytes per second).

    A piece is pre-packed when the reads it saves cost more than the publisher's copy:
    ``(runs_direct - runs_packed) * per_read_seconds > nbytes / (copy_gb_per_s * 1e9)``.
    The link time of the piece is the same either way (same bytes), so it does not enter the
    decision; ``link_gb_per_s`` is used by ``read_seconds`` estimates.
    """

    per_read_seconds: float = 5e-6
    copy_gb_per_s: float = 10.0
    link_gb_per_s: float = 50.0
    prepack: bool = True

    def pack_pays(self, saved_reads: Any, nbytes: Any) -> Any:
        """Whether packing pays (works elementwise on numpy arrays)."""
        if not self.prepack:
            return np.zeros(np.shape(saved_reads), dtype=bool)
        return np.asarray(saved_reads) * self.per_read_seconds > np.asarray(nbytes) / (self.copy_gb_per_s * 1e9)

    def read_seconds(self, reads: int, nbytes: int) -> float:
        """Serial estimate of one link moving ``nbytes`` in ``reads`` reads."""
        return reads * self.per_read_seconds + nbytes / (self.link_gb_per_s * 1e9)


@dataclass(frozen=True)
class Placement:
    """Where a publisher rank or a consumer sits. ``nic`` names the NIC / rail; equal ``nic`` on
    two hosts means the same rail. Two ranks with the same (host, nic) share a link."""

    host: str
    numa: Optional[int] = None
    nic: Optional[str] = None


@dataclass(frozen=True, init=False)
class Topology:
    """Placements of publisher ranks (``sources``) and consumers (``consumers``); either may be
    partial. Stored as sorted tuples so the object is hashable."""

    sources: tuple
    consumers: tuple

    def __init__(self, sources: Optional[Mapping[int, Placement]] = None,
                 consumers: Optional[Mapping[Hashable, Placement]] = None):
        object.__setattr__(self, "sources", tuple(sorted((int(k), v) for k, v in (sources or {}).items())))
        object.__setattr__(self, "consumers", tuple(sorted(((k, v) for k, v in (consumers or {}).items()),
                                                           key=lambda kv: _sort_key(kv[0]))))

    def source_map(self) -> dict:
        return dict(self.sources)

    def consumer_map(self) -> dict:
        return dict(self.consumers)


@dataclass(frozen=True)
class PackItem:
    """Ask publisher ``source.rank`` to copy ``box`` (inside ``source.box``) of ``source`` into a
    contiguous row-major buffer that ``consumers`` will read instead of many small runs."""

    source: ShardRecord
    box: Box
    consumers: tuple

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.source.dtype)

    @property
    def key(self) -> tuple:
        """Identity of the copy (publishers can dedupe items from independent consumer plans)."""
        s = self.source
        return (s.name, s.rank, s.region, s.byte_offset, self.box.offsets, self.box.sizes)

    def packed_record(self, region: int, byte_offset: int) -> ShardRecord:
        """The contiguous record describing the built copy."""
        s = self.source
        return ShardRecord(s.name, s.dtype, s.global_shape, self.box, contiguous_strides(self.box.sizes),
                           s.rank, int(region), int(byte_offset))

    def packed(self, region: int, byte_offset: int) -> "PackedShard":
        return PackedShard(self.packed_record(region, byte_offset), self.consumers)

    def copy_runs(self) -> np.ndarray:
        """Runs (``COPY_DTYPE``) that build the copy: ``src_offset`` is absolute in the source
        region, ``dst_offset`` relative to the start of the packed buffer."""
        s = self.source
        nd = len(self.box.sizes)
        isz = itemsize(s.dtype)
        if self.box.numel == 0:
            return np.zeros(0, COPY_DTYPE)
        tm = _template(self.box.sizes, tuple(s.strides), contiguous_strides(self.box.sizes))
        src_rel, dst_rel = _rel_offsets(tm, isz, isz)
        base = s.byte_offset + isz * sum((self.box.offsets[d] - s.box.offsets[d]) * s.strides[d] for d in range(nd))
        out = np.empty(len(src_rel), COPY_DTYPE)
        out["src_offset"] = base + src_rel
        out["dst_offset"] = dst_rel
        out["length"] = tm[1] * isz
        return out


@dataclass(frozen=True)
class PackedShard:
    """A packed copy published back: ``record`` (usually contiguous) serves ``consumers``."""

    record: ShardRecord
    consumers: tuple


PackedInput = Union[None, Iterable[PackedShard], Mapping[Hashable, Sequence[ShardRecord]]]


# ----------------------------------------------------------------------------------------------
# Helpers


class _NoGC:
    """Pause the cyclic GC while building many small objects (a collection would walk every
    live layout record, which dominates at 1T-parameter scale)."""

    def __enter__(self) -> None:
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self._was:
            gc.enable()


def _sort_key(x: Any) -> tuple:
    return (type(x).__name__, x if isinstance(x, (int, float, str)) else repr(x))


def _sorted_ids(ids: Iterable[Hashable]) -> list:
    ids = list(ids)
    try:
        return sorted(ids)
    except TypeError:
        return sorted(ids, key=_sort_key)


def _template(sz: Sequence[int], ss: Sequence[int], ds: Sequence[int]) -> tuple:
    """Coalesced run structure of copying a box of sizes ``sz`` between memories with element
    strides ``ss`` (source) and ``ds`` (destination).

    Returns ``(n_runs, run_elems, outer)``, ``outer`` a tuple of ``(size, src_stride, dst_stride)``
    from outermost to innermost; enumerating it row-major gives increasing source addresses.
    """
    if any(s == 0 for s in sz):
        return (0, 0, ())
    rem = [d for d in range(len(sz)) if sz[d] > 1]
    run = 1
    progress = True
    while progress:
        progress = False
        for d in rem:
            if ss[d] == run and ds[d] == run:
                run *= sz[d]
                rem.remove(d)
                progress = True
                break
    outer = sorted(((sz[d], ss[d], ds[d]) for d in rem), key=lambda x: (-x[1], -x[2]))
    merged: list[tuple[int, int, int]] = []
    for size, s, d in outer:
        if merged and merged[-1][1] == s * size and merged[-1][2] == d * size:
            merged[-1] = (merged[-1][0] * size, s, d)
        else:
            merged.append((size, s, d))
    n = 1
    for size, _, _ in merged:
        n *= size
    return (n, run, tuple(merged))


def _rel_offsets(tm: tuple, sisz: int, disz: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets of each run of a template relative to the piece origin (src, dst)."""
    src = np.zeros(1, np.int64)
    dst = np.zeros(1, np.int64)
    for size, s, d in tm[2]:
        ar = np.arange(size, dtype=np.int64)
        src = (src[:, None] + ar[None, :] * (s * sisz)).ravel()
        dst = (dst[:, None] + ar[None, :] * (d * disz)).ravel()
    if tm[0] == 0:
        return src[:0], dst[:0]
    return src, dst


def _overlaps(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    dims = sorted((st, sz) for sz, st in zip(sizes, strides) if sz > 1)
    span = 1
    for st, sz in dims:
        if st < span:
            return True
        span += st * (sz - 1)
    return False


def _segment_arange(counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(c) for c in counts])`` without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def _tier_matrix(cpl: list, spl: list) -> np.ndarray:
    """Locality tier (0 best) of every (consumer placement, source placement) pair; None = unknown."""
    m = np.full((max(len(cpl), 1), max(len(spl), 1)), 3, dtype=np.int8)
    for i, c in enumerate(cpl):
        if c is None:
            continue
        for j, s in enumerate(spl):
            if s is None:
                continue
            if c.host == s.host:
                close = (c.numa is not None and c.numa == s.numa) or (c.nic is not None and c.nic == s.nic)
                m[i, j] = 0 if close else 1
            else:
                m[i, j] = 2 if (c.nic is not None and c.nic == s.nic) else 3
    return m


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(a, axis=0, return_index=True, return_inverse=True)`` via a 64-bit row hash
    (verified; falls back to the exact method on a collision). Unique rows come in first-seen order."""
    n = len(a)
    if n == 0:
        return a[:0], np.zeros(0, np.int64), np.zeros(0, np.int64)
    a = np.ascontiguousarray(a, dtype=np.int64)
    h = np.zeros(n, np.int64)
    with np.errstate(over="ignore"):
        for j in range(a.shape[1]):
            h = (h ^ a[:, j]) * np.int64(-7046029254386353131) + np.int64((j * 0x9E3779B97F4A7C1 + 1) & 0x3FFFFFFFFFFFFFFF)
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


_MIX = np.array([0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C, 0xFD7046C5,
                 0xB55A4F09], dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# Compiled sources


_GET_META = attrgetter("name", "dtype", "global_shape")
_GET_OFFS = attrgetter("box.offsets")
_GET_SIZES = attrgetter("box.sizes")
_GET_STRIDES = attrgetter("strides")
_GET_RANK = attrgetter("rank")
_GET_REGION = attrgetter("region")
_GET_BOFF = attrgetter("byte_offset")


class _Sources:
    """Publisher layouts as arrays: distinct boxes per tensor and their replica records."""

    def __init__(self, layouts: Mapping[str, TensorLayout]):
        names = _sorted_ids(layouts)
        self.names = tuple(names)
        self.tid = {n: i for i, n in enumerate(names)}
        T = len(names)
        nds = []
        for n in names:
            lay = layouts[n]
            if not isinstance(lay, TensorLayout):
                raise PlanError(f"tensor {n!r}: layout must be a TensorLayout, got {type(lay).__name__}")
            if lay.name != n:
                raise PlanError(f"tensor {n!r}: layout mapping key differs from its name {lay.name!r}")
            nds.append(len(lay.global_shape))
        D = max(nds + [1])
        self.D = D
        self.t_nd = np.array(nds, np.int64) if T else np.zeros(0, np.int64)
        self.t_shape = np.ones((T, D), np.int64)
        self.shapes: list[tuple] = []
        self.dtypes: list[str] = []
        self.t_code = np.zeros(T, np.int64)
        box_lo, box_sz, box_t, box_rs, box_rc = [], [], [], [], []
        r_rank, r_region, r_off, r_str, r_lo, r_t = [], [], [], [], [], []
        self.rec_obj: list[ShardRecord] = []
        t_bs = np.zeros(T, np.int64)
        t_bc = np.zeros(T, np.int64)
        nb = 0
        nr = 0
        for ti, n in enumerate(names):
            lay = layouts[n]
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
            if set(map(_GET_META, shards)) - {(n, dt, gs)}:
                for s in shards:
                    if (s.name, s.dtype, s.global_shape) != (n, dt, gs):
                        raise PlanError(
                            f"tensor {n!r}: rank {s.rank} shard ({s.name!r}, {s.dtype}, {tuple(s.global_shape)}) "
                            f"disagrees with the layout ({dt}, {gs})")
            m = len(shards)
            t_bs[ti] = nb
            if m == 0:
                continue
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
            keys = [boffs, regs, ranks] + [szs[:, d] for d in reversed(range(nd))] + \
                   [offs[:, d] for d in reversed(range(nd))]
            order = np.lexsort(keys)
            keep = szs[order].min(axis=1) > 0 if nd else np.ones(m, bool)
            order = order[keep]
            m = len(order)
            if m == 0:
                continue
            offs, szs, strs = offs[order], szs[order], strs[order]
            ranks, regs, boffs = ranks[order], regs[order], boffs[order]
            bx = np.concatenate([offs, szs], axis=1)
            new = np.ones(m, bool)
            if m > 1:
                new[1:] = (bx[1:] != bx[:-1]).any(axis=1) if bx.shape[1] else False
            starts = np.flatnonzero(new)
            nbx = len(starts)
            counts = np.diff(np.append(starts, m))
            lo_p = np.zeros((m, D), np.int64)
            lo_p[:, D - nd:] = offs
            sz_p = np.ones((nbx, D), np.int64)
            sz_p[:, D - nd:] = szs[starts]
            st_p = np.zeros((m, D), np.int64)
            st_p[:, D - nd:] = strs
            box_lo.append(lo_p[starts])
            box_sz.append(sz_p)
            box_t.append(np.full(nbx, ti, np.int64))
            box_rs.append(nr + starts)
            box_rc.append(counts)
            r_rank.append(ranks)
            r_region.append(regs)
            r_off.append(boffs)
            r_str.append(st_p)
            r_lo.append(lo_p)
            r_t.append(np.full(m, ti, np.int64))
            self.rec_obj.extend(shards[i] for i in order.tolist())
            t_bc[ti] = nbx
            nb += nbx
            nr += m
        cat = lambda parts, shape: np.concatenate(parts) if parts else np.zeros(shape, np.int64)
        self.box_lo = cat(box_lo, (0, D))
        self.box_sz = cat(box_sz, (0, D))
        self.box_t = cat(box_t, (0,))
        self.box_rs = cat(box_rs, (0,))
        self.box_rc = cat(box_rc, (0,))
        self.t_bs = t_bs
        self.t_bc = t_bc
        self.n_layout_recs = nr
        self.rec_rank = cat(r_rank, (0,))
        self.rec_region = cat(r_region, (0,))
        self.rec_off = cat(r_off, (0,))
        self.rec_str = cat(r_str, (0, D))
        self.rec_lo = cat(r_lo, (0, D))
        self.rec_t = cat(r_t, (0,))
        self.tensor_salt = np.array([zlib.crc32(n.encode()) for n in names], np.int64) if T else np.zeros(0, np.int64)

    def with_packed(self, recs: list[ShardRecord]) -> tuple["_Sources", np.ndarray, np.ndarray]:
        """A copy with packed records appended as extra source records; returns
        ``(sources, record indices, padded box sizes)``."""
        D = self.D
        m = len(recs)
        new = copy.copy(self)
        if m == 0:
            return new, np.zeros(0, np.int64), np.zeros((0, D), np.int64)
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


# ----------------------------------------------------------------------------------------------
# Compiled requests


class _Requests:
    """Destination records of the distinct request sequences, concatenated."""

    def __init__(self, src: _Sources, seqs: list[Sequence[ShardRecord]]):
        D = src.D
        recs: list[ShardRecord] = []
        u_list: list[int] = []
        idx_list: list[int] = []
        for u, seq in enumerate(seqs):
            seq = list(seq)
            recs.extend(seq)
            u_list.extend([u] * len(seq))
            idx_list.extend(range(len(seq)))
        n = len(recs)
        self.n = n
        self.recs = recs
        self.u = np.array(u_list, np.int64)
        self.index = np.array(idx_list, np.int64)
        tid = src.tid
        for r in recs:
            if not isinstance(r, ShardRecord):
                raise PlanError(f"destination must be a ShardRecord, got {type(r).__name__}")
        names = [r.name for r in recs]
        tids = [tid.get(nm, -1) for nm in names]
        for nm, t in zip(names, tids):
            if t < 0:
                raise PlanError(f"tensor {nm!r}: requested but not in the layout")
        shapes = src.shapes
        for r, t in zip(recs, tids):
            gs = shapes[t]
            if len(r.box.offsets) != len(gs) or len(r.strides) != len(gs):
                raise PlanError(f"tensor {r.name!r}: destination box {r.box.offsets}+{r.box.sizes} / strides "
                                f"{tuple(r.strides)} have a different ndim than the tensor {gs}")
            if tuple(r.global_shape) != gs:
                raise PlanError(f"tensor {r.name!r}: destination global shape {tuple(r.global_shape)} disagrees "
                                f"with the layout {gs}")
        codes = [_CODE.get(r.dtype, -1) for r in recs]
        for r, c in zip(recs, codes):
            if c < 0:
                raise PlanError(f"tensor {r.name!r}: unknown destination dtype {r.dtype!r}")
        pad0 = [(0,) * (D - k) for k in range(D + 1)]
        pad1 = [(1,) * (D - k) for k in range(D + 1)]
        self.t = np.array(tids, np.int64)
        self.code = np.array(codes, np.int64)
        if n:
            self.lo = np.array([pad0[len(r.box.offsets)] + tuple(r.box.offsets) for r in recs], np.int64).reshape(n, D)
            self.sz = np.array([pad1[len(r.box.sizes)] + tuple(r.box.sizes) for r in recs], np.int64).reshape(n, D)
            self.st = np.array([pad0[len(r.strides)] + tuple(r.strides) for r in recs], np.int64).reshape(n, D)
        else:
            self.lo = np.zeros((0, D), np.int64)
            self.sz = np.zeros((0, D), np.int64)
            self.st = np.zeros((0, D), np.int64)
        self.region = np.fromiter((r.region for r in recs), np.int64, n)
        self.off = np.fromiter((r.byte_offset for r in recs), np.int64, n)
        # bounds
        shp = src.t_shape[self.t] if n else np.zeros((0, D), np.int64)
        bad = (self.lo < 0) | (self.sz < 0) | (self.lo + self.sz > shp)
        if bad.any():
            i = int(np.flatnonzero(bad.any(axis=1))[0])
            r = recs[i]
            raise PlanError(f"tensor {r.name!r}: destination box {r.box.offsets}+{r.box.sizes} is out of bounds "
                            f"of the global shape {tuple(r.global_shape)}")
        bad = (self.st < 0).any(axis=1) | (self.off < 0)
        if bad.any():
            r = recs[int(np.flatnonzero(bad)[0])]
            raise PlanError(f"tensor {r.name!r}: destination with negative strides or byte offset")
        # dtype conversion
        scode = src.t_code[self.t] if n else np.zeros(0, np.int64)
        self.scode = scode
        diff = scode != self.code
        bad = diff & ~(_FLOAT[scode] & _FLOAT[self.code])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            r = recs[i]
            raise PlanError(f"tensor {r.name!r}: cannot convert {src.dtypes[self.t[i]]} to {r.dtype}; only "
                            "float <-> float conversions are allowed")
        # aliasing destinations (a byte written twice)
        if n:
            key = np.concatenate([self.sz, self.st], axis=1)
            uk, first, _ = _unique_rows(key)
            for row, i in zip(uk.tolist(), first.tolist()):
                if _overlaps(row[:D], row[D:]):
                    r = recs[i]
                    raise PlanError(f"tensor {r.name!r}: destination strides {tuple(r.strides)} for sizes "
                                    f"{r.box.sizes} overlap themselves")


# ----------------------------------------------------------------------------------------------
# Templates


class _Templates:
    def __init__(self) -> None:
        self.index: dict[tuple, int] = {}
        self.n: list[int] = []
        self.run: list[int] = []
        self.tm: list[tuple] = []
        self.sisz: list[int] = []
        self.disz: list[int] = []
        self._rel: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, sz: tuple, ss: tuple, ds: tuple, sisz: int, disz: int) -> int:
        k = (sz, ss, ds, sisz, disz)
        i = self.index.get(k)
        if i is None:
            tm = _template(sz, ss, ds)
            i = len(self.n)
            self.index[k] = i
            self.n.append(tm[0])
            self.run.append(tm[1])
            self.tm.append(tm)
            self.sisz.append(sisz)
            self.disz.append(disz)
        return i

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (np.array(self.n, np.int64), np.array(self.run, np.int64), np.array(self.sisz, np.int64),
                np.array(self.disz, np.int64))

    def rel(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        r = self._rel.get(i)
        if r is None:
            r = _rel_offsets(self.tm[i], self.sisz[i], self.disz[i])
            self._rel[i] = r
        return r


def _template_ids(tmpl: _Templates, key_rows: np.ndarray, D: int) -> np.ndarray:
    """Template id per row of ``[sz(D), ss(D), ds(D), sisz, disz]`` (deduplicated first)."""
    if len(key_rows) == 0:
        return np.zeros(0, np.int64)
    uk, _, inv = _unique_rows(key_rows)
    ids = np.empty(len(uk), np.int64)
    for j, row in enumerate(uk.tolist()):
        ids[j] = tmpl.get(tuple(row[:D]), tuple(row[D:2 * D]), tuple(row[2 * D:3 * D]), row[3 * D], row[3 * D + 1])
    return ids[inv.reshape(-1)]


# ----------------------------------------------------------------------------------------------
# Plans


class ConsumerPlan:
    """One consumer's reads (materialized) and the pack items it would benefit from."""

    def __init__(self, consumer: Hashable, tensors: tuple, reads: np.ndarray, pack_items: tuple,
                 src_bytes: dict, nbytes: int):
        self.consumer = consumer
        self.tensors = tensors
        self.reads = reads
        self.pack_items = pack_items
        self.src_bytes = src_bytes
        self.nbytes = nbytes

    @property
    def read_count(self) -> int:
        return len(self.reads)

    def __repr__(self) -> str:
        return (f"ConsumerPlan(consumer={self.consumer!r}, reads={len(self.reads)}, bytes={self.nbytes}, "
                f"pack_items={len(self.pack_items)})")


class GlobalPlan:
    """The plan of every consumer; reads are materialized per consumer on demand."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)
        self._reads_cache: dict[int, np.ndarray] = {}
        self._pack_cache: Optional[dict] = None

    def __repr__(self) -> str:
        return (f"GlobalPlan(consumers={len(self.consumers)}, tensors={len(self.tensors)}, "
                f"reads={self.total_reads}, bytes={self.total_bytes}, balance={self.balance!r})")

    # -- summary ---------------------------------------------------------------------------
    @property
    def total_reads(self) -> int:
        return int(self._read_counts.sum())

    @property
    def total_bytes(self) -> int:
        return int(self._dst_bytes.sum())

    def read_count(self, consumer: Hashable) -> int:
        return int(self._read_counts[self._cindex[consumer]])

    def read_counts(self) -> dict:
        return {c: int(n) for c, n in zip(self.consumers, self._read_counts.tolist())}

    def src_bytes(self) -> dict:
        """Bytes read from each publisher rank (packed copies count on their rank)."""
        return {int(r): int(b) for r, b in zip(self._src_ranks.tolist(), self._src_rank_bytes.tolist())}

    def dst_bytes(self) -> dict:
        """Source bytes read by each consumer."""
        return {c: int(b) for c, b in zip(self.consumers, self._dst_bytes.tolist())}

    def src_link_bytes(self) -> np.ndarray:
        return self._link_bytes.copy()

    def dst_link_bytes(self) -> np.ndarray:
        return self._dlink_bytes.copy()

    # -- per consumer ----------------------------------------------------------------------
    def reads(self, consumer: Hashable) -> np.ndarray:
        c = self._cindex[consumer]
        r = self._reads_cache.get(c)
        if r is None:
            r = self._materialize(c)
            self._reads_cache[c] = r
        return r

    def consumer(self, consumer: Hashable) -> ConsumerPlan:
        c = self._cindex[consumer]
        items = tuple(it for its in self.pack_items().values() for it in its if consumer in it.consumers)
        s, e = self._cstart[c], self._cstart[c + 1]
        pis = self._perm[s:e]
        rk = self._rec_rank[self._pi_src[pis]]
        by = self._pi_bytes[pis]
        ur, inv = np.unique(rk, return_inverse=True)
        sb = np.bincount(inv.reshape(-1), weights=by, minlength=len(ur)) if len(ur) else np.zeros(0)
        src_bytes = {int(a): int(b) for a, b in zip(ur.tolist(), sb.tolist())}
        return ConsumerPlan(consumer, self.tensors, self.reads(consumer), items, src_bytes,
                            int(self._dst_bytes[c]))

    def pack_items(self) -> dict[int, list[PackItem]]:
        """Per publisher rank, the pieces worth pre-packing (deduplicated; ``consumers`` lists
        who reads each)."""
        if self._pack_cache is None:
            with _NoGC():
                self._pack_cache = self._build_pack_items()
        return self._pack_cache

    # -- internals -------------------------------------------------------------------------
    def _build_pack_items(self) -> dict[int, list[PackItem]]:
        pis = np.flatnonzero(self._pi_pack)
        out: dict[int, list[PackItem]] = {}
        if len(pis) == 0:
            return out
        P = self._pi_P[pis]
        srcr = self._pi_src[pis]
        key = np.concatenate([srcr[:, None], self._P_t[P][:, None], self._P_lo[P], self._P_sz[P]], axis=1)
        _, first, inv = _unique_rows(key)
        G = len(first)
        pc = self._pi_c[pis]
        o = np.lexsort((pc, inv))
        gi, ci = inv[o], pc[o]
        keep = np.ones(len(o), bool)
        keep[1:] = (gi[1:] != gi[:-1]) | (ci[1:] != ci[:-1])
        gi, ci = gi[keep], ci[keep]
        bounds = np.searchsorted(gi, np.arange(G + 1)).tolist()
        cons = self.consumers
        cons_l = [cons[c] for c in ci.tolist()]
        D = self._D
        Pf = P[first]
        lo_l = self._P_lo[Pf].tolist()
        sz_l = self._P_sz[Pf].tolist()
        rec_l = srcr[first].tolist()
        rec_obj = self._rec_obj
        for g in range(G):
            rec = rec_obj[rec_l[g]]
            cut = D - len(rec.global_shape)
            box = Box(tuple(lo_l[g][cut:]), tuple(sz_l[g][cut:]))
            item = PackItem(rec, box, tuple(cons_l[bounds[g]:bounds[g + 1]]))
            lst = out.get(rec.rank)
            if lst is None:
                out[rec.rank] = [item]
            else:
                lst.append(item)
        return dict(sorted(out.items()))

    def _materialize(self, c: int) -> np.ndarray:
        s, e = self._cstart[c], self._cstart[c + 1]
        pis = self._perm[s:e]
        pis = pis[~self._pi_tail[pis]]
        tm = self._pi_tm[pis]
        n = self._T_n[tm]
        pis = pis[n > 0]
        tm = tm[n > 0]
        n = n[n > 0]
        P = self._pi_P[pis]
        src = self._pi_src[pis]
        row = self._P_row[P]
        cnt = int(n.sum())
        out = np.empty(cnt, READ_DTYPE)
        if cnt == 0:
            return out
        rep = np.repeat(np.arange(len(pis)), n)
        src_off = np.repeat(self._pi_sbase[pis], n)
        dst_off = np.repeat(self._P_dbase[P], n)
        length = np.repeat(self._pi_mlen[pis], n)
        multi = np.flatnonzero(n > 1)
        if len(multi):
            starts = np.cumsum(n) - n
            for j in multi.tolist():
                rs, rd = self._tmpl.rel(int(tm[j]))
                a = int(starts[j])
                src_off[a:a + len(rs)] += rs
                dst_off[a:a + len(rd)] += rd
        out["src_offset"] = src_off
        out["dst_offset"] = dst_off
        out["length"] = length
        out["src_rank"] = np.repeat(self._rec_rank[src], n)
        out["src_region"] = np.repeat(self._rec_region[src], n)
        out["dst_region"] = np.repeat(self._row_region[row], n)
        out["tensor"] = np.repeat(self._P_t[P], n)
        out["dst_index"] = np.repeat(self._row_index[row], n)
        sc = self._row_scode[row]
        dc = self._row_code[row]
        out["src_dtype"] = np.repeat(sc, n)
        out["dst_dtype"] = np.repeat(dc, n)
        out["convert"] = np.repeat(sc != dc, n)
        # order: interleave source links in proportion to bytes, rotated by the stagger index
        link = self._rec_link[src][rep]
        o1 = np.lexsort((src_off, out["src_region"], out["src_rank"], link))
        lk = link[o1]
        ln = length[o1].astype(np.float64)
        cum = np.cumsum(ln) - ln
        newg = np.ones(len(lk), bool)
        newg[1:] = lk[1:] != lk[:-1]
        gstart = np.flatnonzero(newg)
        gid = np.cumsum(newg) - 1
        gtot = np.add.reduceat(ln, gstart)
        prog = (cum - cum[gstart][gid]) / np.maximum(gtot[gid], 1.0)
        nl = max(int(self._n_links), 1)
        rot = (lk - int(self._stagger[c])) % nl
        o2 = np.lexsort((rot, prog))
        return out[o1[o2]]


# ----------------------------------------------------------------------------------------------
# The planner


def _normalize_packed(packed: PackedInput) -> list[tuple[ShardRecord, tuple]]:
    if packed is None:
        return []
    if isinstance(packed, Mapping):
        by_id: dict[int, list] = {}
        for cid in _sorted_ids(packed):
            for rec in packed[cid]:
                ent = by_id.get(id(rec))
                if ent is None:
                    by_id[id(rec)] = [rec, [cid]]
                else:
                    ent[1].append(cid)
        return [(rec, tuple(cs)) for rec, cs in by_id.values()]
    out = []
    for p in packed:
        if isinstance(p, PackedShard):
            out.append((p.record, tuple(p.consumers)))
        elif isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], ShardRecord):
            out.append((p[0], tuple(p[1])))
        else:
            raise PlanError(f"packed sources must be PackedShard, got {type(p).__name__}")
    return out


def _distribute(loads: list, links: list, c: int, b: float) -> list[int]:
    """How many of ``c`` identical pieces of ``b`` bytes each replica gets: water-filling on the
    current link loads (ties to the lowest index); updates ``loads``."""
    r = len(links)
    cur = [loads[l] for l in links]
    if b <= 0:
        q, rem = divmod(c, r)
        return [q + (1 if i < rem else 0) for i in range(r)]
    level = (sum(cur) + c * b) / r
    k = [int((level - x) / b) if x < level else 0 for x in cur]
    s = sum(k)
    if s != c:
        f = [x + ki * b for x, ki in zip(cur, k)]
        if s < c:  # at most r short: one more to each of the least loaded
            for i in sorted(range(r), key=f.__getitem__)[:c - s]:
                k[i] += 1
        else:
            order = sorted(range(r), key=f.__getitem__, reverse=True)
            while s > c:
                for i in order:
                    if s == c:
                        break
                    if k[i] > 0:
                        k[i] -= 1
                        s -= 1
    for i in range(r):
        if k[i]:
            loads[links[i]] += k[i] * b
    return k


def _round_robin(reps: list, k: list[int]) -> list:
    if min(k) == max(k):
        return reps * k[0]
    out = []
    for j in range(max(k)):
        for i, rep in enumerate(reps):
            if k[i] > j:
                out.append(rep)
    return out


def _plan(layouts: Mapping[str, TensorLayout], requests: Mapping[Hashable, Sequence[ShardRecord]], *,
          topology: Optional[Topology], packed: PackedInput, cost: CostModel, balance: str,
          rotations: Optional[Mapping[Hashable, int]], staggers: Optional[Mapping[Hashable, int]]) -> GlobalPlan:
    if balance not in ("greedy", "rotation"):
        raise PlanError(f"unknown balance mode {balance!r}")
    src = _compile_sources(layouts)
    D = src.D
    consumers = _sorted_ids(requests)
    C = len(consumers)
    cindex = {cid: i for i, cid in enumerate(consumers)}

    # distinct request sequences: consumers with equal requests (same object, or equal content)
    # share the piece computation, and their position among each other is the default rotation
    seq_u: dict[int, int] = {}
    by_content: dict[tuple, list[int]] = {}
    seqs: list = []
    u_of_c = np.zeros(C, np.int64)
    for i, cid in enumerate(consumers):
        seq = requests[cid]
        u = seq_u.get(id(seq))
        if u is None:
            tup = tuple(seq)
            try:
                ck = (len(tup), hash(tup))
            except TypeError:
                ck = (len(tup), id(seq))
            for cand in by_content.get(ck, ()):
                if tuple(seqs[cand]) == tup:
                    u = cand
                    break
            if u is None:
                u = len(seqs)
                seqs.append(tup)
                by_content.setdefault(ck, []).append(u)
            seq_u[id(seq)] = u
        u_of_c[i] = u
    req = _Requests(src, seqs)
    U = len(seqs)

    # -- pieces: destination rows x distinct source boxes of the tensor --------------------
    rows_nb = src.t_bc[req.t] if req.n else np.zeros(0, np.int64)
    numel_row = np.prod(req.sz, axis=1) if req.n else np.zeros(0, np.int64)
    rows_nb = np.where(numel_row > 0, rows_nb, 0)
    P_row_parts, P_box_parts, P_lo_parts, P_sz_parts = [], [], [], []
    covered = np.zeros(req.n, np.int64)
    chunk = 1 << 22
    cum = np.cumsum(rows_nb)
    a = 0
    while a < req.n:
        base = int(cum[a - 1]) if a else 0
        b = int(np.searchsorted(cum, base + chunk, side="right"))
        b = max(b, a + 1)
        b = min(b, req.n)
        rr = np.arange(a, b)
        cnts = rows_nb[a:b]
        pr = np.repeat(rr, cnts)
        pb = np.repeat(src.t_bs[req.t[rr]], cnts) + _segment_arange(cnts)
        lo = np.maximum(req.lo[pr], src.box_lo[pb])
        hi = np.minimum(req.lo[pr] + req.sz[pr], src.box_lo[pb] + src.box_sz[pb])
        ok = (hi > lo).all(axis=1)
        pr, pb, lo, hi = pr[ok], pb[ok], lo[ok], hi[ok]
        sz = hi - lo
        covered[a:b] += np.bincount(pr - a, weights=np.prod(sz, axis=1).astype(np.float64),
                                    minlength=b - a).astype(np.int64)
        P_row_parts.append(pr)
        P_box_parts.append(pb)
        P_lo_parts.append(lo)
        P_sz_parts.append(sz)
        a = b
    cat = lambda parts, shape: np.concatenate(parts) if parts else np.zeros(shape, np.int64)
    P_row = cat(P_row_parts, (0,))
    P_box = cat(P_box_parts, (0,))
    P_lo = cat(P_lo_parts, (0, D))
    P_sz = cat(P_sz_parts, (0, D))
    if req.n:
        bad = covered != numel_row
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            r = req.recs[i]
            what = "is not covered by any publisher shard" if covered[i] < numel_row[i] else \
                "is covered by overlapping publisher shards"
            raise PlanError(f"tensor {r.name!r}: destination box {r.box.offsets}+{r.box.sizes} {what} "
                            f"({int(covered[i])} of {int(numel_row[i])} elements)")
    NP = len(P_row)
    P_t = req.t[P_row]
    P_u = req.u[P_row]
    P_numel = np.prod(P_sz, axis=1) if NP else np.zeros(0, np.int64)
    P_sisz = _ISZ[req.scode[P_row]]
    P_disz = _ISZ[req.code[P_row]]
    P_bytes = P_numel * P_sisz
    P_dbase = req.off[P_row] + P_disz * ((P_lo - req.lo[P_row]) * req.st[P_row]).sum(axis=1)

    # -- piece instances: (consumer, piece) --------------------------------------------------
    ucount = np.bincount(u_of_c, minlength=U)
    cons_by_u = np.argsort(u_of_c, kind="stable")
    ustart = np.cumsum(ucount) - ucount
    pos_in_u = np.empty(C, np.int64)
    pos_in_u[cons_by_u] = _segment_arange(ucount)
    pcount = ucount[P_u]
    P_start = np.cumsum(pcount) - pcount
    pi_P = np.repeat(np.arange(NP), pcount)
    pi_c = cons_by_u[np.repeat(ustart[P_u], pcount) + _segment_arange(pcount)]
    NPI = len(pi_P)
    pi_src = np.full(NPI, -1, np.int64)

    # -- packed sources: override (consumer, piece) pairs with an exact box match ----------
    pk = _normalize_packed(packed)
    stale_packed = 0
    if pk:
        src, prec_idx, prec_sz = src.with_packed([r for r, _ in pk])
        lens = np.fromiter((len(cs) for _, cs in pk), np.int64, len(pk))
        ent_c = np.array([cindex.get(cid, -1) for _, cs in pk for cid in cs], np.int64)
        ent_j = np.repeat(np.arange(len(pk)), lens)
        keep = ent_c >= 0
        ent_c, ent_j = ent_c[keep], ent_j[keep]
        prec = prec_idx[ent_j]
        eu = u_of_c[ent_c]
        # group pieces and entries by (request, tensor, lo, sz); every piece of the group matches
        kP = np.concatenate([P_u[:, None], P_t[:, None], P_lo, P_sz], axis=1)
        kE = np.concatenate([eu[:, None], src.rec_t[prec][:, None], src.rec_lo[prec], prec_sz[ent_j]], axis=1)
        _, _, gid = _unique_rows(np.concatenate([kP, kE]))
        gP, gE = gid[:NP], gid[NP:]
        po = np.argsort(gP, kind="stable")
        lo_i = np.searchsorted(gP[po], gE, side="left")
        hi_i = np.searchsorted(gP[po], gE, side="right")
        nm = hi_i - lo_i
        stale_packed = int((nm == 0).sum())
        e_rep = np.repeat(np.arange(len(gE)), nm)
        mp = po[np.repeat(lo_i, nm) + _segment_arange(nm)]
        if len(mp):
            mpi = P_start[mp] + pos_in_u[ent_c[e_rep]]
            mrec = prec[e_rep]
            # first packed source wins (deterministic: input order)
            first = np.unique(mpi, return_index=True)[1]
            pi_src[mpi[first]] = mrec[first]
    # packed copies replace their pieces *after* balancing: the balancer sees the same inputs as
    # the pass that asked for the copies, so it picks the same replicas (the copies live on those
    # ranks) and the pre-pack round trip converges in one step
    override = pi_src
    pi_src = np.full(NPI, -1, np.int64)

    # -- links -------------------------------------------------------------------------------
    splace = topology.source_map() if topology is not None else {}
    cplace = topology.consumer_map() if topology is not None else {}
    ranks_all = np.unique(src.rec_rank) if len(src.rec_rank) else np.zeros(0, np.int64)
    link_of_key: dict = {}
    rank_link = {}
    for rk in ranks_all.tolist():
        pl = splace.get(rk)
        key = ("nic", pl.host, pl.nic) if (pl is not None and pl.nic is not None) else ("rank", rk)
        rank_link[rk] = link_of_key.setdefault(key, len(link_of_key))
    n_links = len(link_of_key)
    if len(ranks_all):
        lut = np.array([rank_link[r] for r in ranks_all.tolist()], np.int64)
        rec_link = lut[np.searchsorted(ranks_all, src.rec_rank)]
    else:
        rec_link = np.zeros(0, np.int64)
    dlink_of_key: dict = {}
    c_dlink = np.zeros(C, np.int64)
    for i, cid in enumerate(consumers):
        pl = cplace.get(cid)
        key = ("nic", pl.host, pl.nic) if (pl is not None and pl.nic is not None) else ("c", i)
        c_dlink[i] = dlink_of_key.setdefault(key, len(dlink_of_key))

    # topology tiers
    use_topo = bool(splace) and bool(cplace)
    if use_topo:
        spl_list = [None] + list({v: None for v in splace.values()})
        spl_id = {v: i for i, v in enumerate(spl_list) if v is not None}
        cpl_list = [None] + list({v: None for v in cplace.values()})
        cpl_id = {v: i for i, v in enumerate(cpl_list) if v is not None}
        tier = _tier_matrix(cpl_list, spl_list)
        rank_spl = {rk: spl_id.get(splace.get(rk), 0) for rk in ranks_all.tolist()}
        rec_spl = np.array([rank_spl[r] for r in src.rec_rank.tolist()], np.int64) if len(src.rec_rank) else \
            np.zeros(0, np.int64)
        c_cpl = np.array([cpl_id.get(cplace.get(cid), 0) for cid in consumers], np.int64)

    # -- assignment ------------------------------------------------------------------------
    rc = src.box_rc[P_box]
    rs = src.box_rs[P_box]
    free = pi_src < 0
    one = free & (rc[pi_P] == 1)
    pi_src[one] = rs[pi_P[one]]
    multi = np.flatnonzero(free & (rc[pi_P] > 1))
    P_salt = (src.tensor_salt[P_t] + (P_lo * _MIX[:D][None, :] if D <= 8 else P_lo).sum(axis=1)) & 0x7FFFFFFF \
        if NP else np.zeros(0, np.int64)

    if len(multi) and balance == "rotation":
        rot = np.zeros(C, np.int64)
        for i, cid in enumerate(consumers):
            rot[i] = int(rotations[cid]) if (rotations is not None and cid in rotations) else int(pos_in_u[i])
        mp_ = pi_P[multi]
        key = rot[pi_c[multi]] + P_salt[mp_]
        if not use_topo:
            pi_src[multi] = rs[mp_] + key % rc[mp_]
        else:
            cnt = rc[mp_]
            owner = np.repeat(np.arange(len(multi)), cnt)
            rep = np.repeat(rs[mp_], cnt) + _segment_arange(cnt)
            tr = tier[c_cpl[pi_c[multi]][owner], rec_spl[rep]]
            starts = np.cumsum(cnt) - cnt
            best = np.minimum.reduceat(tr, starts)
            is_c = tr == best[owner]
            ncand = np.add.reduceat(is_c.astype(np.int64), starts)
            want = key % ncand
            csum = np.cumsum(is_c.astype(np.int64))
            before = np.where(starts > 0, csum[starts - 1], 0)
            rank_in = csum - 1 - before[owner]
            pick = is_c & (rank_in == want[owner])
            pi_src[multi[owner[pick]]] = rep[pick]

    loads_arr = np.zeros(max(n_links, 1), np.float64)
    done = pi_src >= 0
    if done.any():
        loads_arr += np.bincount(rec_link[pi_src[done]], weights=P_bytes[pi_P[done]].astype(np.float64),
                                 minlength=len(loads_arr))[:len(loads_arr)]

    if len(multi) and balance == "greedy":
        mP = pi_P[multi]
        mbox = P_box[mP]
        # candidate mask per instance: all replicas, or (topology) the best locality tier only.
        # Consumers with identical tier rows form one locality class, so masks are computed per
        # unique (box, class) pair, never per instance.
        mcode = np.zeros(len(multi), np.int64)
        pair_bits: dict = {}
        if use_topo:
            _, _, cloc = _unique_rows(tier[c_cpl].astype(np.int64))
            nloc = int(cloc.max()) + 1
            loc_tier = np.zeros((nloc, tier.shape[1]), np.int64)
            loc_tier[cloc] = tier[c_cpl]
            ml = cloc[pi_c[multi]]
            _, pfirst, pid = _unique_rows(np.stack([mbox, ml], axis=1))
            pb_, pl_ = mbox[pfirst], ml[pfirst]
            pr_ = src.box_rc[pb_]
            owner = np.repeat(np.arange(len(pfirst)), pr_)
            within = _segment_arange(pr_)
            rep = np.repeat(src.box_rs[pb_], pr_) + within
            tr = loc_tier[pl_[owner], rec_spl[rep]]
            starts = np.cumsum(pr_) - pr_
            best = np.minimum.reduceat(tr, starts)
            isc = tr == best[owner]
            nc = np.add.reduceat(isc.astype(np.int64), starts)
            allc = nc == pr_
            small = pr_ <= 62
            bits = np.where(isc & (within < 62), np.left_shift(np.int64(1), np.minimum(within, 61)), 0)
            code = np.add.reduceat(bits, starts)
            code = np.where(allc, 0, np.where(small, code, -(np.arange(len(pfirst)) + 1)))
            # masks of large replica sets (> 62) are looked up by pair id
            for j in np.flatnonzero(~allc & ~small).tolist():
                pair_bits[-(j + 1)] = np.flatnonzero(isc[starts[j]:starts[j] + pr_[j]]).tolist()
            mcode = code[pid]
        # identical pieces (same source box, same bytes, same candidates) balance as one class,
        # biggest first, ties by first appearance
        _, gfirst, gid = _unique_rows(np.stack([mbox, P_bytes[mP], mcode], axis=1))
        G = len(gfirst)
        gP = mP[gfirst]
        gcount = np.bincount(gid, minlength=G)
        gorder = np.lexsort((np.arange(G), -P_bytes[gP]))
        grank = np.empty(G, np.int64)
        grank[gorder] = np.arange(G)
        member_order = np.lexsort((np.arange(len(multi)), grank[gid]))
        loads = loads_arr.tolist()
        rec_link_l = rec_link.tolist()
        vals: list = []
        rs_l = rs.tolist()
        rc_l = rc.tolist()
        pb_l = P_bytes.tolist()
        salt_l = P_salt.tolist()
        gP_l = gP.tolist()
        gcount_l = gcount.tolist()
        gcode_l = mcode[gfirst].tolist()
        for g in gorder.tolist():
            p = gP_l[g]
            c = gcount_l[g]
            r0 = rs_l[p]
            code = gcode_l[g]
            if code == 0:
                cand = list(range(r0, r0 + rc_l[p]))
            elif code > 0:
                cand = [r0 + i for i in range(rc_l[p]) if (code >> i) & 1]
            else:
                cand = [r0 + i for i in pair_bits[code]]
            n = len(cand)
            sh = salt_l[p] % n
            if sh:
                cand = cand[sh:] + cand[:sh]
            k = _distribute(loads, [rec_link_l[x] for x in cand], c, float(pb_l[p]))
            vals.extend(_round_robin(cand, k))
        pi_src[multi[member_order]] = np.array(vals, np.int64)
        loads_arr = np.array(loads, np.float64)
    elif len(multi):
        loads_arr = np.bincount(rec_link[pi_src], weights=P_bytes[pi_P].astype(np.float64),
                                minlength=max(n_links, 1)).astype(np.float64) if NPI else loads_arr

    if pk:
        pi_src = np.where(override >= 0, override, pi_src)

    # -- templates and run bases -----------------------------------------------------------
    tmpl = _Templates()
    is_packed_rec = np.zeros(len(src.rec_rank), bool)
    is_packed_rec[src.n_layout_recs:] = True
    if NPI:
        # template per (piece geometry, source strides): computed per piece with its first replica's
        # strides, redone only for instances whose source has other strides (packed copies, odd replicas)
        cstr = np.ones_like(P_sz)
        for d in range(D - 2, -1, -1):
            cstr[:, d] = cstr[:, d + 1] * np.maximum(P_sz[:, d + 1], 1)
        keyp = np.concatenate([P_sz, cstr, req.st[P_row], P_sisz[:, None], P_disz[:, None]], axis=1)
        tp = _template_ids(tmpl, keyp, D)
        sid = _unique_rows(src.rec_str)[2]
        key0 = np.concatenate([P_sz, src.rec_str[rs], req.st[P_row], P_sisz[:, None], P_disz[:, None]], axis=1)
        t0 = _template_ids(tmpl, key0, D)
        pi_tm = t0[pi_P]
        P_sdelta = P_sisz * ((P_lo - src.rec_lo[rs]) * src.rec_str[rs]).sum(axis=1)
        pi_sbase = src.rec_off[pi_src] + P_sdelta[pi_P]
        odd = np.flatnonzero((sid[pi_src] != sid[rs][pi_P]) | is_packed_rec[pi_src])
        if len(odd):
            Po = pi_P[odd]
            so = pi_src[odd]
            pi_sbase[odd] = src.rec_off[so] + P_sisz[Po] * ((P_lo[Po] - src.rec_lo[so]) * src.rec_str[so]).sum(axis=1)
            # contiguous packed copies of exactly the piece box use the packed template
            dense = is_packed_rec[so] & (src.rec_str[so] == cstr[Po]).all(axis=1)
            pi_tm[odd[dense]] = tp[Po[dense]]
            rest = ~dense
            if rest.any():
                Po, so = Po[rest], so[rest]
                ko = np.concatenate([P_sz[Po], src.rec_str[so], req.st[P_row[Po]], P_sisz[Po][:, None],
                                     P_disz[Po][:, None]], axis=1)
                pi_tm[odd[rest]] = _template_ids(tmpl, ko, D)
    else:
        pi_tm = np.zeros(0, np.int64)
        pi_sbase = np.zeros(0, np.int64)
        tp = np.zeros(NP, np.int64)
    T_n, T_run, T_sisz, T_disz = tmpl.arrays()
    if NPI:
        pi_n = T_n[pi_tm]
        saved = pi_n - T_n[tp][pi_P]
        pi_pack = (~is_packed_rec[pi_src]) & (saved > 0) & cost.pack_pays(saved, P_bytes[pi_P])
    else:
        pi_n = np.zeros(0, np.int64)
        pi_pack = np.zeros(0, bool)
    pi_mlen = (T_run[pi_tm] * T_sisz[pi_tm]) if NPI else np.zeros(0, np.int64)
    pi_tail = np.zeros(NPI, bool)

    # -- merge whole single-run pieces consecutive in both memories ------------------------
    cand = np.flatnonzero(pi_n == 1)
    if len(cand) > 1:
        _, _, rec_gid = _unique_rows(np.stack([src.rec_rank, src.rec_region], axis=1))
        gkey = pi_c[cand] * (int(rec_gid.max()) + 1) + rec_gid[pi_src[cand]]
        sb = pi_sbase[cand]
        if len(sb) and sb.max() < (1 << 40) and gkey.max() < (1 << 22):
            o = np.argsort((gkey << 40) | sb, kind="stable")
        else:
            o = np.lexsort((sb, gkey))
        cs = cand[o]
        g = gkey[o]
        sbo = sb[o]
        Pc = pi_P[cs]
        tmc = pi_tm[cs]
        slen = T_run[tmc] * T_sisz[tmc]
        dlen = T_run[tmc] * T_disz[tmc]
        dreg = req.region[P_row[Pc]]
        dbase = P_dbase[Pc]
        sc = req.scode[P_row[Pc]]
        dc = req.code[P_row[Pc]]
        join = np.zeros(len(cs), bool)
        join[1:] = (g[1:] == g[:-1]) & (sbo[1:] == sbo[:-1] + slen[:-1]) & (dreg[1:] == dreg[:-1]) & \
            (dbase[1:] == dbase[:-1] + dlen[:-1]) & (sc[1:] == sc[:-1]) & (dc[1:] == dc[:-1])
        if join.any():
            head = np.flatnonzero(~join)
            grp = np.cumsum(~join) - 1
            tot = np.bincount(grp, weights=slen.astype(np.float64)).astype(np.int64)
            pi_tail[cs[join]] = True
            pi_mlen[cs[head]] = tot
            # a merged read starts at the group's first piece in source order; keep that piece's
            # destination as the read's destination by making it the group head
    # per-consumer counts and bytes
    cnt_pi = np.where(pi_tail, 0, pi_n)
    read_counts = np.bincount(pi_c, weights=cnt_pi.astype(np.float64), minlength=C).astype(np.int64) \
        if NPI else np.zeros(C, np.int64)
    pi_bytes = P_bytes[pi_P] if NPI else np.zeros(0, np.int64)
    dst_bytes = np.bincount(pi_c, weights=pi_bytes.astype(np.float64), minlength=C).astype(np.int64) \
        if NPI else np.zeros(C, np.int64)
    link_bytes = np.bincount(rec_link[pi_src], weights=pi_bytes.astype(np.float64), minlength=n_links) \
        if NPI else np.zeros(n_links)
    dlink_bytes = np.bincount(c_dlink, weights=dst_bytes.astype(np.float64), minlength=len(dlink_of_key)) \
        if C else np.zeros(0)
    if NPI:
        rpos = np.searchsorted(ranks_all, src.rec_rank)
        rank_bytes = np.bincount(rpos[pi_src], weights=pi_bytes.astype(np.float64), minlength=len(ranks_all))
        keep_r = rank_bytes > 0
        ranks_u, rank_bytes = ranks_all[keep_r], rank_bytes[keep_r]
    else:
        ranks_u, rank_bytes = np.zeros(0, np.int64), np.zeros(0)

    perm = np.argsort(pi_c, kind="stable") if NPI else np.zeros(0, np.int64)
    cstart = np.zeros(C + 1, np.int64)
    if C:
        cstart[1:] = np.cumsum(np.bincount(pi_c, minlength=C))
    stagger = np.zeros(C, np.int64)
    for i, cid in enumerate(consumers):
        stagger[i] = int(staggers[cid]) if (staggers is not None and cid in staggers) else i

    return GlobalPlan(
        consumers=tuple(consumers), tensors=src.names, balance=balance, stale_packed=stale_packed,
        _cindex=cindex, _D=D, _read_counts=read_counts, _dst_bytes=dst_bytes, _link_bytes=link_bytes,
        _dlink_bytes=dlink_bytes, _src_ranks=ranks_u, _src_rank_bytes=rank_bytes,
        _perm=perm, _cstart=cstart, _pi_c=pi_c, _pi_P=pi_P, _pi_src=pi_src, _pi_tm=pi_tm,
        _pi_sbase=pi_sbase, _pi_mlen=pi_mlen, _pi_tail=pi_tail, _pi_pack=pi_pack, _pi_bytes=pi_bytes,
        _P_row=P_row, _P_t=P_t, _P_lo=P_lo, _P_sz=P_sz, _P_dbase=P_dbase,
        _row_region=req.region, _row_index=req.index, _row_scode=req.scode, _row_code=req.code,
        _rec_rank=src.rec_rank, _rec_region=src.rec_region, _rec_link=rec_link, _rec_obj=src.rec_obj,
        _n_links=n_links, _stagger=stagger, _tmpl=tmpl, _T_n=T_n,
    )


def plan_global(layouts: Mapping[str, TensorLayout], requests: Mapping[Hashable, Sequence[ShardRecord]], *,
                topology: Optional[Topology] = None, packed: PackedInput = None,
                cost: CostModel = CostModel(), balance: str = "greedy",
                rotations: Optional[Mapping[Hashable, int]] = None,
                staggers: Optional[Mapping[Hashable, int]] = None) -> GlobalPlan:
    """Plan every consumer at once.

    Args:
        layouts: tensor name -> committed publisher layout.
        requests: consumer id -> destination records (``region`` = buffer id, ``byte_offset``,
            ``strides`` and ``dtype`` of the buffer). Consumers passing the *same* sequence object
            share the piece computation.
        topology: optional placements; candidates are restricted to the best locality tier.
        packed: packed copies (``PackedShard``s, or consumer id -> records) preferred for the
            consumers they list when their box equals a piece exactly.
        balance: ``"greedy"`` (water-filling on source links, largest pieces first) or
            ``"rotation"`` (replica ``(rotation + salt) % n``; equals per-consumer ``plan_consumer``).
        rotations: per consumer rotation for ``"rotation"`` (default: the consumer's index among
            the consumers that share its request sequence object).
        staggers: per consumer start offset of the read order over links (default: consumer index).

    Raises:
        PlanError: a tensor not in the layout, a box out of bounds or of the wrong ndim, a box no
            source covers, dtype/shape disagreement, or a non float<->float conversion.
    """
    with _NoGC():
        return _plan(layouts, requests, topology=topology, packed=packed, cost=cost, balance=balance,
                     rotations=rotations, staggers=staggers)


def plan_consumer(layouts: Mapping[str, TensorLayout], request: Sequence[ShardRecord], *,
                  consumer: Hashable = 0, rotation: int = 0, stagger: Optional[int] = None,
                  topology: Optional[Topology] = None, packed: PackedInput = None,
                  cost: CostModel = CostModel()) -> ConsumerPlan:
    """Plan one consumer alone, balanced across independently planning consumers by rotation.

    Use ``rotation`` = this consumer's index among the consumers that read the same boxes (for
    example the rollout instance index for TP rank k) and ``stagger`` = its global consumer index
    (default ``rotation``). The result equals the slice of ``plan_global(..., balance="rotation")``
    with the same rotations and staggers.
    """
    if packed is not None and not isinstance(packed, Mapping):
        items = []
        for p in packed:
            if isinstance(p, ShardRecord):
                items.append(PackedShard(p, (consumer,)))
            else:
                items.append(p)
        packed = items
    with _NoGC():
        gp = _plan(layouts, {consumer: request}, topology=topology, packed=packed, cost=cost, balance="rotation",
                   rotations={consumer: rotation}, staggers={consumer: rotation if stagger is None else stagger})
    return gp.consumer(consumer)


# ----------------------------------------------------------------------------------------------
# Fingerprint and cache


class _Memo:
    """Hashes of immutable inputs memoized by identity (the memo holds a reference, so ids stay valid)."""

    def __init__(self, limit: int = 200_000) -> None:
        self._d: dict[int, tuple[Any, int]] = {}
        self._limit = limit

    def hash(self, obj: Any) -> int:
        ent = self._d.get(id(obj))
        if ent is not None and ent[0] is obj:
            return ent[1]
        h = hash(obj) if not isinstance(obj, list) else hash(tuple(obj))
        if isinstance(obj, (tuple, TensorLayout, frozenset)):
            if len(self._d) >= self._limit:
                self._d.clear()
            self._d[id(obj)] = (obj, h)
        return h


_GLOBAL_MEMO = _Memo()


def fingerprint(layouts: Mapping[str, TensorLayout], requests: Mapping[Hashable, Sequence[ShardRecord]],
                topology: Optional[Topology] = None, packed: PackedInput = None, extra: Any = None,
                *, _memo: Optional[_Memo] = None) -> int:
    """Cheap fingerprint of planning inputs: frozen dataclasses are hashed, with hashes of
    ``TensorLayout`` objects and request tuples memoized by identity (an unchanged steady-state
    step with the same objects costs one dict lookup per tensor and per consumer)."""
    memo = _memo or _GLOBAL_MEMO
    hl = hash(tuple((n, memo.hash(layouts[n])) for n in _sorted_ids(layouts)))
    hr = hash(tuple((c, memo.hash(requests[c])) for c in _sorted_ids(requests)))
    if packed is None:
        hp = 0
    elif isinstance(packed, Mapping):
        hp = hash(tuple((c, memo.hash(packed[c])) for c in _sorted_ids(packed)))
    else:
        hp = memo.hash(packed if isinstance(packed, tuple) else tuple(packed))
    return hash((hl, hr, hash(topology), hp, hash(extra)))


class Planner:
    """Plans with a cache keyed by a fingerprint of (layouts, requests, topology, packed, options).

    ``hits`` / ``misses`` count cache outcomes. Pass ``key`` (for example the catalog version and
    a request epoch) to skip fingerprinting altogether.
    """

    def __init__(self, cost: CostModel = CostModel(), *, cache_size: int = 8) -> None:
        self.cost = cost
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict = OrderedDict()
        self._memo = _Memo()

    def _lookup(self, key: Any, build: Any) -> Any:
        got = self._cache.get(key)
        if got is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return got
        self.misses += 1
        val = build()
        self._cache[key] = val
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return val

    def clear(self) -> None:
        self._cache.clear()

    def plan(self, layouts: Mapping[str, TensorLayout], requests: Mapping[Hashable, Sequence[ShardRecord]], *,
             topology: Optional[Topology] = None, packed: PackedInput = None, balance: str = "greedy",
             rotations: Optional[Mapping[Hashable, int]] = None,
             staggers: Optional[Mapping[Hashable, int]] = None, key: Any = None) -> GlobalPlan:
        opts = (balance, None if rotations is None else tuple(sorted(rotations.items(), key=lambda kv: _sort_key(kv[0]))),
                None if staggers is None else tuple(sorted(staggers.items(), key=lambda kv: _sort_key(kv[0]))),
                self.cost)
        fp = ("global", key, opts) if key is not None else \
            ("global", fingerprint(layouts, requests, topology, packed, opts, _memo=self._memo))
        return self._lookup(fp, lambda: plan_global(layouts, requests, topology=topology, packed=packed,
                                                    cost=self.cost, balance=balance, rotations=rotations,
                                                    staggers=staggers))

    def plan_consumer(self, layouts: Mapping[str, TensorLayout], request: Sequence[ShardRecord], *,
                      consumer: Hashable = 0, rotation: int = 0, stagger: Optional[int] = None,
                      topology: Optional[Topology] = None, packed: PackedInput = None, key: Any = None) -> ConsumerPlan:
        opts = ("consumer", consumer, rotation, stagger, self.cost)
        fp = ("consumer", key, opts) if key is not None else \
            ("consumer", fingerprint(layouts, {consumer: request}, topology, packed, opts, _memo=self._memo))
        return self._lookup(fp, lambda: plan_consumer(layouts, request, consumer=consumer, rotation=rotation,
                                                      stagger=stagger, topology=topology, packed=packed,
                                                      cost=self.cost))


    def plan_one(self, layouts: Mapping[str, TensorLayout], request: Sequence[ShardRecord], *,
                 consumer: Hashable = 0, rotation: int = 0, stagger: Optional[int] = None,
                 topology: Optional[Topology] = None, packed: PackedInput = None, key: Any = None) -> np.ndarray:
        """``plan_consumer(...).reads`` through the cache (the data path's call)."""
        return self.plan_consumer(layouts, request, consumer=consumer, rotation=rotation, stagger=stagger,
                                  topology=topology, packed=packed, key=key).reads


# ----------------------------------------------------------------------------------------------
# Reference executor (tests, loopback paths)


def execute_reads(reads: np.ndarray, sources: Mapping[tuple[int, int], Any], dests: Mapping[int, Any]) -> None:
    """Apply reads with plain copies: ``sources[(rank, region)]`` and ``dests[region]`` are flat
    ``torch.uint8`` tensors (or writable numpy uint8 arrays). Reference code: one Python step per
    read."""
    import torch

    from .layout import torch_dtype

    for r in reads.tolist():
        so, do, ln, rk, sreg, dreg, _t, _i, sdt, ddt, conv = r
        s = sources[(rk, sreg)]
        d = dests[dreg]
        if not conv:
            d[do:do + ln] = s[so:so + ln]
            continue
        st = torch_dtype(DTYPE_CODES[sdt])
        dt = torch_dtype(DTYPE_CODES[ddt])
        sv = torch.as_tensor(s[so:so + ln]).clone().view(st)
        dv = sv.to(dt).view(torch.uint8)
        dl = len(dv)
        if isinstance(d, np.ndarray):
            d[do:do + dl] = dv.numpy()
        else:
            d[do:do + dl] = dv

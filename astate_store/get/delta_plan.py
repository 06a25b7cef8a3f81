"""The plan of a delta pull (docs/delta.md): which tiles of which publisher shards each buffer
needs, and where each changed element of them lands. Pure (no etcd, no transport), cached per
(source layouts, buffers) like the whole pull's plan.

For every buffer and every source shard whose box meets it (one shard per distinct box: of
replicated shards one rank serves), a *job*: the part ``I`` of the shard the buffer holds, the
tiles of the shard that touch ``I`` (``delta_format.Tiling.tiles_touching``: only those tiles'
changes are read, so a consumer reads the changes inside its own boxes), and the shard's 2-D rows
mapped to the buffer (``row_map``: for each row of the shard, the buffer element of the row's
first column in ``I``, or -1 where the row is outside ``I``). ``native/astate_delta.c``'s
``decode`` writes element (r, c) of a tile to ``row_map[r] + (c - c0) * col_stride``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from astate_store.catalog import Layout
from astate_store.get.sources import SourceGroup
from astate_store.model import delta_format as fmt
from astate_store.model.delta_native import GE_COLS, table
from astate_store.model.dtypes import itemsize
from astate_store.model.layout import Box, ShardRecord
from astate_store.model.validation import Entry

__all__ = ["Job", "RankPlan", "DeltaPlan", "plan_delta", "staged_shards"]


@dataclass(frozen=True)
class Job:
    """One (source shard, buffer) pair."""

    rank: int  # the publisher rank of the shard
    shard: int  # its index among the rank's staged shards (slot order)
    dest: int  # the buffer's index in the pull's entries
    name: str  # the tensor (as the buffer names it)
    tiles: np.ndarray  # ids of the shard's tiles that touch the buffer's part (sorted)
    within: np.ndarray  # ids of those tiles the buffer holds whole (verifiable)
    row_map: np.ndarray  # int64 per shard row: buffer element of the row's first column in I, or -1
    c0: int  # first column of I, relative to the shard
    c1: int  # one past its last column
    native: bool  # same dtype, host memory: decode writes the buffer itself


@dataclass
class RankPlan:
    """What one publisher rank serves to the pull."""

    shards: list[ShardRecord]  # its staged shards, distinct byte offsets, slot order
    tilings: list[fmt.Tiling]
    first: np.ndarray  # each shard's first index row
    need: np.ndarray  # the index rows (global, sorted, unique) any job reads
    runs: np.ndarray  # (first row, rows, position in need) of each run of consecutive needed rows
    jt_job: np.ndarray  # per (job, tile) pair of this rank: the job index
    jt_tile: np.ndarray  # ... the tile id
    jt_pos: np.ndarray  # ... the position of the tile's row in need
    need_elems: np.ndarray  # the elements of each needed tile


@dataclass
class DeltaPlan:
    ranks: dict[int, RankPlan]
    jobs: list[Job]
    geoms: np.ndarray  # (jobs, GE_COLS) int64: the native decode's geometry of each job
    whole_bytes: int  # what a whole pull of the same buffers reads


def staged_shards(lay: Layout) -> list[ShardRecord]:
    """A staged rank's shards in slot order, one per distinct byte offset (tied weights' aliases
    share their shard), as the publisher's rows list them."""
    seen: dict[int, ShardRecord] = {}
    for s in lay.shards:
        seen.setdefault(s.byte_offset, s)
    return [seen[o] for o in sorted(seen)]


def plan_delta(
    group: SourceGroup, layouts: Mapping[int, Layout], dests: Sequence[Entry], rotation: int
) -> DeltaPlan | None:
    """The jobs of pulling ``dests`` from the publishers' staged shards; None when some buffer
    is not served by them alone (a name not published: the whole pull names the problem)."""
    index: dict[int, dict[int, int]] = {}
    staged: dict[int, list[ShardRecord]] = {}
    for r, lay in layouts.items():
        staged[r] = staged_shards(lay)
        index[r] = {s.byte_offset: i for i, s in enumerate(staged[r])}
    jobs: list[Job] = []
    whole = 0
    for di, e in enumerate(dests):
        name = next((n for n in (e.name, *e.aliases) if n in group.layouts), None)
        if name is None:
            return None
        lay = group.layouts[name]
        whole += e.box.numel * itemsize(lay.dtype)
        for s in _one_per_box(lay.shards, rotation + di):
            piece = s.box.intersect(e.box)
            if piece is None or s.rank not in index or s.byte_offset not in index[s.rank]:
                if piece is not None:
                    return None  # a shard not staged where the rows say
                continue
            jobs.append(_job(s, index[s.rank][s.byte_offset], di, e, piece, lay.dtype))
    ranks = {r: _rank_plan(staged[r], [(i, j) for i, j in enumerate(jobs) if j.rank == r]) for r in layouts}
    return DeltaPlan(ranks, jobs, _geoms(jobs, dests, staged), whole)


def _one_per_box(shards: Sequence[ShardRecord], pick: int) -> list[ShardRecord]:
    """One shard per distinct box (replicas hold the same bytes; any one serves)."""
    by_box: dict[Box, list[ShardRecord]] = {}
    for s in shards:
        by_box.setdefault(s.box, []).append(s)
    return [c[pick % len(c)] for c in by_box.values()]


def _job(s: ShardRecord, shard: int, di: int, e: Entry, piece: Box, dtype: str) -> Job:
    t = fmt.tiling(tuple(s.box.sizes), itemsize(s.dtype))
    rel_off = tuple(p - o for p, o in zip(piece.offsets, s.box.offsets))
    rel = (rel_off if rel_off else (0,), piece.sizes if piece.sizes else (1,))
    strides = e.strides if e.strides else (1,)
    # the buffer element of (row, first column of I) for each shard row in I
    rows = t.rows_of(*rel)
    row_map = np.full(max(t.R, 1), -1, dtype=np.int64)
    if len(rows):
        lead = s.box.sizes[:-1]
        at = np.zeros(len(rows), dtype=np.int64)
        if lead:
            idx = np.unravel_index(rows, lead)
            for d, i in enumerate(idx):
                at += (i + s.box.offsets[d] - e.box.offsets[d]) * strides[d]
        last = piece.offsets[-1] - e.box.offsets[-1] if piece.offsets else 0
        row_map[rows] = at + last * strides[-1]
    native = e.tensor.is_cpu and e.dtype == dtype
    return Job(
        s.rank,
        shard,
        di,
        e.name,
        t.tiles_touching(*rel),
        t.tiles_within(*rel),
        row_map,
        rel[0][-1],
        rel[0][-1] + rel[1][-1],
        native,
    )


def _rank_plan(shards: list[ShardRecord], jobs: list[tuple[int, Job]]) -> RankPlan:
    tilings = [fmt.tiling(tuple(s.box.sizes), itemsize(s.dtype)) for s in shards]
    first = np.concatenate(([0], np.cumsum([t.ntiles for t in tilings]))).astype(np.int64)
    jt_job = np.concatenate(
        [np.full(len(j.tiles), i, dtype=np.int64) for i, j in jobs] or [np.zeros(0, np.int64)]
    )
    jt_tile = np.concatenate([j.tiles for _, j in jobs] or [np.zeros(0, np.int64)]).astype(np.int64)
    rows = np.concatenate([first[j.shard] + j.tiles for _, j in jobs] or [np.zeros(0, np.int64)]).astype(
        np.int64
    )
    need, jt_pos = np.unique(rows, return_inverse=True)
    # runs of consecutive rows: one read each
    if len(need):
        cut = np.flatnonzero(np.diff(need) != 1) + 1
        starts = np.concatenate(([0], cut))
        ends = np.concatenate((cut, [len(need)]))
        runs = np.stack([need[starts], ends - starts, starts], axis=1).astype(np.int64)
    else:
        runs = np.zeros((0, 3), dtype=np.int64)
    elems = np.concatenate([t.tile_elements() for t in tilings] or [np.zeros(0, np.int64)])
    need_elems = elems[need] if len(need) else np.zeros(0, dtype=np.int64)
    return RankPlan(shards, tilings, first, need, runs, jt_job, jt_tile, jt_pos.astype(np.int64), need_elems)


def _geoms(jobs: list[Job], dests: Sequence[Entry], staged: Mapping[int, list[ShardRecord]]) -> np.ndarray:
    g = table(len(jobs), GE_COLS)
    for i, j in enumerate(jobs):
        s = staged[j.rank][j.shard]
        t = fmt.tiling(tuple(s.box.sizes), itemsize(s.dtype))
        e = dests[j.dest]
        stride = e.strides[-1] if e.strides else 1
        dest = e.tensor.data_ptr() if j.native else 0
        g[i] = (
            t.esize,
            t.C,
            t.TC,
            t.nbands,
            t.gb,
            t.P,
            t.TB,
            j.row_map.ctypes.data,
            j.c0,
            j.c1,
            stride,
            dest,
        )
    return g

"""Phase 2 of a delta pull (``get/delta.py``): reading the changed and raw tiles into one scratch
buffer, and the tables ``_delta.decode`` applies them from (``native/astate_delta.c``); the
elements of buffers it cannot write itself (another dtype, a device) are written through torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from astate_store.catalog.deltas import Delta
from astate_store.get.delta_plan import DeltaPlan
from astate_store.model import delta_format as fmt
from astate_store.model.delta_native import TD_COLS
from astate_store.model.dtypes import torch_dtype
from astate_store.model.validation import Entry
from astate_store.transport.base import make_ops

__all__ = ["Link", "Reads", "fields", "convert"]

_WORD = np.uint64(fmt.ENC_SHIFT)
_MASK = np.uint64(fmt.COUNT_MASK)


@dataclass
class Link:
    """One version of a rank's chain: its delta record, piece base offset and step word."""

    step: int
    delta: Delta
    base_offset: int
    word: tuple[int, int, int]
    rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), dtype=np.uint64))


def fields(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    word = rows[:, 2]
    return (
        (word >> _WORD).astype(np.int64),
        (word & _MASK).astype(np.int64),
        rows[:, 0].astype(np.int64),
        rows[:, 1].astype(np.int64),
    )


class Reads:
    """Phase 2: the reads of encoded and raw tiles, into one scratch buffer."""

    def __init__(self) -> None:
        self.ops: list[np.ndarray] = []
        self.nbytes = 0
        self.count = 0
        # (rank, link) -> (positions in need, offsets in scratch, lengths)
        self._coded: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # (job, tile, offset in scratch, length)
        self._raw: list[tuple[int, int, int, int]] = []
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # (ops, scratch offsets) to rebase
        self.scratch = np.zeros(0, dtype=np.uint8)

    def _take(self, n: int) -> int:
        at = self.nbytes
        self.nbytes += n
        return at

    def coded(
        self, r: int, li: int, peer: int, region: int, pos: np.ndarray, begin: np.ndarray, end: np.ndarray
    ) -> None:
        lens = (end - begin)[pos]
        offs = (
            self.nbytes + np.concatenate(([0], np.cumsum(lens)[:-1])) if len(pos) else np.zeros(0, np.int64)
        )
        self.nbytes += int(lens.sum())
        self._coded[(r, li)] = (pos, offs.astype(np.int64), lens.astype(np.int64))
        if not len(pos):
            return
        # consecutive tiles whose bytes are consecutive too: one read
        b = begin[pos]
        brk = np.flatnonzero(b[1:] != (b + lens)[:-1]) + 1
        starts = np.concatenate(([0], brk))
        stops = np.concatenate((brk, [len(pos)]))
        ops = make_ops(len(starts))
        ops[:, 0], ops[:, 1] = peer, region
        ops[:, 2] = b[starts]
        ops[:, 4] = (b[stops - 1] + lens[stops - 1]) - b[starts]
        self._pending.append((ops, offs[starts]))

    def raw(self, j: int, tile: int, peer: int, region: int, shard_at: int, job: Any, t: fmt.Tiling) -> None:
        """The buffer's part of raw tile ``tile`` (rows of the tile inside the job's box, the
        box's columns), read from N's slot row by row into the scratch, in the order decode
        expects."""
        row0, nrows, c0, w = t.tile(tile)
        lo, hi = max(c0, job.c0), min(c0 + w, job.c1)
        rows = np.arange(row0, row0 + nrows, dtype=np.int64)
        rows = rows[job.row_map[rows] >= 0]
        seg = (hi - lo) * t.esize
        if hi <= lo or not len(rows):
            self._raw.append((j, tile, self.nbytes, 0))
            return
        at = self._take(len(rows) * seg)
        self._raw.append((j, tile, at, len(rows) * seg))
        src = shard_at + (rows * t.C + lo) * t.esize
        if seg == t.C * t.esize:  # whole rows: consecutive rows are one read
            brk = np.flatnonzero(np.diff(rows) != 1) + 1
            starts = np.concatenate(([0], brk))
            stops = np.concatenate((brk, [len(rows)]))
            ops = make_ops(len(starts))
            ops[:, 2] = src[starts]
            ops[:, 4] = (stops - starts) * seg
            offs = at + starts * seg
        else:
            ops = make_ops(len(rows))
            ops[:, 2] = src
            ops[:, 4] = seg
            offs = at + np.arange(len(rows), dtype=np.int64) * seg
        ops[:, 0], ops[:, 1] = peer, region
        self._pending.append((ops, offs))

    def run(self, transport: Any, timeout: float | None, scratch: np.ndarray) -> None:
        """Read everything into ``scratch`` (at least ``nbytes``)."""
        self.scratch = scratch
        if not self._pending:
            return
        base = self.scratch.ctypes.data
        for ops, offs in self._pending:
            ops[:, 3] = base + offs
        ops = np.concatenate([o for o, _ in self._pending])
        self.count = len(ops)
        if len(ops):
            transport.get(ops, timeout=timeout)

    def tiles(self, plan: DeltaPlan, chains: dict[int, list[Link]], li: int) -> tuple[np.ndarray, list[Any]]:
        """The decode table of link ``li`` (counted from each rank's oldest link aligned to the newest)."""
        parts, outs = [], []
        depth = max(len(links) for links in chains.values())
        base = self.scratch.ctypes.data
        for r, links in chains.items():
            k = li - (depth - len(links))
            if k < 0:
                continue
            got = self._coded.get((r, k))
            if got is None or not len(got[0]):
                continue
            pos, offs, lens = got
            rp = plan.ranks[r]
            where = np.full(len(rp.need), -1, dtype=np.int64)
            where[pos] = np.arange(len(pos))
            sel = where[rp.jt_pos] >= 0
            idx = where[rp.jt_pos[sel]]
            tb = np.zeros((int(sel.sum()), TD_COLS), dtype=np.int64)
            tb[:, 0] = rp.jt_job[sel]
            tb[:, 1] = rp.jt_tile[sel]
            tb[:, 2] = base + offs[idx]
            tb[:, 3] = links[k].rows[pos[idx], 2].view(np.int64)
            tb[:, 4] = lens[idx]
            parts.append(tb)
        return _outputs(plan, _in_memory_order(plan, parts), outs)

    def raw_tiles(self, plan: DeltaPlan) -> tuple[np.ndarray, list[Any]]:
        tb = np.zeros((len(self._raw), TD_COLS), dtype=np.int64)
        base = self.scratch.ctypes.data
        for i, (j, tile, at, n) in enumerate(self._raw):
            tb[i, :5] = (j, tile, base + at, fmt.ENC_RAW << fmt.ENC_SHIFT, n)
        return _outputs(plan, tb, [])


def _in_memory_order(plan: DeltaPlan, parts: list[np.ndarray]) -> np.ndarray:
    """The decode table with each job's tiles band by band, the column blocks of a band together:
    the writes then sweep each buffer forwards (tile order is column block major, which would
    sweep a buffer once per column block)."""
    if not parts:
        return np.zeros((0, TD_COLS), dtype=np.int64)
    tb = np.concatenate(parts)
    nbands = plan.geoms[tb[:, 0], 3]
    band, cb = tb[:, 1] % nbands, tb[:, 1] // nbands
    return tb[np.lexsort((cb, band, tb[:, 0]))]


def _outputs(plan: DeltaPlan, tb: np.ndarray, outs: list[Any]) -> tuple[np.ndarray, list[Any]]:
    """The arrays pass A of decode fills for jobs it cannot write itself (another dtype, a device
    buffer): per element of their tiles its buffer offset (-1: outside the box) and its value (8
    bytes of room each). Host buffers of the published dtype need none: pass A checks their
    tiles and pass B decodes them again, writing each value in place. ``outs`` gets the arrays,
    then one (job, offsets, values, [(first, count)]) per such job."""
    if not len(tb):
        return tb, outs
    native_jobs = np.fromiter((j.native for j in plan.jobs), bool, len(plan.jobs))
    conv = ~native_jobs[tb[:, 0]]
    if not conv.any():
        return tb, outs
    esize = plan.geoms[tb[:, 0], 0]
    word = tb[:, 3].astype(np.uint64)
    enc, n = (word >> _WORD).astype(np.int64), (word & _MASK).astype(np.int64)
    raw = enc == fmt.ENC_RAW
    n = np.where(conv, np.where(raw, tb[:, 4] // np.maximum(esize, 1), n), 0)
    start = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.int64)
    off = np.full(max(int(n.sum()), 1), -1, dtype=np.int64)
    vals = np.zeros(max(int(n.sum()), 1) * 8, dtype=np.uint8)
    tb[conv, 5] = off.ctypes.data + start[conv] * 8
    tb[conv, 6] = vals.ctypes.data + start[conv] * 8
    outs.append(off)  # kept alive until the pull is applied
    for j in np.unique(tb[conv, 0]).tolist():
        mine = conv & (tb[:, 0] == j)
        outs.append((j, off, vals, list(zip(start[mine].tolist(), n[mine].tolist()))))
    return tb, outs


def convert(dests: list[Entry], plan: DeltaPlan, outs: list[Any]) -> None:
    """Write the output arrays of converted or device buffers through torch."""
    for item in outs:
        if not isinstance(item, tuple):
            continue  # the offsets array alone
        j, off, vals, pieces = item
        job = plan.jobs[j]
        t = dests[job.dest].tensor
        src = plan.ranks[job.rank].shards[job.shard]
        esize = int(plan.geoms[j, 0])
        idx = np.concatenate([off[s : s + c] for s, c in pieces])
        v = np.concatenate([vals[8 * s : 8 * s + esize * c] for s, c in pieces])
        keep = idx >= 0
        if not keep.any():
            continue
        values = torch.from_numpy(v).view(torch_dtype(src.dtype))[torch.from_numpy(keep)]
        where = torch.from_numpy(idx[keep])
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.dim() else 1
        flat = t.as_strided((span,), (1,), t.storage_offset())
        flat.index_put_((where.to(t.device),), values.to(device=t.device, dtype=t.dtype))

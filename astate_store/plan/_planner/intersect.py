"""Stage 3, intersection: every destination box meets the distinct publisher boxes of its
tensor, giving *pieces* (one vectorized join, chunked to bound memory), then one *instance* per
(consumer, piece) for the consumers sharing that request sequence.

Pieces are computed once per distinct request sequence; instances are what replicas are
assigned to, since two consumers of the same piece may read it from different replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from astate_store.errors import PlanError
from astate_store.model.dtypes import ITEMSIZES
from astate_store.plan._planner.requests import Requests
from astate_store.plan._planner.shards import Sources
from astate_store.plan._planner.util import concat, segment_arange

#: Pieces per chunk of the join (bounds the temporaries of a 1T-parameter plan).
_CHUNK = 1 << 22


@dataclass
class Pieces:
    """Piece table: destination row ``row`` x source box ``box``, the intersection ``lo + sz``
    (padded dims), and derived columns."""

    n: int
    row: np.ndarray  # request row
    box: np.ndarray  # distinct source box
    lo: np.ndarray
    sz: np.ndarray
    t: np.ndarray  # tensor
    u: np.ndarray  # request sequence
    sisz: np.ndarray  # source itemsize
    disz: np.ndarray  # destination itemsize
    bytes: np.ndarray  # source bytes
    dbase: np.ndarray  # destination byte offset of the piece origin
    rs: np.ndarray  # first replica record of the piece's source box
    rc: np.ndarray  # number of replicas of the piece's source box


@dataclass
class Instances:
    """(consumer, piece) pairs, grouped by piece: piece ``p`` has instances ``P_start[p]`` on,
    one per consumer of its sequence in consumer order; ``pos_in_u`` is a consumer's position
    among those sharing its sequence."""

    n: int
    P: np.ndarray  # piece of each instance
    c: np.ndarray  # consumer of each instance
    P_start: np.ndarray
    pos_in_u: np.ndarray


def _join_boxes(
    src: Sources, req: Requests, rows_nb: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Non-empty intersections of each request row with every source box of its tensor:
    ``(row, box, lo, sz, covered elements per row)``."""
    D = src.D
    P_row_parts, P_box_parts, P_lo_parts, P_sz_parts = [], [], [], []
    covered = np.zeros(req.n, np.int64)
    cum = np.cumsum(rows_nb)
    a = 0
    while a < req.n:
        # rows a..b produce about _CHUNK candidate pairs (at least one row)
        base = int(cum[a - 1]) if a else 0
        b = int(np.searchsorted(cum, base + _CHUNK, side="right"))
        b = max(b, a + 1)
        b = min(b, req.n)
        rr = np.arange(a, b)
        cnts = rows_nb[a:b]
        pr = np.repeat(rr, cnts)
        pb = np.repeat(src.t_bs[req.t[rr]], cnts) + segment_arange(cnts)
        lo = np.maximum(req.lo[pr], src.box_lo[pb])
        hi = np.minimum(req.lo[pr] + req.sz[pr], src.box_lo[pb] + src.box_sz[pb])
        ok = (hi > lo).all(axis=1)
        pr, pb, lo, hi = pr[ok], pb[ok], lo[ok], hi[ok]
        sz = hi - lo
        covered[a:b] += np.bincount(
            pr - a, weights=np.prod(sz, axis=1).astype(np.float64), minlength=b - a
        ).astype(np.int64)
        P_row_parts.append(pr)
        P_box_parts.append(pb)
        P_lo_parts.append(lo)
        P_sz_parts.append(sz)
        a = b
    return (
        concat(P_row_parts, (0,)),
        concat(P_box_parts, (0,)),
        concat(P_lo_parts, (0, D)),
        concat(P_sz_parts, (0, D)),
        covered,
    )


def _check_coverage(req: Requests, covered: np.ndarray, numel_row: np.ndarray) -> None:
    # distinct publisher boxes tile each destination exactly once, or the plan is wrong
    if not req.n:
        return
    bad = covered != numel_row
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        r = req.recs[i]
        what = (
            "is not covered by any publisher shard"
            if covered[i] < numel_row[i]
            else "is covered by overlapping publisher shards"
        )
        raise PlanError(
            f"tensor {r.name!r}: destination box {r.box.offsets}+{r.box.sizes} {what} "
            f"({int(covered[i])} of {int(numel_row[i])} elements)"
        )


def intersect(src: Sources, req: Requests) -> Pieces:
    """The piece table of all distinct request sequences (raises if a box is not tiled exactly)."""
    rows_nb = src.t_bc[req.t] if req.n else np.zeros(0, np.int64)
    numel_row = np.prod(req.sz, axis=1) if req.n else np.zeros(0, np.int64)
    rows_nb = np.where(numel_row > 0, rows_nb, 0)
    P_row, P_box, P_lo, P_sz, covered = _join_boxes(src, req, rows_nb)
    _check_coverage(req, covered, numel_row)
    NP = len(P_row)
    P_numel = np.prod(P_sz, axis=1) if NP else np.zeros(0, np.int64)
    P_sisz = ITEMSIZES[req.scode[P_row]]
    P_disz = ITEMSIZES[req.code[P_row]]
    return Pieces(
        n=NP,
        row=P_row,
        box=P_box,
        lo=P_lo,
        sz=P_sz,
        t=req.t[P_row],
        u=req.u[P_row],
        sisz=P_sisz,
        disz=P_disz,
        bytes=P_numel * P_sisz,
        dbase=req.off[P_row] + P_disz * ((P_lo - req.lo[P_row]) * req.st[P_row]).sum(axis=1),
        rs=src.box_rs[P_box],
        rc=src.box_rc[P_box],
    )


def expand_instances(pieces: Pieces, u_of_c: np.ndarray, U: int) -> Instances:
    """One instance per (consumer, piece) of the consumer's request sequence."""
    C = len(u_of_c)
    ucount = np.bincount(u_of_c, minlength=U)
    cons_by_u = np.argsort(u_of_c, kind="stable")
    ustart = np.cumsum(ucount) - ucount
    pos_in_u = np.empty(C, np.int64)
    pos_in_u[cons_by_u] = segment_arange(ucount)
    pcount = ucount[pieces.u]
    P_start = np.cumsum(pcount) - pcount
    pi_P = np.repeat(np.arange(pieces.n), pcount)
    pi_c = cons_by_u[np.repeat(ustart[pieces.u], pcount) + segment_arange(pcount)]
    return Instances(n=len(pi_P), P=pi_P, c=pi_c, P_start=P_start, pos_in_u=pos_in_u)

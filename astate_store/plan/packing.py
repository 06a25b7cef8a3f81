"""Pre-pack round trip: match packed copies that publishers built back to the pieces they
replace, decide which pieces are worth packing (``CostModel``), and list them as ``PackItem``s.

A piece of many small runs costs a read each; one contiguous copy on the publisher can turn
it into a single read. The decision is per piece and independent of sharing, so repeated
planning converges in one round trip.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Optional

import numpy as np

from ..errors import PlanError
from ..layout import Box, ShardRecord
from .contracts import CostModel, PackedInput, PackedShard, PackItem
from .intersect import _Instances, _Pieces
from .shards import _Sources
from .tables import PlanTables
from .util import _segment_arange, _sorted_ids, _unique_rows


def _normalize_packed(packed: PackedInput) -> list[tuple[ShardRecord, tuple]]:
    """Packed copies as ``(record, consumer ids)`` in a deterministic order (the first packed
    source matching a piece wins, so the order decides ties)."""
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


def _match_packed(src: _Sources, pk: list[tuple[ShardRecord, tuple]], pieces: _Pieces, inst: _Instances,
                  cindex: Mapping[Hashable, int], u_of_c: np.ndarray
                  ) -> tuple[_Sources, Optional[np.ndarray], int]:
    """Sources extended with the packed records, the packed record overriding each instance
    (-1: none; None when nothing was packed) and the count of packed entries matching no piece.

    A packed copy replaces an instance only when its box equals the piece exactly, for a
    consumer it lists.
    """
    if not pk:
        return src, None, 0
    override = np.full(inst.n, -1, np.int64)
    src, prec_idx, prec_sz = src.with_packed([r for r, _ in pk])
    lens = np.fromiter((len(cs) for _, cs in pk), np.int64, len(pk))
    ent_c = np.array([cindex.get(cid, -1) for _, cs in pk for cid in cs], np.int64)
    ent_j = np.repeat(np.arange(len(pk)), lens)
    keep = ent_c >= 0
    ent_c, ent_j = ent_c[keep], ent_j[keep]
    prec = prec_idx[ent_j]
    eu = u_of_c[ent_c]
    # group pieces and entries by (request, tensor, lo, sz); every piece of the group matches
    kP = np.concatenate([pieces.u[:, None], pieces.t[:, None], pieces.lo, pieces.sz], axis=1)
    kE = np.concatenate([eu[:, None], src.rec_t[prec][:, None], src.rec_lo[prec], prec_sz[ent_j]], axis=1)
    _, _, gid = _unique_rows(np.concatenate([kP, kE]))
    gP, gE = gid[:pieces.n], gid[pieces.n:]
    po = np.argsort(gP, kind="stable")
    lo_i = np.searchsorted(gP[po], gE, side="left")
    hi_i = np.searchsorted(gP[po], gE, side="right")
    nm = hi_i - lo_i
    stale = int((nm == 0).sum())
    e_rep = np.repeat(np.arange(len(gE)), nm)
    mp = po[np.repeat(lo_i, nm) + _segment_arange(nm)]
    if len(mp):
        mpi = inst.P_start[mp] + inst.pos_in_u[ent_c[e_rep]]
        mrec = prec[e_rep]
        # first packed source wins (deterministic: input order)
        first = np.unique(mpi, return_index=True)[1]
        override[mpi[first]] = mrec[first]
    return src, override, stale


def _pack_decision(cost: CostModel, T_n: np.ndarray, tp: np.ndarray, pi_n: np.ndarray, pi_src: np.ndarray,
                   is_packed_rec: np.ndarray, pieces: _Pieces, inst: _Instances) -> np.ndarray:
    """Instances worth a packed copy: reads saved against the contiguous template of the piece
    (``tp``) pay for the publisher's copy. Already-packed sources are never packed again."""
    if not inst.n:
        return np.zeros(0, bool)
    saved = pi_n - T_n[tp][inst.P]
    return (~is_packed_rec[pi_src]) & (saved > 0) & cost.pack_pays(saved, pieces.bytes[inst.P])


def _build_pack_items(plan: PlanTables) -> dict[int, list[PackItem]]:
    """Per publisher rank, the marked instances as ``PackItem``s: one item per (source record,
    box) listing every consumer that reads it, ranks and items in a deterministic order."""
    pis = np.flatnonzero(plan.pi_pack)
    out: dict[int, list[PackItem]] = {}
    if len(pis) == 0:
        return out
    P = plan.pi_P[pis]
    srcr = plan.pi_src[pis]
    key = np.concatenate([srcr[:, None], plan.P_t[P][:, None], plan.P_lo[P], plan.P_sz[P]], axis=1)
    _, first, inv = _unique_rows(key)
    G = len(first)
    # consumers of each item, sorted and deduplicated (one consumer may read a box twice)
    pc = plan.pi_c[pis]
    o = np.lexsort((pc, inv))
    gi, ci = inv[o], pc[o]
    keep = np.ones(len(o), bool)
    keep[1:] = (gi[1:] != gi[:-1]) | (ci[1:] != ci[:-1])
    gi, ci = gi[keep], ci[keep]
    bounds = np.searchsorted(gi, np.arange(G + 1)).tolist()
    cons = plan.consumers
    cons_l = [cons[c] for c in ci.tolist()]
    D = plan.D
    Pf = P[first]
    lo_l = plan.P_lo[Pf].tolist()
    sz_l = plan.P_sz[Pf].tolist()
    rec_l = srcr[first].tolist()
    rec_obj = plan.rec_obj
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

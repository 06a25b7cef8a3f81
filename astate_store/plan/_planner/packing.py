"""Pre-pack round trip: match packed copies that publishers built back to the pieces they
replace, decide which pieces are worth packing (``CostModel``), and list them as ``PackItem``s.

A piece of many small runs costs a read each; one contiguous copy on the publisher can turn
it into a single read. The decision is per piece and independent of sharing, so repeated
planning converges in one round trip.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from itertools import chain, repeat
from operator import itemgetter

import numpy as np

from astate_store.errors import PlanError
from astate_store.model.layout import Box, ShardRecord, frozen_instance
from astate_store.plan._planner.intersect import Instances, Pieces
from astate_store.plan._planner.shards import Sources
from astate_store.plan._planner.tables import PlanTables
from astate_store.plan._planner.util import segment_arange, sorted_ids, unique_rows
from astate_store.plan.contracts import CostModel, PackedInput, PackedShard, PackItem


def normalize_packed(packed: PackedInput) -> list[tuple[ShardRecord, tuple]]:
    """Packed copies as ``(record, consumer ids)`` in a deterministic order (the first packed
    source matching a piece wins, so the order decides ties)."""
    if packed is None:
        return []
    if isinstance(packed, Mapping):
        by_id: dict[int, list] = {}
        for cid in sorted_ids(packed):
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


def match_packed(
    src: Sources,
    pk: list[tuple[ShardRecord, tuple]],
    pieces: Pieces,
    inst: Instances,
    cindex: Mapping[Hashable, int],
    u_of_c: np.ndarray,
) -> tuple[Sources, np.ndarray | None, int]:
    """Sources extended with the packed records, the packed record overriding each instance
    (-1: none; None when nothing was packed) and the count of packed entries matching no piece.

    A packed copy replaces an instance only when its box equals the piece exactly, for a
    consumer it lists.
    """
    if not pk:
        return src, None, 0
    override = np.full(inst.n, -1, np.int64)
    src, prec_idx, prec_sz = src.with_packed([r for r, _ in pk])
    lens = np.fromiter(map(len, map(itemgetter(1), pk)), np.int64, len(pk))
    ent_c = np.fromiter(
        map(cindex.get, chain.from_iterable(map(itemgetter(1), pk)), repeat(-1)), np.int64, int(lens.sum())
    )
    ent_j = np.repeat(np.arange(len(pk)), lens)
    keep = ent_c >= 0
    ent_c, ent_j = ent_c[keep], ent_j[keep]
    # boxes first: one id per distinct (tensor, lo, sz) over pieces and packed records (tens of
    # thousands of rows, not one per (consumer, record) entry); then (box, request) as one int
    kP = np.concatenate([pieces.t[:, None], pieces.lo, pieces.sz], axis=1)
    kR = np.concatenate([src.rec_t[prec_idx][:, None], src.rec_lo[prec_idx], prec_sz], axis=1)
    _, _, bid = unique_rows(np.concatenate([kP, kR]))
    U = int(max(pieces.u.max(initial=-1), u_of_c.max(initial=-1))) + 1
    gP = bid[: pieces.n] * U + pieces.u
    gE = bid[pieces.n :][ent_j] * U + u_of_c[ent_c]
    prec = prec_idx[ent_j]
    po = np.argsort(gP, kind="stable")
    sP = gP[po]
    lo_i = np.searchsorted(sP, gE, side="left")
    hi_i = np.searchsorted(sP, gE, side="right")
    nm = hi_i - lo_i
    stale = int((nm == 0).sum())
    e_rep = np.repeat(np.arange(len(gE)), nm)
    mp = po[np.repeat(lo_i, nm) + segment_arange(nm)]
    if len(mp):
        mpi = inst.P_start[mp] + inst.pos_in_u[ent_c[e_rep]]
        mrec = prec[e_rep]
        # first packed source wins (deterministic: input order)
        first = np.unique(mpi, return_index=True)[1]
        override[mpi[first]] = mrec[first]
    return src, override, stale


def pack_decision(
    cost: CostModel,
    T_n: np.ndarray,
    tp: np.ndarray,
    pi_n: np.ndarray,
    pi_src: np.ndarray,
    is_packed_rec: np.ndarray,
    pieces: Pieces,
    inst: Instances,
) -> np.ndarray:
    """Instances worth a packed copy: reads saved against the contiguous template of the piece
    (``tp``) pay for the publisher's copy. Already-packed sources are never packed again."""
    if not inst.n:
        return np.zeros(0, bool)
    saved = pi_n - T_n[tp][inst.P]
    return (~is_packed_rec[pi_src]) & (saved > 0) & cost.pack_pays(saved, pieces.bytes[inst.P])


def build_pack_items(plan: PlanTables) -> dict[int, list[PackItem]]:
    """Per publisher rank, the marked instances as ``PackItem``s: one item per (source record,
    box) listing every consumer that reads it, ranks and items in a deterministic order."""
    pis = np.flatnonzero(plan.pi_pack)
    out: dict[int, list[PackItem]] = {}
    if len(pis) == 0:
        return out
    P = plan.pi_P[pis]
    srcr = plan.pi_src[pis]
    # distinct (source, piece) pairs first (one int each; consumers sharing a request sequence
    # share its pieces), in first-seen order; then the distinct boxes among those pairs
    k1 = srcr * (int(P.max()) + 1) + P
    _, f1, inv1 = np.unique(k1, return_index=True, return_inverse=True)
    o1 = np.argsort(f1, kind="stable")
    r1 = np.empty_like(o1)
    r1[o1] = np.arange(len(o1))
    f1 = f1[o1]
    P1, s1 = P[f1], srcr[f1]
    _, first2, inv2 = unique_rows(
        np.concatenate([s1[:, None], plan.P_t[P1][:, None], plan.P_lo[P1], plan.P_sz[P1]], axis=1)
    )
    first, inv = f1[first2], inv2[r1[inv1.reshape(-1)]]
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
    # checked fields: build the frozen records without their per-field __setattr__ (46k items for a
    # 1T-parameter fleet, where the dataclass constructors were most of this function)
    for g in range(G):
        rec = rec_obj[rec_l[g]]
        cut = D - len(rec.global_shape)
        box = frozen_instance(Box, {"offsets": tuple(lo_l[g][cut:]), "sizes": tuple(sz_l[g][cut:])})
        item = frozen_instance(
            PackItem, {"source": rec, "box": box, "consumers": tuple(cons_l[bounds[g] : bounds[g + 1]])}
        )
        lst = out.get(rec.rank)
        if lst is None:
            out[rec.rank] = [item]
        else:
            lst.append(item)
    return dict(sorted(out.items()))

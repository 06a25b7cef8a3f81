"""Stage 6, runs: give every instance its run template (from the piece geometry and its chosen
replica's strides) and source base offset, then merge whole single-run pieces that are
consecutive in both memories into one read.

Reads stay compact here (a template id and a base per instance); ``materialize`` expands them
for one consumer on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from astate_store.plan._planner.intersect import Instances, Pieces
from astate_store.plan._planner.requests import Requests
from astate_store.plan._planner.shards import Sources
from astate_store.plan._planner.templates import Templates, template_ids
from astate_store.plan._planner.util import unique_rows


@dataclass
class Runs:
    """Run structure of every instance: template ``tm`` (``n`` runs of ``mlen`` source bytes,
    ``mlen`` widened for a merged group head), source byte base ``sbase``, merged-away ``tail``
    instances, and ``tp`` the template each piece would have from a contiguous packed copy."""

    tmpl: Templates
    tm: np.ndarray
    sbase: np.ndarray
    tp: np.ndarray
    is_packed_rec: np.ndarray  # per source record: a packed copy (not a layout shard)
    T_n: np.ndarray
    T_run: np.ndarray
    T_sisz: np.ndarray
    T_disz: np.ndarray
    n: np.ndarray
    mlen: np.ndarray
    tail: np.ndarray


def _contiguous_strides(P_sz: np.ndarray, D: int) -> np.ndarray:
    """Row-major element strides of each piece box (the layout of its packed copy)."""
    cstr = np.ones_like(P_sz)
    for d in range(D - 2, -1, -1):
        cstr[:, d] = cstr[:, d + 1] * np.maximum(P_sz[:, d + 1], 1)
    return cstr


def _redo_odd(
    tmpl: Templates,
    src: Sources,
    req: Requests,
    pieces: Pieces,
    inst: Instances,
    pi_src: np.ndarray,
    odd: np.ndarray,
    cstr: np.ndarray,
    tp: np.ndarray,
    is_packed_rec: np.ndarray,
    pi_tm: np.ndarray,
    pi_sbase: np.ndarray,
) -> None:
    """Template and base of the instances ``odd`` whose source is not laid out like the piece's
    first replica (in place)."""
    D = src.D
    P_lo, P_sz, P_sisz, P_disz, P_row = pieces.lo, pieces.sz, pieces.sisz, pieces.disz, pieces.row
    Po = inst.P[odd]
    so = pi_src[odd]
    pi_sbase[odd] = src.rec_off[so] + P_sisz[Po] * ((P_lo[Po] - src.rec_lo[so]) * src.rec_str[so]).sum(axis=1)
    # contiguous packed copies of exactly the piece box use the packed template
    dense = is_packed_rec[so] & (src.rec_str[so] == cstr[Po]).all(axis=1)
    pi_tm[odd[dense]] = tp[Po[dense]]
    rest = ~dense
    if rest.any():
        Po, so = Po[rest], so[rest]
        ko = np.concatenate(
            [P_sz[Po], src.rec_str[so], req.st[P_row[Po]], P_sisz[Po][:, None], P_disz[Po][:, None]], axis=1
        )
        pi_tm[odd[rest]] = template_ids(tmpl, ko, D)


def instance_templates(
    src: Sources, req: Requests, pieces: Pieces, inst: Instances, pi_src: np.ndarray
) -> Runs:
    """Template id and source base of every instance.

    A template per (piece geometry, source strides) is computed per piece with its first
    replica's strides, and redone only for instances whose source has other strides (packed
    copies, odd replicas). Template ids are interned in this order, which the plan keeps.
    """
    D = src.D
    tmpl = Templates()
    is_packed_rec = np.zeros(len(src.rec_rank), bool)
    is_packed_rec[src.n_layout_recs :] = True
    if inst.n:
        P_lo, P_sz, P_sisz, P_disz, P_row, rs = (
            pieces.lo,
            pieces.sz,
            pieces.sisz,
            pieces.disz,
            pieces.row,
            pieces.rs,
        )
        pi_P = inst.P
        cstr = _contiguous_strides(P_sz, D)
        keyp = np.concatenate([P_sz, cstr, req.st[P_row], P_sisz[:, None], P_disz[:, None]], axis=1)
        tp = template_ids(tmpl, keyp, D)
        sid = unique_rows(src.rec_str)[2]
        key0 = np.concatenate(
            [P_sz, src.rec_str[rs], req.st[P_row], P_sisz[:, None], P_disz[:, None]], axis=1
        )
        t0 = template_ids(tmpl, key0, D)
        pi_tm = t0[pi_P]
        P_sdelta = P_sisz * ((P_lo - src.rec_lo[rs]) * src.rec_str[rs]).sum(axis=1)
        pi_sbase = src.rec_off[pi_src] + P_sdelta[pi_P]
        odd = np.flatnonzero((sid[pi_src] != sid[rs][pi_P]) | is_packed_rec[pi_src])
        if len(odd):
            _redo_odd(tmpl, src, req, pieces, inst, pi_src, odd, cstr, tp, is_packed_rec, pi_tm, pi_sbase)
    else:
        pi_tm = np.zeros(0, np.int64)
        pi_sbase = np.zeros(0, np.int64)
        tp = np.zeros(pieces.n, np.int64)
    T_n, T_run, T_sisz, T_disz = tmpl.arrays()
    return Runs(
        tmpl=tmpl,
        tm=pi_tm,
        sbase=pi_sbase,
        tp=tp,
        is_packed_rec=is_packed_rec,
        T_n=T_n,
        T_run=T_run,
        T_sisz=T_sisz,
        T_disz=T_disz,
        n=T_n[pi_tm] if inst.n else np.zeros(0, np.int64),
        mlen=(T_run[pi_tm] * T_sisz[pi_tm]) if inst.n else np.zeros(0, np.int64),
        tail=np.zeros(inst.n, bool),
    )


def rerun_templates(
    base: Runs,
    src: Sources,
    req: Requests,
    pieces: Pieces,
    inst: Instances,
    pi_src: np.ndarray,
    changed: np.ndarray,
) -> Runs:
    """``instance_templates`` of ``pi_src`` from ``base``, the runs of a plan whose sources differ
    only at the instances ``changed`` (packed copies replacing their pieces; ``src`` extends the
    sources of ``base``): only those instances get a new template and base."""
    tmpl = base.tmpl.copy()
    is_packed_rec = np.zeros(len(src.rec_rank), bool)
    is_packed_rec[src.n_layout_recs :] = True
    pi_tm, pi_sbase = base.tm.copy(), base.sbase.copy()
    if len(changed):
        cstr = _contiguous_strides(pieces.sz, src.D)
        _redo_odd(
            tmpl, src, req, pieces, inst, pi_src, changed, cstr, base.tp, is_packed_rec, pi_tm, pi_sbase
        )
    T_n, T_run, T_sisz, T_disz = tmpl.arrays()
    return Runs(
        tmpl=tmpl,
        tm=pi_tm,
        sbase=pi_sbase,
        tp=base.tp,
        is_packed_rec=is_packed_rec,
        T_n=T_n,
        T_run=T_run,
        T_sisz=T_sisz,
        T_disz=T_disz,
        n=T_n[pi_tm],
        mlen=T_run[pi_tm] * T_sisz[pi_tm],
        tail=np.zeros(inst.n, bool),
    )


def merge_whole_runs(
    src: Sources, req: Requests, pieces: Pieces, inst: Instances, pi_src: np.ndarray, runs: Runs
) -> None:
    """Merge single-run instances of one consumer and one source (rank, region) that are
    consecutive in both memories with the same dtypes: the group head's ``mlen`` becomes the
    group's bytes and the others are marked ``tail`` (in place)."""
    cand = np.flatnonzero(runs.n == 1)
    if len(cand) <= 1:
        return
    _, _, rec_gid = unique_rows(np.stack([src.rec_rank, src.rec_region], axis=1))
    gkey = inst.c[cand] * (int(rec_gid.max()) + 1) + rec_gid[pi_src[cand]]
    sb = runs.sbase[cand]
    # sort by (consumer, source region, source offset); one packed int64 key when it fits
    if len(sb) and sb.max() < (1 << 40) and gkey.max() < (1 << 22):
        o = np.argsort((gkey << 40) | sb, kind="stable")
    else:
        o = np.lexsort((sb, gkey))
    cs = cand[o]
    g = gkey[o]
    sbo = sb[o]
    Pc = inst.P[cs]
    tmc = runs.tm[cs]
    slen = runs.T_run[tmc] * runs.T_sisz[tmc]
    dlen = runs.T_run[tmc] * runs.T_disz[tmc]
    P_row = pieces.row
    dreg = req.region[P_row[Pc]]
    dbase = pieces.dbase[Pc]
    sc = req.scode[P_row[Pc]]
    dc = req.code[P_row[Pc]]
    join = np.zeros(len(cs), bool)
    join[1:] = (
        (g[1:] == g[:-1])
        & (sbo[1:] == sbo[:-1] + slen[:-1])
        & (dreg[1:] == dreg[:-1])
        & (dbase[1:] == dbase[:-1] + dlen[:-1])
        & (sc[1:] == sc[:-1])
        & (dc[1:] == dc[:-1])
    )
    if join.any():
        # a merged read starts at the group's first piece in source order; that piece's
        # destination is the read's destination, so it is the group head
        head = np.flatnonzero(~join)
        grp = np.cumsum(~join) - 1
        tot = np.bincount(grp, weights=slen.astype(np.float64)).astype(np.int64)
        runs.tail[cs[join]] = True
        runs.mlen[cs[head]] = tot

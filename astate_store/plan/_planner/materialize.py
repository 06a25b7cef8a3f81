"""Stage 7, reads and their order: expand one consumer's compact instances (template + base)
into ``READ_DTYPE`` reads and order them so the consumer drains all its source links at the
same rate, starting at a link rotated by its stagger index.

Runs on demand per consumer (a fleet plan never materializes every consumer's reads at once).
"""

from __future__ import annotations

import numpy as np

from astate_store.plan._planner.tables import PlanTables
from astate_store.plan.contracts import READ_DTYPE


def _link_order(
    link: np.ndarray,
    src_off: np.ndarray,
    src_region: np.ndarray,
    src_rank: np.ndarray,
    length: np.ndarray,
    n_links: int,
    stagger: int,
) -> np.ndarray:
    """Permutation interleaving reads over source links in proportion to bytes: reads are sorted
    by their progress through their link's bytes, ties by link rotated by ``stagger``."""
    o1 = np.lexsort((src_off, src_region, src_rank, link))
    lk = link[o1]
    ln = length[o1].astype(np.float64)
    cum = np.cumsum(ln) - ln
    newg = np.ones(len(lk), bool)
    newg[1:] = lk[1:] != lk[:-1]
    gstart = np.flatnonzero(newg)
    gid = np.cumsum(newg) - 1
    gtot = np.add.reduceat(ln, gstart)
    prog = (cum - cum[gstart][gid]) / np.maximum(gtot[gid], 1.0)
    nl = max(int(n_links), 1)
    rot = (lk - int(stagger)) % nl
    o2 = np.lexsort((rot, prog))
    return o1[o2]


def materialize(plan: PlanTables, c: int) -> np.ndarray:
    """Reads of consumer index ``c`` in link-interleaved order."""
    s, e = plan.cstart[c], plan.cstart[c + 1]
    pis = plan.perm[s:e]
    # merged-away tails and empty pieces produce no read
    pis = pis[~plan.pi_tail[pis]]
    tm = plan.pi_tm[pis]
    n = plan.T_n[tm]
    pis = pis[n > 0]
    tm = tm[n > 0]
    n = n[n > 0]
    P = plan.pi_P[pis]
    src = plan.pi_src[pis]
    row = plan.P_row[P]
    cnt = int(n.sum())
    out = np.empty(cnt, READ_DTYPE)
    if cnt == 0:
        return out
    rep = np.repeat(np.arange(len(pis)), n)
    src_off = np.repeat(plan.pi_sbase[pis], n)
    dst_off = np.repeat(plan.P_dbase[P], n)
    length = np.repeat(plan.pi_mlen[pis], n)
    # multi-run pieces add their template's relative run offsets
    multi = np.flatnonzero(n > 1)
    if len(multi):
        starts = np.cumsum(n) - n
        for j in multi.tolist():
            rs, rd = plan.tmpl.rel(int(tm[j]))
            a = int(starts[j])
            src_off[a : a + len(rs)] += rs
            dst_off[a : a + len(rd)] += rd
    out["src_offset"] = src_off
    out["dst_offset"] = dst_off
    out["length"] = length
    out["src_rank"] = np.repeat(plan.rec_rank[src], n)
    out["src_region"] = np.repeat(plan.rec_region[src], n)
    out["dst_region"] = np.repeat(plan.row_region[row], n)
    out["tensor"] = np.repeat(plan.P_t[P], n)
    out["dst_index"] = np.repeat(plan.row_index[row], n)
    sc = plan.row_scode[row]
    dc = plan.row_code[row]
    out["src_dtype"] = np.repeat(sc, n)
    out["dst_dtype"] = np.repeat(dc, n)
    out["convert"] = np.repeat(sc != dc, n)
    link = plan.rec_link[src][rep]
    order = _link_order(
        link, src_off, out["src_region"], out["src_rank"], length, plan.n_links, int(plan.stagger[c])
    )
    return out[order]

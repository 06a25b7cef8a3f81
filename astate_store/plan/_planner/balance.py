"""Stage 5, replica choice: give every (consumer, piece) instance one replica of its source box.

``"greedy"`` (a global plan) water-fills bytes onto source links, largest piece classes first;
``"rotation"`` picks ``(rotation + salt(piece)) mod candidates`` so consumers planning alone
still spread out. With a ``Fabric`` on both sides, candidates are the best locality tier only.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from astate_store.plan._planner.intersect import Instances, Pieces
from astate_store.plan._planner.links import Links
from astate_store.plan._planner.shards import Sources
from astate_store.plan._planner.util import segment_arange, unique_rows

#: Per-dim multipliers of the piece salt (odd 32-bit constants; dims beyond 8 add unmixed).
_MIX = np.array(
    [0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09],
    dtype=np.int64,
)

#: Candidate masks of up to this many replicas are packed into one int64 bit set.
_MASK_BITS = 62


def _piece_salt(src: Sources, pieces: Pieces) -> np.ndarray:
    """A stable per-piece number (tensor name CRC + mixed origin): rotations of different
    pieces start at different replicas, which spreads any remainder of replicas / consumers."""
    D = src.D
    P_t, P_lo = pieces.t, pieces.lo
    return (
        (src.tensor_salt[P_t] + (P_lo * _MIX[:D][None, :] if D <= 8 else P_lo).sum(axis=1)) & 0x7FFFFFFF
        if pieces.n
        else np.zeros(0, np.int64)
    )


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
            for i in sorted(range(r), key=f.__getitem__)[: c - s]:
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
    """Deal replica ``reps[i]`` out ``k[i]`` times, interleaved, so neighbouring consumers of a
    class use different replicas."""
    if min(k) == max(k):
        return reps * k[0]
    out = []
    for j in range(max(k)):
        for i, rep in enumerate(reps):
            if k[i] > j:
                out.append(rep)
    return out


def _assign_rotation(
    pi_src: np.ndarray,
    multi: np.ndarray,
    pieces: Pieces,
    inst: Instances,
    links: Links,
    salt: np.ndarray,
    consumers: list,
    rotations: Mapping[Hashable, int] | None,
) -> None:
    """Replica ``(rotation + salt) % candidates`` for the instances ``multi`` (in place)."""
    rs, rc = pieces.rs, pieces.rc
    pi_c = inst.c
    rot = np.zeros(len(consumers), np.int64)
    for i, cid in enumerate(consumers):
        rot[i] = (
            int(rotations[cid]) if (rotations is not None and cid in rotations) else int(inst.pos_in_u[i])
        )
    mp_ = inst.P[multi]
    key = rot[pi_c[multi]] + salt[mp_]
    if not links.use_topo:
        pi_src[multi] = rs[mp_] + key % rc[mp_]
        return
    # expand every instance to its replicas, keep those of the best tier, take the key-th one
    cnt = rc[mp_]
    owner = np.repeat(np.arange(len(multi)), cnt)
    rep = np.repeat(rs[mp_], cnt) + segment_arange(cnt)
    tr = links.tier[links.c_cpl[pi_c[multi]][owner], links.rec_spl[rep]]
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


def _candidate_codes(
    src: Sources, links: Links, inst: Instances, multi: np.ndarray, mbox: np.ndarray
) -> tuple[np.ndarray, dict[int, list[int]]]:
    """Candidate replicas of each instance in ``multi`` as a code: 0 = all replicas, > 0 = bit
    set of replica indices, < 0 = key into the returned dict of index lists (large sets).

    Consumers with identical tier rows form one locality class, so masks are computed per
    unique (box, class) pair, never per instance.
    """
    mcode = np.zeros(len(multi), np.int64)
    pair_bits: dict[int, list[int]] = {}
    if not links.use_topo:
        return mcode, pair_bits
    tier, c_cpl = links.tier, links.c_cpl
    _, _, cloc = unique_rows(tier[c_cpl].astype(np.int64))
    nloc = int(cloc.max()) + 1
    loc_tier = np.zeros((nloc, tier.shape[1]), np.int64)
    loc_tier[cloc] = tier[c_cpl]
    ml = cloc[inst.c[multi]]
    _, pfirst, pid = unique_rows(np.stack([mbox, ml], axis=1))
    pb_, pl_ = mbox[pfirst], ml[pfirst]
    pr_ = src.box_rc[pb_]
    owner = np.repeat(np.arange(len(pfirst)), pr_)
    within = segment_arange(pr_)
    rep = np.repeat(src.box_rs[pb_], pr_) + within
    tr = loc_tier[pl_[owner], links.rec_spl[rep]]
    starts = np.cumsum(pr_) - pr_
    best = np.minimum.reduceat(tr, starts)
    isc = tr == best[owner]
    nc = np.add.reduceat(isc.astype(np.int64), starts)
    allc = nc == pr_
    small = pr_ <= _MASK_BITS
    bits = np.where(
        isc & (within < _MASK_BITS), np.left_shift(np.int64(1), np.minimum(within, _MASK_BITS - 1)), 0
    )
    code = np.add.reduceat(bits, starts)
    code = np.where(allc, 0, np.where(small, code, -(np.arange(len(pfirst)) + 1)))
    # masks of large replica sets are looked up by pair id
    for j in np.flatnonzero(~allc & ~small).tolist():
        pair_bits[-(j + 1)] = np.flatnonzero(isc[starts[j] : starts[j] + pr_[j]]).tolist()
    return code[pid], pair_bits


def _assign_greedy(
    pi_src: np.ndarray,
    multi: np.ndarray,
    pieces: Pieces,
    inst: Instances,
    links: Links,
    src: Sources,
    salt: np.ndarray,
) -> None:
    """Water-fill the instances ``multi`` onto their candidates' links (in place), on top of the
    load of the instances already fixed."""
    P_bytes = pieces.bytes
    loads_arr = np.zeros(max(links.n_links, 1), np.float64)
    done = pi_src >= 0
    if done.any():
        loads_arr += np.bincount(
            links.rec_link[pi_src[done]],
            weights=P_bytes[inst.P[done]].astype(np.float64),
            minlength=len(loads_arr),
        )[: len(loads_arr)]
    mP = inst.P[multi]
    mbox = pieces.box[mP]
    mcode, pair_bits = _candidate_codes(src, links, inst, multi, mbox)
    # identical pieces (same source box, same bytes, same candidates) balance as one class,
    # biggest first, ties by first appearance
    _, gfirst, gid = unique_rows(np.stack([mbox, P_bytes[mP], mcode], axis=1))
    G = len(gfirst)
    gP = mP[gfirst]
    gcount = np.bincount(gid, minlength=G)
    gorder = np.lexsort((np.arange(G), -P_bytes[gP]))
    grank = np.empty(G, np.int64)
    grank[gorder] = np.arange(G)
    member_order = np.lexsort((np.arange(len(multi)), grank[gid]))
    # the class loop is sequential (each class sees the loads of the previous ones): plain lists
    loads = loads_arr.tolist()
    rec_link_l = links.rec_link.tolist()
    vals: list = []
    rs_l = pieces.rs.tolist()
    rc_l = pieces.rc.tolist()
    pb_l = P_bytes.tolist()
    salt_l = salt.tolist()
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
        # start each class at a salted replica so ties do not all land on the first one
        sh = salt_l[p] % n
        if sh:
            cand = cand[sh:] + cand[:sh]
        k = _distribute(loads, [rec_link_l[x] for x in cand], c, float(pb_l[p]))
        vals.extend(_round_robin(cand, k))
    pi_src[multi[member_order]] = np.array(vals, np.int64)


def assign_replicas(
    src: Sources,
    pieces: Pieces,
    inst: Instances,
    links: Links,
    balance: str,
    consumers: list,
    rotations: Mapping[Hashable, int] | None,
) -> np.ndarray:
    """Source record of every instance (packed copies are applied afterwards, see ``_plan``)."""
    pi_src = np.full(inst.n, -1, np.int64)
    pi_P = inst.P
    rc = pieces.rc
    # a single replica is the only choice; only instances with several go to the balancer
    one = rc[pi_P] == 1
    pi_src[one] = pieces.rs[pi_P[one]]
    multi = np.flatnonzero(rc[pi_P] > 1)
    if not len(multi):
        return pi_src
    salt = _piece_salt(src, pieces)
    if balance == "rotation":
        _assign_rotation(pi_src, multi, pieces, inst, links, salt, consumers, rotations)
    elif balance == "greedy":
        _assign_greedy(pi_src, multi, pieces, inst, links, src, salt)
    return pi_src

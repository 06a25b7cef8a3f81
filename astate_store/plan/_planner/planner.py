"""The planning driver and its public entry points: ``plan_global`` (every consumer at once) and
``plan_consumer`` (one consumer alone). ``_plan`` runs the stages in order:

shards -> requests -> intersect -> links -> balance (``_prepare``, reused by the pass with the
packed copies) -> packed matches -> runs -> pre-pack decision -> merge -> totals (``GlobalPlan``).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import is_

import numpy as np

from astate_store.errors import PlanError
from astate_store.model.layout import GCPaused, ShardRecord, TensorLayout
from astate_store.plan._planner.balance import assign_replicas
from astate_store.plan._planner.intersect import Instances, Pieces, expand_instances, intersect
from astate_store.plan._planner.links import Links, build_links
from astate_store.plan._planner.packing import match_packed, normalize_packed, pack_decision
from astate_store.plan._planner.requests import Requests, dedupe_requests
from astate_store.plan._planner.result import ConsumerPlan, GlobalPlan
from astate_store.plan._planner.runs import Runs, instance_templates, merge_whole_runs, rerun_templates
from astate_store.plan._planner.shards import Sources, compile_sources
from astate_store.plan._planner.tables import PlanTables
from astate_store.plan._planner.util import sorted_ids
from astate_store.plan.contracts import CostModel, Fabric, PackedInput, PackedShard


@dataclass(frozen=True, eq=False)
class _Prepared:
    """Everything the plan needs before packed copies enter: sources, requests, pieces, their
    instances, links and the balanced replica of every instance. It depends only on (layouts,
    requests, topology, balance, rotations), which a pre-pack round trip keeps."""

    src: Sources
    consumers: list
    cindex: dict
    u_of_c: np.ndarray
    req: Requests
    pieces: Pieces
    inst: Instances
    links: Links
    pi_src: np.ndarray
    #: the runs of ``pi_src`` before merging (``Runs``), set by the first plan without packed copies
    memo: dict = field(default_factory=dict)


#: The last preparation, held weakly (the ``GlobalPlan`` built from it holds it strongly): the
#: pass with packed copies reuses the pass that asked for them while the caller keeps that plan.
_PREP_MEMO: dict[str, tuple[tuple, weakref.ref[_Prepared]]] = {}


def _prep_key(
    src: Sources,
    requests: Mapping[Hashable, Sequence[ShardRecord]],
    consumers: list,
    topology: Fabric | None,
    balance: str,
    rotations: Mapping[Hashable, int] | None,
) -> tuple | None:
    """The objects a preparation depends on, compared by identity (frozen inputs only: request
    sequences must be tuples of frozen records); None when some input could change in place."""
    seqs = tuple(map(requests.__getitem__, consumers))
    if not all(type(q) is tuple for q in seqs):
        return None
    rot = None if rotations is None else tuple((c, rotations[c]) for c in sorted_ids(rotations))
    return (src, tuple(consumers), seqs, topology, balance, rot)


def _same_key(a: tuple, b: tuple) -> bool:
    return (
        a[0] is b[0]
        and a[1] == b[1]
        and len(a[2]) == len(b[2])
        and all(map(is_, a[2], b[2]))
        and a[3] is b[3]
        and a[4] == b[4]
        and a[5] == b[5]
    )


def _prepare(
    layouts: Mapping[str, TensorLayout],
    requests: Mapping[Hashable, Sequence[ShardRecord]],
    topology: Fabric | None,
    balance: str,
    rotations: Mapping[Hashable, int] | None,
) -> _Prepared:
    """Stages 1-4 (shards, requests, intersect, links, balance), reused from the previous call
    while its plan is alive and every input is the same object."""
    src = compile_sources(layouts)
    consumers = sorted_ids(requests)
    key = _prep_key(src, requests, consumers, topology, balance, rotations)
    if key is not None and "last" in _PREP_MEMO:
        k0, ref = _PREP_MEMO["last"]
        hit = ref()
        if hit is not None and _same_key(k0, key):
            return hit
    cindex = {cid: i for i, cid in enumerate(consumers)}
    # consumers with equal requests share the piece computation
    seqs, u_of_c = dedupe_requests(requests, consumers)
    req = Requests(src, seqs)
    pieces = intersect(src, req)
    inst = expand_instances(pieces, u_of_c, len(seqs))
    links = build_links(src, consumers, topology)
    pi_src = assign_replicas(src, pieces, inst, links, balance, consumers, rotations)
    prep = _Prepared(src, consumers, cindex, u_of_c, req, pieces, inst, links, pi_src)
    if key is not None:
        _PREP_MEMO["last"] = (key, weakref.ref(prep))
    return prep


def _plan(
    layouts: Mapping[str, TensorLayout],
    requests: Mapping[Hashable, Sequence[ShardRecord]],
    *,
    topology: Fabric | None,
    packed: PackedInput,
    cost: CostModel,
    balance: str,
    rotations: Mapping[Hashable, int] | None,
    staggers: Mapping[Hashable, int] | None,
) -> GlobalPlan:
    if balance not in ("greedy", "rotation"):
        raise PlanError(f"unknown balance mode {balance!r}")
    prep = _prepare(layouts, requests, topology, balance, rotations)
    consumers, cindex, req, pieces, inst = prep.consumers, prep.cindex, prep.req, prep.pieces, prep.inst
    src, override, stale_packed = match_packed(
        prep.src, normalize_packed(packed), pieces, inst, cindex, prep.u_of_c
    )
    # packed copies replace their pieces *after* balancing, which sees the layout's records only:
    # the pass with the copies balances exactly as the pass that asked for them (the copies live
    # on the ranks it chose), so the pre-pack round trip converges in one step
    pi_src, links = prep.pi_src, prep.links
    base = prep.memo.get("runs")
    if override is None:
        runs = base if base is not None else instance_templates(src, req, pieces, inst, pi_src)
        prep.memo["runs"] = runs
        runs = replace(runs, mlen=runs.mlen.copy(), tail=runs.tail.copy())  # merging edits these two
    else:
        pi_src = np.where(override >= 0, override, pi_src)
        links = build_links(src, consumers, topology)
        # instances keep their templates except those a packed copy now serves
        runs = (
            instance_templates(src, req, pieces, inst, pi_src)
            if base is None
            else rerun_templates(base, src, req, pieces, inst, pi_src, np.flatnonzero(override >= 0))
        )
    pi_pack = pack_decision(cost, runs.T_n, runs.tp, runs.n, pi_src, runs.is_packed_rec, pieces, inst)
    merge_whole_runs(src, req, pieces, inst, pi_src, runs)
    return _assemble(prep, src, links, runs, pi_src, pi_pack, balance, stale_packed, staggers)


def _totals(
    src: Sources, pieces: Pieces, inst: Instances, links: Links, runs: Runs, pi_src: np.ndarray, C: int
) -> dict[str, np.ndarray]:
    """Exact per-consumer read counts and bytes, per-link and per-rank bytes, without
    materializing a read (``PlanTables`` fields)."""
    NPI, pi_c, n_links = inst.n, inst.c, links.n_links
    cnt_pi = np.where(runs.tail, 0, runs.n)
    read_counts = (
        np.bincount(pi_c, weights=cnt_pi.astype(np.float64), minlength=C).astype(np.int64)
        if NPI
        else np.zeros(C, np.int64)
    )
    pi_bytes = pieces.bytes[inst.P] if NPI else np.zeros(0, np.int64)
    dst_bytes = (
        np.bincount(pi_c, weights=pi_bytes.astype(np.float64), minlength=C).astype(np.int64)
        if NPI
        else np.zeros(C, np.int64)
    )
    link_bytes = (
        np.bincount(links.rec_link[pi_src], weights=pi_bytes.astype(np.float64), minlength=n_links)
        if NPI
        else np.zeros(n_links)
    )
    ranks_all = links.ranks_all
    if NPI:
        rpos = np.searchsorted(ranks_all, src.rec_rank)
        rank_bytes = np.bincount(rpos[pi_src], weights=pi_bytes.astype(np.float64), minlength=len(ranks_all))
        keep_r = rank_bytes > 0
        ranks_u, rank_bytes = ranks_all[keep_r], rank_bytes[keep_r]
    else:
        ranks_u, rank_bytes = np.zeros(0, np.int64), np.zeros(0)
    return dict(
        read_counts=read_counts,
        dst_bytes=dst_bytes,
        link_bytes=link_bytes,
        src_ranks=ranks_u,
        src_rank_bytes=rank_bytes,
        pi_bytes=pi_bytes,
    )


def _assemble(
    prep: _Prepared,
    src: Sources,
    links: Links,
    runs: Runs,
    pi_src: np.ndarray,
    pi_pack: np.ndarray,
    balance: str,
    stale_packed: int,
    staggers: Mapping[Hashable, int] | None,
) -> GlobalPlan:
    """The compact ``GlobalPlan``: instances grouped by consumer (``perm`` / ``cstart``) plus the
    tables ``materialize`` and ``pack_items`` read, as one frozen ``PlanTables``."""
    consumers, cindex, req, pieces, inst = prep.consumers, prep.cindex, prep.req, prep.pieces, prep.inst
    C, NPI, pi_c = len(consumers), inst.n, inst.c
    perm = np.argsort(pi_c, kind="stable") if NPI else np.zeros(0, np.int64)
    cstart = np.zeros(C + 1, np.int64)
    if C:
        cstart[1:] = np.cumsum(np.bincount(pi_c, minlength=C))
    stagger = np.zeros(C, np.int64)
    for i, cid in enumerate(consumers):
        stagger[i] = int(staggers[cid]) if (staggers is not None and cid in staggers) else i
    tables = PlanTables(
        consumers=tuple(consumers),
        cindex=cindex,
        stagger=stagger,
        perm=perm,
        cstart=cstart,
        **_totals(src, pieces, inst, links, runs, pi_src, C),
        pi_c=pi_c,
        pi_P=inst.P,
        pi_src=pi_src,
        pi_tm=runs.tm,
        pi_sbase=runs.sbase,
        pi_mlen=runs.mlen,
        pi_tail=runs.tail,
        pi_pack=pi_pack,
        P_row=pieces.row,
        P_t=pieces.t,
        P_lo=pieces.lo,
        P_sz=pieces.sz,
        P_dbase=pieces.dbase,
        row_region=req.region,
        row_index=req.index,
        row_scode=req.scode,
        row_code=req.code,
        rec_rank=src.rec_rank,
        rec_region=src.rec_region,
        rec_link=links.rec_link,
        rec_obj=src.rec_obj,
        D=src.D,
        n_links=links.n_links,
        tmpl=runs.tmpl,
        T_n=runs.T_n,
    )
    return GlobalPlan(tables, tensors=src.names, balance=balance, stale_packed=stale_packed, prepared=prep)


def plan_global(
    layouts: Mapping[str, TensorLayout],
    requests: Mapping[Hashable, Sequence[ShardRecord]],
    *,
    topology: Fabric | None = None,
    packed: PackedInput = None,
    cost: CostModel = CostModel(),
    balance: str = "greedy",
    rotations: Mapping[Hashable, int] | None = None,
    staggers: Mapping[Hashable, int] | None = None,
) -> GlobalPlan:
    """Plan every consumer at once.

    Args:
        layouts: tensor name -> committed publisher layout.
        requests: consumer id -> destination records (``region`` = buffer id, ``byte_offset``,
            ``strides`` and ``dtype`` of the buffer). Consumers passing the *same* sequence object
            share the piece computation.
        topology: optional ``Fabric`` of placements; candidates are restricted to the best
            locality tier.
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
    with GCPaused():
        return _plan(
            layouts,
            requests,
            topology=topology,
            packed=packed,
            cost=cost,
            balance=balance,
            rotations=rotations,
            staggers=staggers,
        )


def plan_consumer(
    layouts: Mapping[str, TensorLayout],
    request: Sequence[ShardRecord],
    *,
    consumer: Hashable = 0,
    rotation: int = 0,
    stagger: int | None = None,
    topology: Fabric | None = None,
    packed: PackedInput = None,
    cost: CostModel = CostModel(),
) -> ConsumerPlan:
    """Plan one consumer alone, balanced across independently planning consumers by rotation.

    Use ``rotation`` = this consumer's index among the consumers that read the same boxes (for
    example the rollout instance index for TP rank k) and ``stagger`` = its global consumer index
    (default ``rotation``). The result equals the slice of ``plan_global(..., balance="rotation")``
    with the same rotations and staggers. ``packed`` may also list bare ``ShardRecord``s: copies
    built for this consumer.
    """
    if packed is not None and not isinstance(packed, Mapping):
        items = []
        for p in packed:
            if isinstance(p, ShardRecord):
                items.append(PackedShard(p, (consumer,)))
            else:
                items.append(p)
        packed = items
    with GCPaused():
        gp = _plan(
            layouts,
            {consumer: request},
            topology=topology,
            packed=packed,
            cost=cost,
            balance="rotation",
            rotations={consumer: rotation},
            staggers={consumer: rotation if stagger is None else stagger},
        )
    return gp.consumer(consumer)

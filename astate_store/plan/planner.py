"""The planning driver and its public entry points: ``plan_global`` (every consumer at once) and
``plan_consumer`` (one consumer alone). ``_plan`` runs the stages in order:

shards -> requests -> intersect -> packed matches -> links -> balance -> runs -> pre-pack
decision -> merge -> totals (``GlobalPlan``).
"""

from __future__ import annotations

from typing import Hashable, Mapping, Optional, Sequence

import numpy as np

from ..errors import PlanError
from ..layout import GCPaused, ShardRecord, TensorLayout
from .balance import _assign_replicas
from .contracts import CostModel, Fabric, PackedInput, PackedShard
from .intersect import _expand_instances, _Instances, _intersect, _Pieces
from .links import _build_links, _Links
from .packing import _match_packed, _normalize_packed, _pack_decision
from .requests import _dedupe_requests, _Requests
from .result import ConsumerPlan, GlobalPlan
from .runs import _instance_templates, _merge_whole_runs, _Runs
from .shards import _compile_sources, _Sources
from .tables import PlanTables
from .util import _sorted_ids


def _plan(layouts: Mapping[str, TensorLayout], requests: Mapping[Hashable, Sequence[ShardRecord]], *,
          topology: Optional[Fabric], packed: PackedInput, cost: CostModel, balance: str,
          rotations: Optional[Mapping[Hashable, int]], staggers: Optional[Mapping[Hashable, int]]) -> GlobalPlan:
    if balance not in ("greedy", "rotation"):
        raise PlanError(f"unknown balance mode {balance!r}")
    src = _compile_sources(layouts)
    consumers = _sorted_ids(requests)
    cindex = {cid: i for i, cid in enumerate(consumers)}
    # consumers with equal requests share the piece computation
    seqs, u_of_c = _dedupe_requests(requests, consumers)
    req = _Requests(src, seqs)
    pieces = _intersect(src, req)
    inst = _expand_instances(pieces, u_of_c, len(seqs))
    src, override, stale_packed = _match_packed(src, _normalize_packed(packed), pieces, inst, cindex, u_of_c)
    links = _build_links(src, consumers, topology)
    pi_src = _assign_replicas(src, pieces, inst, links, balance, consumers, rotations)
    # packed copies replace their pieces *after* balancing: the balancer sees the same inputs as
    # the pass that asked for the copies, so it picks the same replicas (the copies live on those
    # ranks) and the pre-pack round trip converges in one step
    if override is not None:
        pi_src = np.where(override >= 0, override, pi_src)
    runs = _instance_templates(src, req, pieces, inst, pi_src)
    pi_pack = _pack_decision(cost, runs.T_n, runs.tp, runs.n, pi_src, runs.is_packed_rec, pieces, inst)
    _merge_whole_runs(src, req, pieces, inst, pi_src, runs)
    return _assemble(src, req, pieces, inst, links, runs, pi_src, pi_pack, consumers, cindex, balance,
                     stale_packed, staggers)


def _totals(src: _Sources, pieces: _Pieces, inst: _Instances, links: _Links, runs: _Runs, pi_src: np.ndarray,
            C: int) -> dict[str, np.ndarray]:
    """Exact per-consumer read counts and bytes, per-link and per-rank bytes, without
    materializing a read (``PlanTables`` fields)."""
    NPI, pi_c, n_links = inst.n, inst.c, links.n_links
    cnt_pi = np.where(runs.tail, 0, runs.n)
    read_counts = np.bincount(pi_c, weights=cnt_pi.astype(np.float64), minlength=C).astype(np.int64) \
        if NPI else np.zeros(C, np.int64)
    pi_bytes = pieces.bytes[inst.P] if NPI else np.zeros(0, np.int64)
    dst_bytes = np.bincount(pi_c, weights=pi_bytes.astype(np.float64), minlength=C).astype(np.int64) \
        if NPI else np.zeros(C, np.int64)
    link_bytes = np.bincount(links.rec_link[pi_src], weights=pi_bytes.astype(np.float64), minlength=n_links) \
        if NPI else np.zeros(n_links)
    ranks_all = links.ranks_all
    if NPI:
        rpos = np.searchsorted(ranks_all, src.rec_rank)
        rank_bytes = np.bincount(rpos[pi_src], weights=pi_bytes.astype(np.float64), minlength=len(ranks_all))
        keep_r = rank_bytes > 0
        ranks_u, rank_bytes = ranks_all[keep_r], rank_bytes[keep_r]
    else:
        ranks_u, rank_bytes = np.zeros(0, np.int64), np.zeros(0)
    return dict(read_counts=read_counts, dst_bytes=dst_bytes, link_bytes=link_bytes,
                src_ranks=ranks_u, src_rank_bytes=rank_bytes, pi_bytes=pi_bytes)


def _assemble(src: _Sources, req: _Requests, pieces: _Pieces, inst: _Instances, links: _Links, runs: _Runs,
              pi_src: np.ndarray, pi_pack: np.ndarray, consumers: list, cindex: dict, balance: str,
              stale_packed: int, staggers: Optional[Mapping[Hashable, int]]) -> GlobalPlan:
    """The compact ``GlobalPlan``: instances grouped by consumer (``perm`` / ``cstart``) plus the
    tables ``materialize`` and ``pack_items`` read, as one frozen ``PlanTables``."""
    C, NPI, pi_c = len(consumers), inst.n, inst.c
    perm = np.argsort(pi_c, kind="stable") if NPI else np.zeros(0, np.int64)
    cstart = np.zeros(C + 1, np.int64)
    if C:
        cstart[1:] = np.cumsum(np.bincount(pi_c, minlength=C))
    stagger = np.zeros(C, np.int64)
    for i, cid in enumerate(consumers):
        stagger[i] = int(staggers[cid]) if (staggers is not None and cid in staggers) else i
    tables = PlanTables(
        consumers=tuple(consumers), cindex=cindex, stagger=stagger, perm=perm, cstart=cstart,
        **_totals(src, pieces, inst, links, runs, pi_src, C),
        pi_c=pi_c, pi_P=inst.P, pi_src=pi_src, pi_tm=runs.tm, pi_sbase=runs.sbase, pi_mlen=runs.mlen,
        pi_tail=runs.tail, pi_pack=pi_pack,
        P_row=pieces.row, P_t=pieces.t, P_lo=pieces.lo, P_sz=pieces.sz, P_dbase=pieces.dbase,
        row_region=req.region, row_index=req.index, row_scode=req.scode, row_code=req.code,
        rec_rank=src.rec_rank, rec_region=src.rec_region, rec_link=links.rec_link, rec_obj=src.rec_obj,
        D=src.D, n_links=links.n_links, tmpl=runs.tmpl, T_n=runs.T_n,
    )
    return GlobalPlan(tables, tensors=src.names, balance=balance, stale_packed=stale_packed)


def plan_global(layouts: Mapping[str, TensorLayout], requests: Mapping[Hashable, Sequence[ShardRecord]], *,
                topology: Optional[Fabric] = None, packed: PackedInput = None,
                cost: CostModel = CostModel(), balance: str = "greedy",
                rotations: Optional[Mapping[Hashable, int]] = None,
                staggers: Optional[Mapping[Hashable, int]] = None) -> GlobalPlan:
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
        return _plan(layouts, requests, topology=topology, packed=packed, cost=cost, balance=balance,
                     rotations=rotations, staggers=staggers)


def plan_consumer(layouts: Mapping[str, TensorLayout], request: Sequence[ShardRecord], *,
                  consumer: Hashable = 0, rotation: int = 0, stagger: Optional[int] = None,
                  topology: Optional[Fabric] = None, packed: PackedInput = None,
                  cost: CostModel = CostModel()) -> ConsumerPlan:
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
        gp = _plan(layouts, {consumer: request}, topology=topology, packed=packed, cost=cost, balance="rotation",
                   rotations={consumer: rotation}, staggers={consumer: rotation if stagger is None else stagger})
    return gp.consumer(consumer)

"""Resharding planner: which bytes each consumer reads from which publisher, and in what order.

Pure code (numpy): no etcd, no transport, no I/O. Inputs are the frozen layout contracts of
``astate_store.model.layout``; outputs are numpy structured arrays of reads (``READ_DTYPE``) that a
native data path can walk without Python per read.

Pipeline (all vectorized over pieces, no Python loop per run), one module per stage:

1. ``shards`` / ``requests``: publisher layouts and the distinct consumer request sequences
   compiled into validated arrays.
2. ``intersect``: every destination box is intersected with the distinct publisher boxes of its
   tensor (*pieces*), one instance per (consumer, piece). Identical boxes on several ranks are
   replicas; a piece may be read from any of them.
3. ``links`` / ``balance``: each instance is given one replica. ``balance="greedy"`` (global
   plan) water-fills bytes onto source links, largest pieces first, ties by index;
   ``"rotation"`` picks ``(rotation + salt(piece)) mod replicas`` so consumers planning alone
   still spread out. A ``Fabric`` of ``Placement``s restricts the candidates to the best
   locality tier first.
4. ``templates`` / ``runs``: per piece geometry a template of coalesced runs is built once
   (innermost dims that are dense in both source and destination merge into one run; outer dims
   that nest merge too) and reused by every consumer with that geometry. Whole-piece runs that
   are consecutive in both source and destination memory merge across pieces.
5. ``packing``: a piece whose runs are many and small is marked for a contiguous copy on the
   publisher when ``saved_reads * per_read_seconds > bytes / copy rate`` (``CostModel``).
   ``pack_items()`` lists them per publisher rank; the packed copies come back as ``PackedShard``
   sources that the planner then prefers for exactly those consumers.
6. ``materialize``: each consumer's reads are interleaved over its source links in proportion
   to the bytes it takes from each, starting at a link rotated by the consumer's stagger index.

``planner`` drives the stages (``plan_global``, ``plan_consumer``), ``result`` holds the plan
objects, ``cache`` the fingerprinting ``Planner``, ``contracts`` the public records, ``execute``
the reference executor.

Reads are kept compact (a piece table plus run templates); ``GlobalPlan.reads(consumer)`` /
``ConsumerPlan.reads`` materialize one consumer's array on demand (cached). Counts are exact
without materializing.
"""

from __future__ import annotations

from astate_store.plan._planner.cache import Planner, fingerprint
from astate_store.plan._planner.columns import whole_buffer_reads
from astate_store.plan._planner.execute import execute_reads
from astate_store.plan._planner.planner import plan_consumer, plan_global
from astate_store.plan._planner.prepack import Copy, consumer_requests, servable
from astate_store.plan._planner.result import ConsumerPlan, GlobalPlan
from astate_store.plan.contracts import (
    COPY_DTYPE,
    READ_DTYPE,
    CostModel,
    Fabric,
    PackedShard,
    PackItem,
    Placement,
)

__all__ = [
    "READ_DTYPE",
    "COPY_DTYPE",
    "CostModel",
    "Placement",
    "Fabric",
    "PackItem",
    "PackedShard",
    "ConsumerPlan",
    "GlobalPlan",
    "Planner",
    "plan_global",
    "plan_consumer",
    "fingerprint",
    "execute_reads",
    "whole_buffer_reads",
    "consumer_requests",
    "Copy",
    "servable",
]

"""Plan results: ``GlobalPlan`` keeps every consumer's reads compact (a piece table plus run
templates) with exact counts and byte totals; ``ConsumerPlan`` is one consumer's materialized
reads and pack items. Per-consumer reads and pack items are built on demand and cached."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from astate_store.model.layout import GCPaused
from astate_store.plan._planner.materialize import materialize
from astate_store.plan._planner.packing import build_pack_items
from astate_store.plan._planner.tables import PlanTables
from astate_store.plan.contracts import PackItem


class ConsumerPlan:
    """One consumer's reads (materialized) and the pack items it would benefit from."""

    def __init__(
        self,
        consumer: Hashable,
        tensors: tuple,
        reads: np.ndarray,
        pack_items: tuple,
        src_bytes: dict,
        nbytes: int,
    ):
        self.consumer = consumer
        self.tensors = tensors
        self.reads = reads
        self.pack_items = pack_items
        self.src_bytes = src_bytes
        self.nbytes = nbytes

    @property
    def read_count(self) -> int:
        return len(self.reads)

    def __repr__(self) -> str:
        return (
            f"ConsumerPlan(consumer={self.consumer!r}, reads={len(self.reads)}, bytes={self.nbytes}, "
            f"pack_items={len(self.pack_items)})"
        )


class GlobalPlan:
    """The plan of every consumer; reads are materialized per consumer on demand.

    Public attributes: ``consumers`` (sorted ids), ``tensors`` (names, indexed by the reads'
    ``tensor``), ``balance``, ``stale_packed`` (packed entries that matched no piece), and
    ``tables`` (the planner's frozen ``PlanTables``). The plan adds only its caches: each
    consumer's materialized reads, the pack items and the planner's stages before packing.
    """

    def __init__(
        self, tables: PlanTables, tensors: tuple, balance: str, stale_packed: int, prepared: object = None
    ) -> None:
        self.tables = tables
        self.consumers = tables.consumers
        self.tensors = tensors
        self.balance = balance
        self.stale_packed = stale_packed
        self._reads_cache: dict[int, np.ndarray] = {}
        self._pack_cache: dict | None = None
        # the planner's stages before packed copies (``planner._Prepared``): kept alive with the
        # plan so the pass with the packed copies it asked for reuses them
        self._prepared = prepared

    def __repr__(self) -> str:
        return (
            f"GlobalPlan(consumers={len(self.consumers)}, tensors={len(self.tensors)}, "
            f"reads={self.total_reads}, bytes={self.total_bytes}, balance={self.balance!r})"
        )

    # -- summary ---------------------------------------------------------------------------
    @property
    def total_reads(self) -> int:
        return int(self.tables.read_counts.sum())

    @property
    def total_bytes(self) -> int:
        return int(self.tables.dst_bytes.sum())

    def read_count(self, consumer: Hashable) -> int:
        t = self.tables
        return int(t.read_counts[t.cindex[consumer]])

    def read_counts(self) -> dict:
        return {c: int(n) for c, n in zip(self.consumers, self.tables.read_counts.tolist())}

    def src_bytes(self) -> dict:
        """Bytes read from each publisher rank (packed copies count on their rank)."""
        t = self.tables
        return {int(r): int(b) for r, b in zip(t.src_ranks.tolist(), t.src_rank_bytes.tolist())}

    def dst_bytes(self) -> dict:
        """Source bytes read by each consumer."""
        return {c: int(b) for c, b in zip(self.consumers, self.tables.dst_bytes.tolist())}

    def src_link_bytes(self) -> np.ndarray:
        """Bytes read over each source link (index = link id: a rank, or a shared (host, NIC))."""
        return self.tables.link_bytes.copy()

    # -- per consumer ----------------------------------------------------------------------
    def reads(self, consumer: Hashable) -> np.ndarray:
        c = self.tables.cindex[consumer]
        r = self._reads_cache.get(c)
        if r is None:
            r = materialize(self.tables, c)
            self._reads_cache[c] = r
        return r

    def consumer(self, consumer: Hashable) -> ConsumerPlan:
        t = self.tables
        c = t.cindex[consumer]
        items = tuple(it for its in self.pack_items().values() for it in its if consumer in it.consumers)
        s, e = t.cstart[c], t.cstart[c + 1]
        pis = t.perm[s:e]
        rk = t.rec_rank[t.pi_src[pis]]
        by = t.pi_bytes[pis]
        ur, inv = np.unique(rk, return_inverse=True)
        sb = np.bincount(inv.reshape(-1), weights=by, minlength=len(ur)) if len(ur) else np.zeros(0)
        src_bytes = {int(a): int(b) for a, b in zip(ur.tolist(), sb.tolist())}
        return ConsumerPlan(
            consumer, self.tensors, self.reads(consumer), items, src_bytes, int(t.dst_bytes[c])
        )

    def pack_items(self) -> dict[int, list[PackItem]]:
        """Per publisher rank, the pieces worth pre-packing (deduplicated; ``consumers`` lists
        who reads each)."""
        if self._pack_cache is None:
            with GCPaused():
                self._pack_cache = build_pack_items(self.tables)
        return self._pack_cache

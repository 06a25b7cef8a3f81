"""Plan caching: ``fingerprint`` hashes planning inputs cheaply (hashes of frozen inputs memoized
by identity) and ``Planner`` keeps recent plans under it, so an unchanged steady-state step
does not re-plan."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from astate_store.model.layout import ShardRecord, TensorLayout
from astate_store.plan._planner.planner import plan_consumer, plan_global
from astate_store.plan._planner.result import ConsumerPlan, GlobalPlan
from astate_store.plan._planner.util import sort_key, sorted_ids
from astate_store.plan.contracts import CostModel, Fabric, PackedInput


class _Memo:
    """Hashes of immutable inputs memoized by identity (the memo holds a reference, so ids stay valid)."""

    def __init__(self, limit: int = 200_000) -> None:
        self._d: dict[int, tuple[Any, int]] = {}
        self._limit = limit

    def hash(self, obj: Any) -> int:
        ent = self._d.get(id(obj))
        if ent is not None and ent[0] is obj:
            return ent[1]
        h = hash(obj) if not isinstance(obj, list) else hash(tuple(obj))
        if isinstance(obj, (tuple, TensorLayout, frozenset)):
            if len(self._d) >= self._limit:
                self._d.clear()
            self._d[id(obj)] = (obj, h)
        return h


_GLOBAL_MEMO = _Memo()


def fingerprint(
    layouts: Mapping[str, TensorLayout],
    requests: Mapping[Hashable, Sequence[ShardRecord]],
    topology: Fabric | None = None,
    packed: PackedInput = None,
    extra: Any = None,
    *,
    _memo: _Memo | None = None,
) -> int:
    """Cheap fingerprint of planning inputs: frozen dataclasses are hashed, with hashes of
    ``TensorLayout`` objects and request tuples memoized by identity (an unchanged steady-state
    step with the same objects costs one dict lookup per tensor and per consumer)."""
    memo = _memo or _GLOBAL_MEMO
    hl = hash(tuple((n, memo.hash(layouts[n])) for n in sorted_ids(layouts)))
    hr = hash(tuple((c, memo.hash(requests[c])) for c in sorted_ids(requests)))
    if packed is None:
        hp = 0
    elif isinstance(packed, Mapping):
        hp = hash(tuple((c, memo.hash(packed[c])) for c in sorted_ids(packed)))
    else:
        hp = memo.hash(packed if isinstance(packed, tuple) else tuple(packed))
    return hash((hl, hr, hash(topology), hp, hash(extra)))


class Planner:
    """Plans with a cache keyed by a fingerprint of (layouts, requests, topology, packed, options).

    ``hits`` / ``misses`` count cache outcomes. Pass ``key`` (for example the catalog version and
    a request epoch) to skip fingerprinting altogether.
    """

    def __init__(self, cost: CostModel = CostModel(), *, cache_size: int = 8) -> None:
        self.cost = cost
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict = OrderedDict()
        self._memo = _Memo()

    def _lookup(self, key: Any, build: Callable[[], Any]) -> Any:
        got = self._cache.get(key)
        if got is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return got
        self.misses += 1
        val = build()
        self._cache[key] = val
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return val

    def plan(
        self,
        layouts: Mapping[str, TensorLayout],
        requests: Mapping[Hashable, Sequence[ShardRecord]],
        *,
        topology: Fabric | None = None,
        packed: PackedInput = None,
        balance: str = "greedy",
        rotations: Mapping[Hashable, int] | None = None,
        staggers: Mapping[Hashable, int] | None = None,
        key: Any = None,
    ) -> GlobalPlan:
        opts = (
            balance,
            None if rotations is None else tuple(sorted(rotations.items(), key=lambda kv: sort_key(kv[0]))),
            None if staggers is None else tuple(sorted(staggers.items(), key=lambda kv: sort_key(kv[0]))),
            self.cost,
        )
        fp = (
            ("global", key, opts)
            if key is not None
            else ("global", fingerprint(layouts, requests, topology, packed, opts, _memo=self._memo))
        )
        return self._lookup(
            fp,
            lambda: plan_global(
                layouts,
                requests,
                topology=topology,
                packed=packed,
                cost=self.cost,
                balance=balance,
                rotations=rotations,
                staggers=staggers,
            ),
        )

    def plan_consumer(
        self,
        layouts: Mapping[str, TensorLayout],
        request: Sequence[ShardRecord],
        *,
        consumer: Hashable = 0,
        rotation: int = 0,
        stagger: int | None = None,
        topology: Fabric | None = None,
        packed: PackedInput = None,
        key: Any = None,
    ) -> ConsumerPlan:
        opts = ("consumer", consumer, rotation, stagger, self.cost)
        fp = (
            ("consumer", key, opts)
            if key is not None
            else (
                "consumer",
                fingerprint(layouts, {consumer: request}, topology, packed, opts, _memo=self._memo),
            )
        )
        return self._lookup(
            fp,
            lambda: plan_consumer(
                layouts,
                request,
                consumer=consumer,
                rotation=rotation,
                stagger=stagger,
                topology=topology,
                packed=packed,
                cost=self.cost,
            ),
        )

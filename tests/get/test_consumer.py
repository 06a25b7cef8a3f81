"""The consuming side (get/consumer.py) through real stores on real etcd, in one process: pulls
deliver exactly one step, reshard, convert, reuse their plan, retry past a torn read (each over
shared memory and over tcp), and fail with a typed error that leaves the buffers as they were."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from astate_store import Shard
from astate_store.errors import LayoutError, PeerUnreachable, WaitTimeout
from astate_store.store import Store
from tests.support.data import value

Factory = Callable[..., Store]
SPEC = {"w": ((16, 12), "float32"), "h": ((9,), "bfloat16")}
OPTIONS: dict[str, Any] = {"retire_timeout": 5.0, "read_timeout": 60.0}


def _tensors(step: int) -> dict[str, torch.Tensor]:
    return {n: value(n, s, dt, step) for n, (s, dt) in SPEC.items()}


def _bufs() -> dict[str, torch.Tensor]:
    return {n: torch.full(s, 7, dtype=getattr(torch, dt)) for n, (s, dt) in SPEC.items()}


def _holds(bufs: dict[str, torch.Tensor], step: int) -> bool:
    return all(torch.equal(bufs[n], value(n, *SPEC[n], step)) for n in SPEC)


def test_a_pull_delivers_the_newest_step_and_reuses_its_plan(transport_store_factory: Factory) -> None:
    pub, cons = transport_store_factory(**OPTIONS), transport_store_factory(**OPTIONS)
    bufs = _bufs()
    for step in (1, 2, 3):
        pub.put(step, _tensors(step))
        assert cons.get_into(bufs, step=step, timeout=30) == step
        assert _holds(bufs, step), step
    st = cons.stats
    assert st.pulls == 3 and st.delivered_step == 3 and st.pull_errors == 0
    assert st.pull_bytes == 3 * (16 * 12 * 4 + 9 * 2)
    # One layout, the same buffers: planned once, the later pulls rebase the ready-made batch.
    assert st.plans <= 1
    assert st.last_pull.step == 3  # type: ignore[union-attr]


def test_a_pull_reshards_rows_into_columns_and_converts_dtypes(transport_store_factory: Factory) -> None:
    whole = value("w", (16, 12), "float32", 5)
    ranks = [transport_store_factory(rank=r, world_size=2, session_id="rs", **OPTIONS) for r in (0, 1)]
    ranks[0].put(5, {"w": Shard(whole[:7], (0, 0), (16, 12))})
    ranks[1].put(5, {"w": Shard(whole[7:], (7, 0), (16, 12))})
    cons = transport_store_factory(**OPTIONS)
    left, right = torch.zeros(16, 5), torch.zeros(16, 7)
    assert (
        cons.get_into({"w": [Shard(left, (0, 0), (16, 12)), Shard(right, (0, 5), (16, 12))]}, timeout=30) == 5
    )
    assert torch.equal(left, whole[:, :5]) and torch.equal(right, whole[:, 5:])
    # A float buffer of another dtype is converted during the pull.
    half = torch.zeros(16, 12, dtype=torch.bfloat16)
    assert cons.get_into({"w": half}, timeout=30) == 5
    assert torch.equal(half, whole.to(torch.bfloat16))


def test_a_read_torn_by_the_publisher_is_discarded_and_retried(transport_store_factory: Factory) -> None:
    pub = transport_store_factory(
        staging_depth=2, retire_timeout=0.0, read_timeout=60.0
    )  # never waits for readers
    cons = transport_store_factory(**OPTIONS)
    pub.put(1, _tensors(1))
    fired: list[int] = []

    def progress(done: int, total: int) -> None:
        # The bytes of step 1 have landed; before the read ends the publisher overwrites its
        # slot (steps 2 and 3 with two slots): the read of step 1 must not be delivered.
        if total and done == total and not fired:
            fired.append(done)
            pub.put(2, _tensors(2))
            pub.put(3, _tensors(3))

    bufs = _bufs()
    got = cons.get_into(bufs, step=1, timeout=30, progress=progress)
    assert fired, "the progress callback never saw the first attempt complete"
    # The retry reads the newest version the consumer has seen: 3, or 2 when the watch has not yet
    # brought 3 (2 sits in the other slot, intact). Never 1, never a mix.
    assert got in (2, 3) and _holds(bufs, got)
    assert cons.stats.torn_retries == 1


def test_bad_buffers_are_refused_before_any_byte_moves(store_factory: Factory) -> None:
    pub, cons = store_factory(**OPTIONS), store_factory(**OPTIONS)
    pub.put(1, _tensors(1))
    bufs = _bufs()
    for bad, why in (
        ({**bufs, "nope": torch.zeros(2)}, "nope"),
        ({"w": torch.zeros(16, 11), "h": bufs["h"]}, "'w'"),
        ({"w": bufs["w"], "h": torch.zeros(9, dtype=torch.int32)}, "'h'"),
    ):
        with pytest.raises(LayoutError, match=why):
            cons.get_into(bad, timeout=30)
    assert all(bool((b == 7).all()) for b in bufs.values())  # untouched
    with pytest.raises(WaitTimeout):
        cons.get_into(bufs, step=2, timeout=0.5)
    assert all(bool((b == 7).all()) for b in bufs.values())
    assert cons.stats.pull_errors == 4


def test_a_version_whose_publisher_left_is_a_typed_error_and_no_byte_moves(store_factory: Factory) -> None:
    pub, cons = store_factory(**OPTIONS), store_factory(**OPTIONS)
    pub.put(1, _tensors(1))
    pub.close()  # its layout went with its lease, and nobody re-serves step 1
    bufs = _bufs()
    # NoLiveSource (a PeerUnreachable) names what no live source holds and who held it
    with pytest.raises(
        PeerUnreachable,
        match=r"ranks \[0\] are gone .* no live publisher, replica or re-serving "
        r"consumer holds .*'w' box",
    ):
        cons.get_into(bufs, step=1, timeout=30)
    assert all(bool((b == 7).all()) for b in bufs.values())  # nothing was written
    assert cons.stats.pull_errors == 1
    # The reader registration of the failed read was dropped: nothing waits for it.
    c = cons.catalog.client
    assert list(c.raw.get_prefix(c.key("readers") + "/", keys_only=True)) == []

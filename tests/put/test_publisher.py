"""The publishing side (put/publisher.py) through real stores on real etcd, in one process: what
a put publishes (a snapshot slot, the tensors in place, or a stream of them), what the publisher
still holds, retiring, and the staging it reports. What a consumer reads is read over shared memory and
over tcp (the ``transport`` fixture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from astate_store.catalog.records import pad20
from astate_store.errors import CheckpointError, VersionNotFound
from astate_store.put.staging import WORDS_BYTES
from astate_store.store import Store
from tests.support.data import value

SPEC = {"emb": ((16, 8), "float32"), "norm": ((8,), "bfloat16"), "count": ((3,), "int64")}


def _tensors(step: int) -> dict[str, torch.Tensor]:
    return {n: value(n, s, dt, step) for n, (s, dt) in SPEC.items()}


Factory = Callable[..., Store]


def _open(store_factory: Factory, **options: Any) -> Store:
    options.setdefault("retire_timeout", 5.0)
    return store_factory(read_timeout=60.0, **options)


def _pull(store: Store, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    bufs = {n: torch.zeros(s, dtype=getattr(torch, dt)) for n, (s, dt) in SPEC.items()}
    got = store.get_into(bufs, step=step, timeout=30)
    return got, bufs


def _retired(store: Store, step: int) -> set[str]:
    c = store.catalog.client
    pre = c.key("retired", pad20(step)) + "/"
    return {m.key.decode()[len(pre) :] for _v, m in c.raw.get_prefix(pre, keys_only=True)}


@pytest.fixture
def cons(transport_store_factory: Factory) -> Store:
    """A consumer over this test's transport (its publisher opens with ``transport_store_factory``)."""
    return _open(transport_store_factory)


def test_a_snapshot_put_publishes_a_copy_the_caller_may_change(
    transport_store_factory: Factory, cons: Store
) -> None:
    with _open(transport_store_factory, staging_depth=2) as pub:
        assert pub.staging.snapshot_slots == 0 and pub.staging.device is None  # nothing before the first put
        tensors = _tensors(1)
        assert pub.put(1, tensors) is True
        for t in tensors.values():
            t.fill_(0)  # allowed at once: the slot holds the snapshot
        step, got = _pull(cons)
        assert step == 1
        for n, t in got.items():
            assert torch.equal(t, value(n, *SPEC[n], 1)), n
        st = pub.staging
        assert (st.snapshot_slots, st.device) == (2, "cpu") and st.snapshot_bytes >= 2 * (
            16 * 8 * 4 + 16 + 24
        )
        stats = pub.stats
        assert (stats.puts, stats.commits, stats.layouts_published) == (1, 1, 1)
        assert stats.put_bytes == 16 * 8 * 4 + 8 * 2 + 3 * 8


def test_steady_puts_reuse_the_layout_and_rotate_the_slots(
    transport_store_factory: Factory, cons: Store
) -> None:
    with _open(transport_store_factory, staging_depth=2) as pub:
        tensors = _tensors(1)
        for step in (1, 2, 3):
            for n, t in tensors.items():
                t.copy_(value(n, *SPEC[n], step))
            pub.put(step, tensors)
        assert pub.stats.layouts_published == 1  # the slots' layout is published once
        # Step 3 went into step 1's slot: step 1 was retired first, step 2 was not.
        assert _retired(pub, 1) == {pad20(0)} and _retired(pub, 2) == set()
        with pytest.raises(VersionNotFound):
            cons.catalog.readers.begin_read(1, "late-reader")
        for step in (2, 3):
            got_step, got = _pull(cons, step)
            assert got_step >= step
            for n, t in got.items():
                assert torch.equal(t, value(n, *SPEC[n], got_step)), (n, got_step)


def test_held_gives_the_slot_contents_until_the_slot_is_reused(store_factory: Factory) -> None:
    with _open(store_factory, staging_depth=2) as pub:
        for step in (1, 2):
            pub.put(step, _tensors(step))
        held = pub._publisher.held(1)
        assert sorted(r.name for r, _t in held) == sorted(SPEC)
        for rec, t in held:
            assert rec.rank == 0 and rec.box.sizes == SPEC[rec.name][0]
            assert torch.equal(t, value(rec.name, *SPEC[rec.name], 1)), rec.name
        pub.put(3, _tensors(3))  # into step 1's slot
        with pytest.raises(CheckpointError, match="rank 0 no longer holds step 1"):
            pub._publisher.held(1)
        assert {
            r.name: bool(torch.equal(t, value(r.name, *SPEC[r.name], 2))) for r, t in pub._publisher.held(2)
        } == {n: True for n in SPEC}
        with pytest.raises(CheckpointError):
            pub._publisher.held(99)


def test_tied_weights_are_staged_once_and_published_under_each_name(
    transport_store_factory: Factory, cons: Store
) -> None:
    with _open(transport_store_factory) as pub:
        w = value("tied", (6, 4), "float32", 2)
        pub.put(2, {"embed.weight": w, "lm_head.weight": w})
        assert sorted(r.name for r, _t in pub._publisher.held(2)) == ["embed.weight", "lm_head.weight"]
        assert pub.stats.put_bytes == 6 * 4 * 4  # one copy of the bytes
        assert sorted(cons.keys(2)) == ["embed.weight", "lm_head.weight"]
        out = torch.zeros(6, 4)
        assert cons.get_into({"lm_head.weight": out}, timeout=30) == 2
        assert torch.equal(out, w)


def test_an_in_place_put_publishes_the_callers_memory_until_retired(
    transport_store_factory: Factory, cons: Store
) -> None:
    with _open(transport_store_factory) as pub:
        tensors = _tensors(5)
        assert pub.put(5, tensors, copy=False) is True
        assert pub.staging.snapshot_slots == 0  # no staging for an in-place put
        assert pub.stats.registrations >= 1
        held = dict((r.name, t) for r, t in pub._publisher.held(5))
        assert {n: t.data_ptr() for n, t in held.items()} == {n: t.data_ptr() for n, t in tensors.items()}
        step, got = _pull(cons)
        assert step == 5 and all(torch.equal(got[n], tensors[n]) for n in SPEC)
        assert pub.retire() == 0
        assert _retired(pub, 5) == {pad20(0)}
        with pytest.raises(CheckpointError):
            pub._publisher.held(5)
        # The next put of other tensors releases the registrations nothing publishes any more.
        other = _tensors(6)
        pub.put(6, other, copy=False)
        regs = pub.stats.registrations
        pub.retire()
        pub.put(7, other, copy=False)
        assert pub.stats.registrations == regs  # steady: the same registrations, no growth
        step, got = _pull(cons, 7)
        assert step == 7 and all(torch.equal(got[n], other[n]) for n in SPEC)


def test_a_snapshot_over_the_cap_is_streamed_from_the_tensors(
    transport_store_factory: Factory, cons: Store
) -> None:
    with _open(transport_store_factory, staging_cap_bytes=256) as pub:
        assert pub.put(1, _tensors(1)) is True
        assert pub.stats.streamed_puts == 1 and pub.staging.snapshot_bytes == 0
        # Streamed puts retire their step before returning: nobody reads the caller's memory after.
        assert _retired(pub, 1) == {pad20(0)}
        assert cons.latest() == 1


def test_the_cap_shrinks_the_pool_to_what_fits(transport_store_factory: Factory, cons: Store) -> None:
    one_slot = 256 * 3 + 512 + WORDS_BYTES  # comfortably one slot of SPEC and its step words, less than two
    with _open(transport_store_factory, staging_depth=3, staging_cap_bytes=one_slot) as pub:
        pub.put(1, _tensors(1))
        assert pub.staging.snapshot_slots == 1 and pub.staging.snapshot_bytes <= one_slot
        assert pub.stats.streamed_puts == 0
        step, got = _pull(cons)
        assert step == 1 and all(torch.equal(got[n], value(n, *SPEC[n], 1)) for n in SPEC)


def test_closing_the_publisher_marks_its_steps_torn_for_its_rank(
    transport_store_factory: Factory, cons: Store
) -> None:
    pub = _open(transport_store_factory)
    pub.put(1, _tensors(1))
    pub.put(2, _tensors(2))
    pub.close()
    c = cons.catalog.client
    for step in (1, 2):
        pre = c.key("torn", pad20(step)) + "/"
        assert [m.key.decode()[len(pre) :] for _v, m in c.raw.get_prefix(pre, keys_only=True)] == [pad20(0)]
    assert cons.keys(2)  # the version stays listed (manifests are leaseless), its source is gone

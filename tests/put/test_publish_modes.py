"""Zero-copy publishing without torn reads, dtype conversion on pull, bounded staging."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch

from astate_store import LayoutError, Shard, TornReadError
from astate_store.store import Store
from tests._procs import CTX
from tests._store_workers import mutating_publisher
from tests.store.test_sync import Group, expected
from tests.support.waiting import wait_until


@pytest.mark.timeout(240)
@pytest.mark.parametrize("retire_timeout", [5.0, 0.0], ids=["publisher-waits", "publisher-never-waits"])
def test_zero_copy_publisher_mutating_never_yields_torn_versions(
    etcd: Any, transport: str, retire_timeout: float
) -> None:
    ns = "zc-" + uuid.uuid4().hex[:10]
    numel, ntensors, steps = 1 << 18, 6, 300
    out = CTX.Queue()
    p = CTX.Process(
        target=mutating_publisher,
        daemon=True,
        args=(etcd.endpoint, ns, transport, steps, numel, ntensors, retire_timeout, out),
    )
    p.start()
    try:
        assert out.get(timeout=120)[0] == "ready"
        bufs = {f"t{i}": torch.empty(numel) for i in range(ntensors)}
        seen: list[int] = []
        refused = 0
        with Store(ns, endpoint=etcd.endpoint, transport=transport) as store:
            while (not seen or seen[-1] < steps) and refused < 50:
                try:
                    got = store.get_into(bufs, step=(seen[-1] + 1) if seen else None, timeout=60)
                except TornReadError:
                    refused += 1  # a typed refusal is allowed; a torn success is not
                    continue
                for name, b in bufs.items():
                    # Every byte of every buffer belongs to the step get_into reported.
                    assert bool((b == float(got)).all()), f"torn: {name} mixes steps, reported {got}"
                seen.append(got)
            discarded = store.stats.torn_retries
        assert seen and seen == sorted(seen)
        if retire_timeout == 0.0:
            # Reads overlapped mutations: they were detected and discarded, never returned.
            assert discarded + refused > 0
        else:
            assert len(set(seen)) > 5
        print(f"{len(seen)} verified pulls, {discarded} reads discarded, {refused} refusals")
    finally:
        p.kill()
        p.join(10)


@pytest.fixture(scope="module")
def mixed_group(etcd: Any) -> Any:
    g = Group(etcd.endpoint, "conv-" + uuid.uuid4().hex[:10], 2, 2, "shm")
    g.put(3)
    yield g
    g.close()


def test_float_conversion_on_pull(etcd: Any, mixed_group: Any) -> None:
    with Store(mixed_group.ns, endpoint=etcd.endpoint, transport="shm") as store:
        emb = torch.zeros(64, 48, dtype=torch.bfloat16)  # fp32 -> bf16
        qkv = Shard(torch.zeros(96, 24, dtype=torch.float32), (0, 24), (96, 48))  # bf16 -> fp32, other split
        experts = torch.zeros(8, 24, 16, dtype=torch.float32)  # fp16 -> fp32
        odd = torch.zeros(37, 29, dtype=torch.float16)  # fp32 -> fp16, uneven source
        ptr = emb.data_ptr()
        assert store.get_into({"emb": emb, "qkv": qkv, "experts": experts, "odd": odd}, timeout=30) == 3
        assert emb.data_ptr() == ptr
        assert torch.equal(emb, expected("emb", 3).to(torch.bfloat16))
        assert torch.equal(qkv.tensor, expected("qkv", 3)[:, 24:].to(torch.float32))
        assert torch.equal(experts, expected("experts", 3).to(torch.float32))
        assert torch.equal(odd, expected("odd", 3).to(torch.float16))


def test_publishers_convert_for_consumers_after_one_step(etcd: Any) -> None:
    g = Group(etcd.endpoint, "pconv-" + uuid.uuid4().hex[:10], 2, 2, "shm")
    try:
        with Store(g.ns, endpoint=etcd.endpoint, transport="shm") as store:
            emb = torch.zeros(64, 48, dtype=torch.bfloat16)  # fp32 -> bf16
            qkv = Shard(torch.zeros(96, 24, dtype=torch.float32), (0, 24), (96, 48))  # bf16 -> fp32
            local = []
            for step in range(1, 9):
                g.put(step)
                assert store.get_into({"emb": emb, "qkv": qkv}, step=step, timeout=30) == step
                assert torch.equal(emb, expected("emb", step).to(torch.bfloat16))
                assert torch.equal(qkv.tensor, expected("qkv", step)[:, 24:].to(torch.float32))
                local.append(store.stats.last_pull.local_conversions)
                if step >= 3 and local[-1] == 0:
                    break
        # Step 1 converts here; it asks the publishers, who learn of it by a watch and fold the
        # request in at a later put: from then on their puts carry converted copies.
        assert local[0] == 2 and local[-1] == 0
    finally:
        g.close()


def test_conversion_through_a_cap_far_smaller_than_the_model(etcd: Any, mixed_group: Any) -> None:
    # 64x48 fp32 source = 12 KiB through 1 KiB of staging (5 rows at a time).
    with Store(mixed_group.ns, endpoint=etcd.endpoint, transport="shm", staging_cap_bytes=1024) as store:
        emb = torch.zeros(64, 48, dtype=torch.bfloat16)
        col = Shard(torch.zeros(64, 20, dtype=torch.float16), (0, 28), (64, 48))
        assert store.get_into({"emb": emb}, timeout=30) == 3
        assert torch.equal(emb, expected("emb", 3).to(torch.bfloat16))
        store.get_into({"emb": col}, timeout=30)
        assert torch.equal(col.tensor, expected("emb", 3)[:, 28:].to(torch.float16))
        assert 0 < store.staging.conversion_bytes <= 1024


def test_conversions_that_lose_meaning_are_rejected(etcd: Any, mixed_group: Any) -> None:
    with Store(mixed_group.ns, endpoint=etcd.endpoint, transport="shm") as store:
        keep = torch.full((64, 48), 5.0)
        with pytest.raises(LayoutError, match=r"'step_count'.*not a float conversion"):
            store.get_into({"emb": keep, "step_count": torch.zeros((), dtype=torch.float32)}, timeout=30)
        with pytest.raises(LayoutError, match=r"'emb'.*int16"):
            store.get_into({"emb": torch.zeros(64, 48, dtype=torch.int16)}, timeout=30)
        assert torch.equal(keep, torch.full((64, 48), 5.0))


def test_snapshot_staging_cap(etcd: Any) -> None:
    ns = "cap-" + uuid.uuid4().hex[:10]
    tensors = {"w": torch.arange(4096, dtype=torch.float32)}  # 16 KiB
    # Room for one slot only: every put retires the previous version first, and still syncs.
    with (
        Store(ns, endpoint=etcd.endpoint, transport="shm", staging_cap_bytes=20000) as one,
        Store(ns, endpoint=etcd.endpoint, transport="shm") as cons,
    ):
        buf = torch.zeros(4096)
        for step in (1, 2, 3):
            tensors["w"].add_(1)
            one.put(step, tensors)
            assert cons.get_into({"w": buf}, step=step, timeout=30) == step
            assert torch.equal(buf, tensors["w"])
        assert one.staging.snapshot_slots == 1 and 0 < one.staging.snapshot_bytes <= 20000


def test_snapshot_larger_than_the_cap_streams_to_consumers(etcd: Any) -> None:
    ns = "stream-" + uuid.uuid4().hex[:10]
    w = torch.zeros(1 << 16)  # 256 KiB through a 16 KiB cap
    got: list[tuple[int, bool]] = []
    with (
        Store(ns, endpoint=etcd.endpoint, transport="shm", staging_cap_bytes=16384) as pub,
        Store(ns, endpoint=etcd.endpoint, transport="shm") as cons,
    ):
        buf = torch.empty(1 << 16)

        def pull() -> None:
            for step in (1, 2, 3):
                s = cons.get_into({"w": buf}, step=step, timeout=60)
                got.append((s, bool((buf == float(s)).all())))

        t = threading.Thread(target=pull)
        t.start()
        wait_until(  # the consumer registered in etcd
            lambda: cons.consumer_id in pub.catalog.consumers.ids(),
            60,
            interval=0.01,
            message="the consumer never registered",
        )
        for step in (1, 2, 3):
            w.fill_(float(step))
            pub.put(step, {"w": w})  # returns once the consumer has pulled: w may change right away
        t.join(60)
        assert got == [(1, True), (2, True), (3, True)]
        assert pub.stats.streamed_puts == 3  # every put streamed: the snapshot did not fit the cap
        assert pub.staging.snapshot_bytes <= 16384  # no staging beyond the cap


def test_mixing_snapshot_and_zero_copy_puts(etcd: Any) -> None:
    ns = "mix-" + uuid.uuid4().hex[:10]
    live = torch.zeros(4096)
    with (
        Store(ns, endpoint=etcd.endpoint, transport="shm") as pub,
        Store(ns, endpoint=etcd.endpoint, transport="shm") as cons,
    ):
        buf = torch.empty(4096)
        for step, copy in enumerate([False, True, False, True, False], start=1):
            pub.retire()
            live.fill_(float(step))
            pub.put(step, {"w": live}, copy=copy)
            assert cons.get_into({"w": buf}, step=step, timeout=30) == step
            assert bool((buf == float(step)).all()), f"step {step} (copy={copy}) delivered other bytes"


# ---- least exposure and registration hygiene ---------------------------------------------------


def _data_regions(store: Store) -> list[Any]:
    from astate_store.transport import PeerDescriptor

    return [r for r in PeerDescriptor.from_dict(store.transport.descriptor()).regions if r.size]


def test_in_place_registers_only_the_published_spans(etcd: Any) -> None:
    from astate_store.put.registry import PAGE

    ns = "span-" + uuid.uuid4().hex[:10]
    big = torch.arange(1 << 20, dtype=torch.float32)  # one 4 MiB storage
    views = {
        "head": big[:1000],
        "tail": big[-1000:],  # far apart: a small registration each
        "mid": big[300_000:301_000],
        "mid2": big[300_500:302_000],
    }  # overlapping: one registration
    with (
        Store(ns, endpoint=etcd.endpoint, transport="shm") as pub,
        Store(ns, endpoint=etcd.endpoint, transport="shm") as cons,
    ):
        pub.put(1, views, copy=False)
        assert pub.stats.registrations == 3
        regions = _data_regions(pub)
        assert len(regions) == 3 and sum(r.size for r in regions) <= 6 * PAGE  # not the 4 MiB storage
        lo, hi = big.data_ptr(), big.data_ptr() + big.nbytes
        assert all(lo <= r.base and r.base + r.size <= hi for r in regions)  # never beyond the storage
        bufs = {k: torch.zeros(v.shape) for k, v in views.items()}
        assert cons.get_into(bufs, timeout=30) == 1
        for k, v in views.items():
            assert torch.equal(bufs[k], v), k


def test_registrations_released_when_no_version_publishes_them(etcd: Any) -> None:
    ns = "reg-" + uuid.uuid4().hex[:10]
    a, b = torch.full((4096,), 1.0), torch.full((8192,), 2.0)
    with (
        Store(ns, endpoint=etcd.endpoint, transport="shm") as pub,
        Store(ns, endpoint=etcd.endpoint, transport="shm") as cons,
    ):
        buf_a, buf_b = torch.empty(4096), torch.empty(8192)
        pub.put(1, {"a": a}, copy=False)
        assert cons.get_into({"a": buf_a}, step=1, timeout=30) == 1 and torch.equal(buf_a, a)
        assert pub.stats.registrations == 1
        live, layouts = pub.transport.num_regions, pub.stats.layouts_published
        for step in (2, 3):  # steady state: the same tensors register nothing new, the layout stays
            pub.retire()
            a.fill_(float(step))
            pub.put(step, {"a": a}, copy=False)
            assert cons.get_into({"a": buf_a}, step=step, timeout=30) == step and torch.equal(buf_a, a)
        assert pub.stats.registrations == 1 and pub.transport.num_regions == live
        assert pub.stats.layouts_published == layouts
        # "a" is no longer published: retired, then the next put releases its registration.
        pub.retire()
        pub.put(4, {"b": b}, copy=False)
        assert pub.stats.registrations == 1 and pub.transport.num_regions == live
        spans = [(r.base, r.base + r.size) for r in _data_regions(pub)]
        assert not any(lo <= a.data_ptr() < hi for lo, hi in spans)  # a's memory is not readable any more
        assert cons.get_into({"b": buf_b}, step=4, timeout=30) == 4 and torch.equal(buf_b, b)
        # A snapshot put publishes nothing in place: b goes at the retire after the next one.
        pub.retire()
        pub.put(5, {"b": b}, copy=True)
        assert cons.get_into({"b": buf_b}, step=5, timeout=30) == 5
        before = pub.transport.num_regions
        pub.retire()
        assert pub.stats.registrations == 0 and pub.transport.num_regions == before - 1


def test_unserve_releases_the_served_buffers(etcd: Any) -> None:
    ns = "unserve-" + uuid.uuid4().hex[:10]
    w = torch.arange(4096, dtype=torch.float32)
    with (
        Store(ns, endpoint=etcd.endpoint, transport="shm") as pub,
        Store(ns, endpoint=etcd.endpoint, transport="shm") as relay,
    ):
        pub.put(1, {"w": w})
        buf = torch.empty(4096)
        assert relay.get_into({"w": buf}, timeout=30) == 1
        before = relay.transport.num_regions
        relay.serve(1, {"w": buf})
        assert relay.stats.registrations == 1 and relay.transport.num_regions == before + 1
        relay.unserve()
        assert relay.stats.registrations == 0 and relay.transport.num_regions == before
        relay.serve(1, {"w": buf})  # offering again registers again
        assert relay.stats.registrations == 1
        pub.put(2, {"w": w + 1})
        assert relay.get_into({"w": buf}, step=2, timeout=30) == 2  # withdraws (and releases) first
        assert relay.stats.registrations == 0 and torch.equal(buf, w + 1)


def test_consumer_disconnects_publishers_that_left(etcd: Any) -> None:
    ns = "left-" + uuid.uuid4().hex[:10]
    w = torch.arange(1024, dtype=torch.float32)
    buf = torch.empty(1024)
    with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
        with Store(ns, endpoint=etcd.endpoint, transport="shm", session_id="first") as pub1:
            pub1.put(1, {"w": w})
            assert cons.get_into({"w": buf}, step=1, timeout=30) == 1
        old = cons.transport.peers
        assert len(old) == 1 and cons.transport._same_host.pidfds == 1
        with Store(ns, endpoint=etcd.endpoint, transport="shm", session_id="second") as pub2:
            for step in range(2, 8):
                pub2.put(step, {"w": w + step})
                assert cons.get_into({"w": buf}, step=step, timeout=30) == step
                assert torch.equal(buf, w + step)
            peers = cons.transport.peers
        assert len(peers) == 1 and old[0] not in peers  # the departed publisher's endpoint is closed
        assert cons.transport._same_host.pidfds == 1

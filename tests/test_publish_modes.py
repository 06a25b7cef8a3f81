"""Zero-copy publishing without torn reads, dtype conversion on pull, bounded staging."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from typing import Any

import pytest
import torch

from astate_store import LayoutError, Shard, TornReadError
from astate_store.store import Store

from ._store_workers import mutating_publisher
from .test_sync import Group, expected

CTX = mp.get_context("spawn")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("retire_timeout", [5.0, 0.0], ids=["publisher-waits", "publisher-never-waits"])
def test_zero_copy_publisher_mutating_never_yields_torn_versions(etcd: Any, transport: str,
                                                                 retire_timeout: float) -> None:
    ns = "zc-" + uuid.uuid4().hex[:10]
    numel, ntensors, steps = 1 << 18, 6, 300
    out = CTX.Queue()
    p = CTX.Process(target=mutating_publisher, daemon=True,
                    args=(etcd.endpoint, ns, transport, steps, numel, ntensors, retire_timeout, out))
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
            discarded = store.stats["torn_retries"]
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
        emb = torch.zeros(64, 48, dtype=torch.bfloat16)                          # fp32 -> bf16
        qkv = Shard(torch.zeros(96, 24, dtype=torch.float32), (0, 24), (96, 48))  # bf16 -> fp32, other split
        experts = torch.zeros(8, 24, 16, dtype=torch.float32)                     # fp16 -> fp32
        odd = torch.zeros(37, 29, dtype=torch.float16)                            # fp32 -> fp16, uneven source
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
            emb = torch.zeros(64, 48, dtype=torch.bfloat16)                           # fp32 -> bf16
            qkv = Shard(torch.zeros(96, 24, dtype=torch.float32), (0, 24), (96, 48))  # bf16 -> fp32
            local = []
            for step in (1, 2, 3):
                g.put(step)
                assert store.get_into({"emb": emb, "qkv": qkv}, step=step, timeout=30) == step
                assert torch.equal(emb, expected("emb", step).to(torch.bfloat16))
                assert torch.equal(qkv.tensor, expected("qkv", step)[:, 24:].to(torch.float32))
                local.append(store.stats["local_conversions"])
        # Step 1 converts here; it asks the publishers, whose next puts carry converted copies.
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
    with Store(ns, endpoint=etcd.endpoint, transport="shm", staging_cap_bytes=20000) as one, \
            Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
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
    with Store(ns, endpoint=etcd.endpoint, transport="shm", staging_cap_bytes=16384) as pub, \
            Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
        buf = torch.empty(1 << 16)

        def pull() -> None:
            for step in (1, 2, 3):
                s = cons.get_into({"w": buf}, step=step, timeout=60)
                got.append((s, bool((buf == float(s)).all())))

        t = threading.Thread(target=pull)
        t.start()
        deadline = time.monotonic() + 60
        while cons.consumer_id not in pub.catalog.consumers.ids():  # the consumer registered in etcd
            assert time.monotonic() < deadline, "the consumer never registered"
            time.sleep(0.01)
        for step in (1, 2, 3):
            w.fill_(float(step))
            pub.put(step, {"w": w})  # returns once the consumer has pulled: w may change right away
        t.join(60)
        assert got == [(1, True), (2, True), (3, True)]
        assert pub.stats["streamed_puts"] == 3  # every put streamed: the snapshot did not fit the cap
        assert pub.staging.snapshot_bytes <= 16384  # no staging beyond the cap


def test_mixing_snapshot_and_zero_copy_puts(etcd: Any) -> None:
    ns = "mix-" + uuid.uuid4().hex[:10]
    live = torch.zeros(4096)
    with Store(ns, endpoint=etcd.endpoint, transport="shm") as pub, \
            Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
        buf = torch.empty(4096)
        for step, copy in enumerate([False, True, False, True, False], start=1):
            pub.retire()
            live.fill_(float(step))
            pub.put(step, {"w": live}, copy=copy)
            assert cons.get_into({"w": buf}, step=step, timeout=30) == step
            assert bool((buf == float(step)).all()), f"step {step} (copy={copy}) delivered other bytes"

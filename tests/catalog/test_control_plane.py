"""The control plane at scale, between processes over real etcd: 10^5 tensors, versions that stay
self-describing after their publishers left, and pre-packed copies shared by consumers."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from astate_store import Shard
from astate_store.store import Store
from tests._procs import CTX
from tests._scale_workers import scale_publisher, tiny_model
from tests.store.test_sync import Group, assert_exact, whole_buffers

pytestmark = pytest.mark.timeout(300)


def _ns(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_a_100k_tensor_model_is_put_and_pulled(etcd: Any) -> None:
    ns, total, ranks = _ns("big"), 100_000, 2
    cmds, out = [CTX.Queue() for _ in range(ranks)], CTX.Queue()
    procs = [
        CTX.Process(
            target=scale_publisher, args=(etcd.endpoint, ns, r, ranks, total, cmds[r], out), daemon=True
        )
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    try:
        assert sorted(out.get(timeout=120) for _ in procs) == [("ready", 0), ("ready", 1)]
        bufs = {n: torch.zeros(2) for r in range(ranks) for n in tiny_model(total, ranks, r, 0)}
        with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
            for step in (1, 2, 3):
                for q in cmds:
                    q.put(("put", step))
                assert sorted(out.get(timeout=120)[:2] for _ in procs) == [("put", 0), ("put", 1)]
                assert cons.get_into(bufs, step=step, timeout=120) == step
                got = torch.stack(
                    [
                        bufs[n]
                        for n in sorted(
                            bufs, key=lambda n: int(n.split(".")[2]) * 1000 + int(n.split(".")[5])
                        )
                    ]
                )
                want = torch.stack(
                    [torch.arange(total, dtype=torch.float32), torch.full((total,), float(step))], 1
                )
                assert torch.equal(got, want), f"step {step}: a tensor holds other bytes"
            assert cons.stats.plans >= 1 and cons.stats.plan_hits >= 2  # steps 2, 3: no replanning
    finally:
        for q in cmds:
            q.put(("exit",))
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_a_checkpoint_is_written_after_one_of_the_ranks_exited(etcd: Any, tmp_path: Any) -> None:
    """Three publishers put, checkpoint and exit one after the other: the version's manifests (no
    lease) say who holds what, so the later ranks' checkpoints do not depend on who is alive."""
    ns, uri = _ns("ckx"), str(tmp_path / "ckpt")
    g = Group(etcd.endpoint, ns, 3, 3, "shm")
    try:
        g.put(1)
        for rank in (2, 1, 0):  # each checkpoints, then leaves before the next one checkpoints
            g.cmds[rank].put(("checkpoint", 1, uri))
            msg = g.out.get(timeout=60)
            assert msg[:2] == ("checkpoint", rank), msg
            assert msg[2] is (rank == 0)  # the last one completes the set
            g.cmds[rank].put(("exit",))
            assert g.out.get(timeout=60) == ("bye", rank)
        with Store(ns, endpoint=etcd.endpoint, transport="shm") as reader:
            bufs = whole_buffers()
            assert reader.restore(bufs, uri=uri) == 1
            assert_exact(bufs, 1)
    finally:
        g.close()


def test_one_prepacked_copy_serves_every_consumer_and_a_joining_consumer_relays_nothing(etcd: Any) -> None:
    ns = _ns("pack")
    w = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256)
    with (
        Store(ns, endpoint=etcd.endpoint, transport="shm") as pub,
        Store(ns, endpoint=etcd.endpoint, transport="shm") as a,
        Store(ns, endpoint=etcd.endpoint, transport="shm") as b,
    ):

        def cols() -> Shard:  # a column slice of a row-major matrix: one short run per row unless packed
            return Shard(torch.zeros(256, 8), (0, 64), (256, 256))

        ca = cols()
        step = 0
        while step < 3 or (
            a.stats.last_pull.reads != 1 and step < 8
        ):  # the request is folded in at a later put
            step += 1
            pub.put(step, {"w": w + step})
            assert a.get_into({"w": ca}, step=step, timeout=30) == step
            assert torch.equal(ca.tensor, (w + step)[:, 64:72])
        assert a.stats.last_pull.reads == 1  # a read the publisher's contiguous copy in one run
        layouts = pub.stats.layouts_published
        cb = cols()
        for s in (step + 1, step + 2):
            pub.put(s, {"w": w + s})
            assert b.get_into({"w": cb}, step=s, timeout=30) == s
            assert torch.equal(cb.tensor, (w + s)[:, 64:72])
        assert b.stats.last_pull.reads == 1  # the copy built for a serves b too
        assert pub.stats.layouts_published == layouts  # b joining re-laid nothing out

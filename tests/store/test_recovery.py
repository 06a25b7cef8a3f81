"""Multi-session recovery: consumers as sources, trainer restart, SIGKILL at bad moments."""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any

import pytest
import torch

from astate_store import PeerUnreachable
from astate_store.store import Store
from tests._procs import CTX
from tests._store_workers import SPECS, consumer_main, looping_consumer, value
from tests.store.test_sync import Group, assert_exact, whole_buffers

pytestmark = pytest.mark.timeout(240)


def _ns() -> str:
    return "rec-" + uuid.uuid4().hex[:10]


def _consumer(
    etcd: Any, ns: str, *, step: int | None = None, serve: bool = False, hold: float = 0.0
) -> tuple[Any, Any]:
    out = CTX.Queue()
    p = CTX.Process(
        target=consumer_main, args=(etcd.endpoint, ns, "shm", step, serve, out, hold), daemon=True
    )
    p.start()
    return p, out


def _recover(g: Group, uri: str | None) -> list[tuple[Any, ...]]:
    for q in g.cmds:
        q.put(("recover", uri))
    return sorted((g.out.get(timeout=120) for _ in range(g.world)), key=lambda m: m[1])


def test_consumer_reserves_when_trainers_are_gone_and_trainer_restarts_from_it(etcd: Any) -> None:
    ns = _ns()
    g = Group(etcd.endpoint, ns, 2, 2, "shm")
    g.put(1)
    server, sout = _consumer(etcd, ns, serve=True, hold=120)
    try:
        msg = sout.get(timeout=60)
        assert msg[:3] == ("got", 1, True)
        g.kill(0)
        g.kill(1)
        # A late-joining rollout pulls the version from the re-serving consumer.
        late, lout = _consumer(etcd, ns)
        assert lout.get(timeout=60)[:3] == ("got", 1, True)
        late.join(30)
        # A restarted trainer session fences the dead one, recovers step 1 from the consumer,
        # republishes it, and carries on with step 2.
        g2 = Group(etcd.endpoint, ns, 2, 2, "shm")
        try:
            rec = _recover(g2, None)
            assert [m[0] for m in rec] == ["recovered", "recovered"] and all(
                m[2] == 1 and m[3] for m in rec
            ), rec
            g2.put(2)
            with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
                bufs = whole_buffers()
                assert cons.get_into(bufs, step=2, timeout=30) == 2
                assert_exact(bufs, 2)
                assert cons.catalog.versions.read_version(2).epoch > 1
        finally:
            g2.close()
    finally:
        server.kill()
        g.close()


def test_trainer_killed_during_put_restarts_from_checkpoint(etcd: Any, tmp_path: Any) -> None:
    ns, uri = _ns(), str(tmp_path / "ckpt")
    g = Group(etcd.endpoint, ns, 2, 2, "shm")
    g.put(1)
    for q in g.cmds:
        q.put(("checkpoint", 1, uri))
    done = [g.out.get(timeout=60) for _ in range(2)]
    assert all(m[0] == "checkpoint" for m in done) and any(m[2] for m in done), done
    # Step 2: rank 0 puts; rank 1 is killed in the middle of its put (snapshot copied, layout
    # published, piece not yet written): step 2 never commits.
    g.cmds[0].put(("put", 2))
    assert g.out.get(timeout=60)[0] == "put"
    g.cmds[1].put(("die_in_put", 2))
    assert g.out.get(timeout=60) == ("dying", 1, 2)
    g.procs[1].join(30)
    assert g.procs[1].exitcode == -9  # SIGKILL inside put
    g.kill(0)
    with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
        assert cons.latest() == 1
        assert [c.step for c in cons.catalog.checkpoints.list()] == [1]
    g2 = Group(etcd.endpoint, ns, 2, 2, "shm")
    try:
        rec = _recover(g2, None)  # no live source of step 1: the catalog's checkpoint serves
        assert all(m[0] == "recovered" and m[2] == 1 and m[3] for m in rec), rec
        with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
            bufs = whole_buffers()
            assert cons.get_into(bufs, timeout=30) == 1
            assert_exact(bufs, 1)
    finally:
        g2.close()
        g.close()


def test_no_source_and_no_checkpoint_is_a_typed_error(etcd: Any) -> None:
    ns = _ns()
    g = Group(etcd.endpoint, ns, 2, 2, "shm")
    g.put(1)
    g.kill(0)
    g.kill(1)
    try:
        with Store(ns, endpoint=etcd.endpoint, transport="shm", read_timeout=5) as cons:
            with pytest.raises(PeerUnreachable):
                cons.get_into(whole_buffers(), timeout=10)
        g2 = Group(etcd.endpoint, ns, 2, 2, "shm")
        try:
            rec = _recover(g2, None)
            assert all(m[0] == "error" and "PeerUnreachable" in m[3] for m in rec), rec
        finally:
            g2.close()
    finally:
        g.close()


def test_consumer_killed_during_pull_does_not_block_publisher(etcd: Any) -> None:
    ns = _ns()
    g = Group(etcd.endpoint, ns, 2, 2, "shm", spec="big")
    try:
        g.put(1)
        out = CTX.Queue()
        victim = CTX.Process(target=looping_consumer, args=(etcd.endpoint, ns, out), daemon=True)
        victim.start()
        for _ in range(3):
            assert out.get(timeout=60) == "pulling"
        os.kill(victim.pid, signal.SIGKILL)  # in the middle of (or right before) a pull
        victim.join(10)
        # Steps 2 and 3 reuse both staging slots: retiring step 1 waits at most for the dead
        # reader's lease (2 s), never forever.
        g.put(2)
        g.put(3)
        shape, dt, _ = SPECS["big"]["w"]
        buf = torch.empty(shape, dtype=dt)
        with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
            assert cons.get_into({"w": buf}, timeout=30) == 3
        assert torch.equal(buf, value("w", shape, dt, 3))
    finally:
        g.close()


def test_rollout_rejoins_and_pulls_newest(etcd: Any) -> None:
    ns = _ns()
    g = Group(etcd.endpoint, ns, 2, 2, "shm")
    try:
        g.put(1)
        first, fout = _consumer(etcd, ns, hold=60)
        assert fout.get(timeout=60)[:3] == ("got", 1, True)
        first.kill()  # SIGKILL while it holds the model
        first.join(10)
        g.put(2)
        g.put(3)
        again, aout = _consumer(etcd, ns)
        assert aout.get(timeout=60)[:3] == ("got", 3, True)
        again.join(30)
        bufs = whole_buffers()
        ptrs = {n: t.data_ptr() for n, t in bufs.items()}
        with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
            assert cons.get_into(bufs, timeout=30) == 3
        assert_exact(bufs, 3)
        assert {n: t.data_ptr() for n, t in bufs.items()} == ptrs  # filled in place
    finally:
        g.close()


def test_asynchronous_checkpoint_through_the_store(etcd: Any, tmp_path: Any) -> None:
    ns, uri = _ns(), str(tmp_path / "async")
    w = torch.arange(1 << 16, dtype=torch.float32)
    with Store(ns, endpoint=etcd.endpoint, transport="shm") as pub:
        pub.put(1, {"w": w})
        fut = pub.checkpoint(1, uri, asynchronous=True)
        w.add_(1)  # training goes on while the checkpoint is written: the snapshot is what counts
        pub.put(2, {"w": w})
        assert fut.result(timeout=60) is True
        assert [c.step for c in pub.catalog.checkpoints.list()] == [1]
        back = torch.zeros(1 << 16)
        assert pub.restore({"w": back}) == 1
        assert torch.equal(back, torch.arange(1 << 16, dtype=torch.float32))

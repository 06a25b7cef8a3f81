"""The etcd catalog against a real etcd server; concurrency through real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

import pytest

from astate_store.catalog import Catalog
from astate_store.errors import CatalogError, CatalogUnavailable, StaleSessionError, VersionNotFound, WaitTimeout
from astate_store.etcd_server import EmbeddedEtcd

from ._catalog_workers import commit_racer, hold_session, publish, row_shard

CTX = mp.get_context("spawn")


def _publisher(cat: Catalog, rank: int, world: int, session_id: str | None = None) -> str:
    cat.open_session(rank=rank, world_size=world, session_id=session_id)
    return cat.write_layout([row_shard(rank, world)], b"desc%d" % rank)


def test_commit_only_when_all_ranks_wrote(catalog_factory) -> None:
    world = 3
    cats = [catalog_factory() for _ in range(world)]
    lids = [_publisher(c, r, world, "s1") for r, c in enumerate(cats)]
    reader = catalog_factory()
    assert cats[0].put_piece(7, lids[0]) is False
    assert cats[2].put_piece(7, lids[2]) is False
    assert reader.latest() is None
    with pytest.raises(VersionNotFound):
        reader.read_version(7)
    assert cats[1].put_piece(7, lids[1]) is True
    assert reader.latest() == 7
    v = reader.layouts_of(reader.read_version(7))
    assert sorted(v.pieces) == [0, 1, 2]
    assert {r: lay.transport for r, lay in v.layouts.items()} == {r: b"desc%d" % r for r in range(world)}
    assert v.layouts[1].shards[0].box == row_shard(1, world).box


def test_commit_from_separate_processes(etcd, namespace) -> None:
    world, steps = 3, [1, 2, 3]
    barrier, results = CTX.Barrier(world), CTX.Queue()
    procs = [CTX.Process(target=publish, args=(etcd.endpoint, namespace, r, world, steps, "sid", barrier, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    # Exactly the last writer of each step sees its own transaction commit or a later one;
    # in every step at least one rank reports the commit.
    assert all(any(got[r][i] for r in range(world)) for i in range(len(steps)))
    cat = Catalog(etcd.endpoint, namespace)
    assert cat.latest() == 3
    assert cat.committed_steps() == [1, 2, 3]
    cat.close()


def test_racing_commits_latest_never_backwards(etcd, namespace) -> None:
    world = 2
    steps = list(range(10))
    barrier, results = CTX.Barrier(world), CTX.Queue()
    procs = [CTX.Process(target=commit_racer, args=(etcd.endpoint, namespace, steps, "race", r, world, barrier,
                                                    results)) for r in range(world)]
    watcher = Catalog(etcd.endpoint, namespace, retention=100)
    seen: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            v = watcher.latest()
            if v is not None:
                seen.append(v)

    for p in procs:
        p.start()
    t = threading.Thread(target=poll)
    t.start()
    per_rank = [results.get(timeout=60) for _ in procs]
    stop.set()
    t.join()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for series in per_rank + [seen]:
        nums = [x for x in series if x is not None]
        assert nums == sorted(nums), series
    assert watcher.latest() == 9
    watcher.close()


def test_latest_does_not_move_back_for_an_older_step(catalog_factory) -> None:
    cat = catalog_factory()
    lid = _publisher(cat, 0, 1)
    assert cat.put_piece(10, lid)
    assert cat.put_piece(4, lid) is False
    assert cat.latest() == 10


def test_watch_wakes_waiter(catalog_factory) -> None:
    pub, cons = catalog_factory(), catalog_factory()
    lid = _publisher(pub, 0, 1)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(cons.wait_for(3, timeout=30)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    pub.put_piece(2, lid)
    time.sleep(0.2)
    assert t.is_alive() and not out  # 2 < 3: still waiting
    pub.put_piece(3, lid)
    t.join(10)
    assert out == [3]


def test_wait_timeout(catalog_factory) -> None:
    cons = catalog_factory()
    with pytest.raises(WaitTimeout, match="not committed within"):
        cons.wait_for(1, timeout=0.5)


def test_stale_session_is_fenced(catalog_factory) -> None:
    old, new = catalog_factory(), catalog_factory()
    lid_old = _publisher(old, 0, 1)
    assert old.put_piece(1, lid_old)
    lid_new = _publisher(new, 0, 1)
    with pytest.raises(StaleSessionError, match="fenced by a newer session"):
        old.put_piece(2, lid_old)
    with pytest.raises(StaleSessionError):
        old.write_layout([row_shard(0, 2)], b"zombie")
    assert new.put_piece(2, lid_new)
    assert new.latest() == 2


def test_zombie_rank_cannot_commit_into_new_session(catalog_factory) -> None:
    # Old session of two ranks; a new session starts; the old rank 1 writes its piece.
    o0, o1 = catalog_factory(), catalog_factory()
    l0, l1 = _publisher(o0, 0, 2, "old"), _publisher(o1, 1, 2, "old")
    n0, n1 = catalog_factory(), catalog_factory()
    m0, m1 = _publisher(n0, 0, 2, "new"), _publisher(n1, 1, 2, "new")
    assert n0.put_piece(5, m0) is False
    with pytest.raises(StaleSessionError):
        o1.put_piece(5, l1)
    assert n0.latest() is None
    assert n1.put_piece(5, m1) is True
    del l0


def test_lease_expiry_marks_session_dead(etcd, namespace, catalog_factory) -> None:
    ready = CTX.Queue()
    p = CTX.Process(target=hold_session, args=(etcd.endpoint, namespace, 2.0, ready))
    p.start()
    pid = ready.get(timeout=60)
    cons = catalog_factory()
    epoch = cons.session_record()["epoch"]
    assert cons.live_ranks(epoch) == {0}
    os.kill(pid, signal.SIGKILL)
    p.join(10)
    deadline = time.monotonic() + 15
    while cons.live_ranks(epoch) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cons.live_ranks(epoch) == set()
    assert cons.session_record() is None


def test_join_waits_for_session_and_times_out(catalog_factory) -> None:
    r1 = catalog_factory()
    with pytest.raises(WaitTimeout, match="no session"):
        r1.open_session(rank=1, world_size=2, session_id="nobody", join_timeout=0.5)
    with pytest.raises(CatalogError, match="not in"):
        r1.open_session(rank=2, world_size=2)


def test_namespaces_are_isolated(catalog_factory) -> None:
    a, b = catalog_factory("ns-a-" + uuid.uuid4().hex[:6]), catalog_factory("ns-b-" + uuid.uuid4().hex[:6])
    la, lb = _publisher(a, 0, 1), _publisher(b, 0, 1)
    assert a.put_piece(3, la)
    assert b.latest() is None
    assert b.put_piece(1, lb)
    assert a.latest() == 3 and b.latest() == 1
    assert a.committed_steps() == [3] and b.committed_steps() == [1]
    # A new session in b does not fence a.
    _publisher(catalog_factory(b.namespace), 0, 1)
    assert a.put_piece(4, la)


def test_bad_namespace_is_rejected(etcd) -> None:
    with pytest.raises(CatalogError, match="bad namespace"):
        Catalog(etcd.endpoint, "a/b")


def test_retention_keeps_last_k(catalog_factory) -> None:
    cat = catalog_factory(retention=3)
    lid = _publisher(cat, 0, 1)
    for s in range(8):
        cat.put_piece(s, lid)
    assert cat.committed_steps() == [5, 6, 7]
    with pytest.raises(VersionNotFound):
        cat.read_version(2)
    assert cat.read_version(7).step == 7


def test_reader_registration_and_retire(catalog_factory) -> None:
    pub, cons = catalog_factory(), catalog_factory()
    lid = _publisher(pub, 0, 1)
    pub.put_piece(1, lid)
    v = cons.begin_read(1, "reader-a")
    assert v.step == 1 and v.pieces[0].layout_id == lid
    done: list[int] = []
    th = threading.Thread(target=lambda: done.append(pub.retire(1, timeout=20)))
    th.start()
    time.sleep(0.3)
    assert th.is_alive()  # waits for the registered reader
    with pytest.raises(VersionNotFound):
        cons.begin_read(1, "reader-b")  # retired: no new readers
    assert cons.end_read(1, "reader-a") is True  # the publisher waited: the bytes were intact
    th.join(10)
    assert done == [0]


def test_retire_timeout_marks_readers_torn(catalog_factory) -> None:
    pub, cons = catalog_factory(), catalog_factory()
    lid = _publisher(pub, 0, 1)
    pub.put_piece(1, lid)
    cons.begin_read(1, "slow")
    assert pub.retire(1, timeout=0.2) == 1  # gave up waiting: the memory may now change
    assert cons.end_read(1, "slow") is False
    pub.put_piece(2, lid)
    cons.begin_read(2, "reader-c")
    assert cons.end_read(2, "reader-c") is True


@pytest.mark.timeout(90)
def test_etcd_unreachable_raises_typed_error_without_hanging() -> None:
    with EmbeddedEtcd() as server:
        cat = Catalog(server.endpoint, "down", op_timeout=0.5, retry_deadline=2.0)
        lid = _publisher(cat, 0, 1)
        server.pause()
        try:
            with pytest.raises(CatalogUnavailable, match="unreachable"):
                cat.put_piece(1, lid)
        finally:
            server.resume()
        # Back up: the same catalog object works again (no client stuck in a failed state).
        assert cat.put_piece(2, lid)
        cat.close(revoke=False)


def test_etcd_restart_is_retried(catalog_factory, etcd) -> None:
    with EmbeddedEtcd() as server:
        cat = Catalog(server.endpoint, "restart", op_timeout=0.5, retry_deadline=20.0)
        lid = _publisher(cat, 0, 1)
        server.pause()
        threading.Timer(1.0, server.resume).start()
        assert cat.put_piece(1, lid) is True
        cat.close()

"""The etcd catalog against a real etcd server; concurrency through real processes."""

from __future__ import annotations

import os
import queue
import random
import signal
import threading
import time
import uuid

import pytest

from astate_store.catalog import Catalog, CheckpointEntry, EtcdClient
from astate_store.catalog.records import pad20
from astate_store.errors import (
    CatalogError,
    CatalogRejected,
    CatalogUnavailable,
    StaleSessionError,
    StaleStepError,
    VersionNotFound,
    WaitTimeout,
)
from astate_store.etcd.embedded import EmbeddedEtcd
from astate_store.model.layout import Box, ShardRecord
from tests._catalog_workers import commit_racer, hold_session, publish, row_shard
from tests._procs import CTX
from tests.support.waiting import wait_until


def _watches(client: EtcdClient, monkeypatch: pytest.MonkeyPatch) -> queue.Queue[tuple[str, int | None]]:
    """Report (key, start_revision) each time ``client`` is about to block on a watch."""
    waits: queue.Queue[tuple[str, int | None]] = queue.Queue()
    real = client.wait_change

    def spy(
        key: str, timeout: float | None, *, prefix: bool = False, start_revision: int | None = None
    ) -> None:
        waits.put((key, start_revision))
        real(key, timeout, prefix=prefix, start_revision=start_revision)

    monkeypatch.setattr(client, "wait_change", spy)
    return waits


def _next_wait(
    waits: queue.Queue[tuple[str, int | None]], key: str, after_revision: int = 0, timeout: float = 15.0
) -> None:
    """Wait (bounded) until a watch on ``key`` starting after ``after_revision`` is reported."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            k, start = waits.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no wait on {key} after revision {after_revision} within {timeout}s")
        if k == key and (start or 0) > after_revision:
            return


def _publisher(cat: Catalog, rank: int, world: int, session_id: str | None = None) -> str:
    cat.sessions.open(rank=rank, world_size=world, session_id=session_id)
    return cat.versions.write_layout([row_shard(rank, world)], b"desc%d" % rank)


def test_commit_only_when_all_ranks_wrote(catalog_factory) -> None:
    world = 3
    cats = [catalog_factory() for _ in range(world)]
    lids = [_publisher(c, r, world, "s1") for r, c in enumerate(cats)]
    reader = catalog_factory()
    assert cats[0].versions.put_piece(7, lids[0]) is False
    assert cats[2].versions.put_piece(7, lids[2]) is False
    assert reader.versions.latest() is None
    with pytest.raises(VersionNotFound):
        reader.versions.read_version(7)
    assert cats[1].versions.put_piece(7, lids[1]) is True
    assert reader.versions.latest() == 7
    v = reader.versions.layouts_of(reader.versions.read_version(7))
    assert sorted(v.pieces) == [0, 1, 2]
    assert {r: lay.transport for r, lay in v.layouts.items()} == {r: b"desc%d" % r for r in range(world)}
    assert v.layouts[1].shards[0].box == row_shard(1, world).box


def test_commit_from_separate_processes(etcd, namespace) -> None:
    world, steps = 3, [1, 2, 3]
    barrier, results = CTX.Barrier(world), CTX.Queue()
    procs = [
        CTX.Process(target=publish, args=(etcd.endpoint, namespace, r, world, steps, "sid", barrier, results))
        for r in range(world)
    ]
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
    assert cat.versions.latest() == 3
    assert cat.versions.committed_steps() == [1, 2, 3]
    cat.close()


def test_racing_commits_latest_never_backwards(etcd, namespace) -> None:
    world = 2
    steps = list(range(10))
    barrier, results = CTX.Barrier(world), CTX.Queue()
    procs = [
        CTX.Process(
            target=commit_racer, args=(etcd.endpoint, namespace, steps, "race", r, world, barrier, results)
        )
        for r in range(world)
    ]
    watcher = Catalog(etcd.endpoint, namespace, retention=100)
    seen: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            v = watcher.versions.latest()
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
    assert watcher.versions.latest() == 9
    watcher.close()


def test_latest_does_not_move_back_for_an_older_step(catalog_factory) -> None:
    cat = catalog_factory()
    lid = _publisher(cat, 0, 1)
    assert cat.versions.put_piece(10, lid)
    # A step that can never commit is an error at put, not a version silently left uncommitted.
    with pytest.raises(StaleStepError, match=r"step 4 can never commit: step 10"):
        cat.versions.put_piece(4, lid)
    assert cat.versions.latest() == 10
    assert cat.versions.committed_steps() == [10]


def test_watch_wakes_waiter(catalog_factory, monkeypatch) -> None:
    pub, cons = catalog_factory(), catalog_factory()
    lid = _publisher(pub, 0, 1)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(cons.versions.wait_for(3, timeout=30)))
    t.start()
    # found no version and blocked
    wait_until(lambda: None in cons.versions._latest.blocked_at, 30, interval=0.01)
    pub.versions.put_piece(2, lid)
    # The waiter learned of step 2 (from its watch), saw 2 < 3 and blocked again.
    wait_until(lambda: 2 in cons.versions._latest.blocked_at, 30, interval=0.01)
    assert t.is_alive() and not out
    pub.versions.put_piece(3, lid)
    t.join(10)
    assert out == [3]


def test_wait_timeout(catalog_factory) -> None:
    cons = catalog_factory()
    with pytest.raises(WaitTimeout, match="not committed within"):
        cons.versions.wait_for(1, timeout=0.5)


def test_stale_session_is_fenced(catalog_factory) -> None:
    old, new = catalog_factory(), catalog_factory()
    lid_old = _publisher(old, 0, 1)
    assert old.versions.put_piece(1, lid_old)
    lid_new = _publisher(new, 0, 1)
    with pytest.raises(StaleSessionError, match="fenced by a newer session"):
        old.versions.put_piece(2, lid_old)
    with pytest.raises(StaleSessionError):
        old.versions.write_layout([row_shard(0, 2)], b"zombie")
    assert new.versions.put_piece(2, lid_new)
    assert new.versions.latest() == 2


def test_zombie_rank_cannot_commit_into_new_session(catalog_factory) -> None:
    # Old session of two ranks; a new session starts; the old rank 1 writes its piece.
    o0, o1 = catalog_factory(), catalog_factory()
    l0, l1 = _publisher(o0, 0, 2, "old"), _publisher(o1, 1, 2, "old")
    n0, n1 = catalog_factory(), catalog_factory()
    m0, m1 = _publisher(n0, 0, 2, "new"), _publisher(n1, 1, 2, "new")
    assert n0.versions.put_piece(5, m0) is False
    with pytest.raises(StaleSessionError):
        o1.versions.put_piece(5, l1)
    assert n0.versions.latest() is None
    assert n1.versions.put_piece(5, m1) is True
    del l0


def test_lease_expiry_marks_session_dead(etcd, namespace, catalog_factory) -> None:
    ready = CTX.Queue()
    p = CTX.Process(target=hold_session, args=(etcd.endpoint, namespace, 2.0, ready))
    p.start()
    pid = ready.get(timeout=60)
    cons = catalog_factory()
    epoch = cons.sessions.record()["epoch"]
    assert cons.sessions.live_ranks(epoch) == {0}
    os.kill(pid, signal.SIGKILL)
    p.join(10)
    wait_until(
        lambda: not cons.sessions.live_ranks(epoch), 15, interval=0.2, message="the dead rank stayed live"
    )
    assert cons.sessions.record() is None


def test_join_waits_for_session_and_times_out(catalog_factory) -> None:
    r1 = catalog_factory()
    with pytest.raises(WaitTimeout, match="no session"):
        r1.sessions.open(rank=1, world_size=2, session_id="nobody", join_timeout=0.5)
    with pytest.raises(CatalogError, match="not in"):
        r1.sessions.open(rank=2, world_size=2)


def test_namespaces_are_isolated(catalog_factory) -> None:
    a, b = catalog_factory("ns-a-" + uuid.uuid4().hex[:6]), catalog_factory("ns-b-" + uuid.uuid4().hex[:6])
    la, lb = _publisher(a, 0, 1), _publisher(b, 0, 1)
    assert a.versions.put_piece(3, la)
    assert b.versions.latest() is None
    assert b.versions.put_piece(1, lb)
    assert a.versions.latest() == 3 and b.versions.latest() == 1
    assert a.versions.committed_steps() == [3] and b.versions.committed_steps() == [1]
    # A new session in b does not fence a.
    _publisher(catalog_factory(b.namespace), 0, 1)
    assert a.versions.put_piece(4, la)


def test_bad_namespace_is_rejected(etcd) -> None:
    with pytest.raises(CatalogError, match="bad namespace"):
        Catalog(etcd.endpoint, "a/b")


def test_retention_keeps_last_k(catalog_factory) -> None:
    cat = catalog_factory(retention=3)
    lid = _publisher(cat, 0, 1)
    for s in range(8):
        cat.versions.put_piece(s, lid)
    assert cat.versions.flush_retention()  # retention runs off the put path, in the background
    assert cat.versions.committed_steps() == [5, 6, 7]
    with pytest.raises(VersionNotFound):
        cat.versions.read_version(2)
    assert cat.versions.read_version(7).step == 7


def test_reader_registration_and_retire(catalog_factory, monkeypatch) -> None:
    pub, cons = catalog_factory(), catalog_factory()
    waits = _watches(pub.client, monkeypatch)
    lid = _publisher(pub, 0, 1)
    pub.versions.put_piece(1, lid)
    v = cons.readers.begin_read(1, "reader-a")
    assert v.step == 1 and v.pieces[0].layout_id == lid
    done: list[int] = []
    th = threading.Thread(target=lambda: done.append(pub.readers.retire(1, timeout=20)))
    th.start()
    # retire wrote its retired record, found reader-a registered and blocked on a watch of the readers.
    _next_wait(waits, pub.client.key("readers", pad20(1)) + "/")
    assert th.is_alive() and not done  # waits for the registered reader
    with pytest.raises(VersionNotFound):
        cons.readers.begin_read(1, "reader-b")  # retired: no new readers
    assert cons.readers.end_read(1, "reader-a") is True  # the publisher waited: the bytes were intact
    th.join(10)
    assert done == [0]


def test_retire_timeout_marks_readers_torn(catalog_factory) -> None:
    pub, cons = catalog_factory(), catalog_factory()
    lid = _publisher(pub, 0, 1)
    pub.versions.put_piece(1, lid)
    cons.readers.begin_read(1, "slow")
    assert pub.readers.retire(1, timeout=0.2) == 1  # gave up waiting: the memory may now change
    assert cons.readers.end_read(1, "slow") is False
    pub.versions.put_piece(2, lid)
    cons.readers.begin_read(2, "reader-c")
    assert cons.readers.end_read(2, "reader-c") is True


@pytest.mark.timeout(90)
def test_etcd_unreachable_raises_typed_error_without_hanging() -> None:
    with EmbeddedEtcd() as server:
        cat = Catalog(server.endpoint, "down", op_timeout=0.5, retry_deadline=2.0)
        lid = _publisher(cat, 0, 1)
        server.proc.send_signal(signal.SIGSTOP)  # etcd unreachable
        try:
            with pytest.raises(CatalogUnavailable, match="unreachable"):
                cat.versions.put_piece(1, lid)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        # Back up: the same catalog object works again (no client stuck in a failed state).
        assert cat.versions.put_piece(2, lid)
        cat.close(revoke=False)


def test_etcd_restart_is_retried(catalog_factory, etcd) -> None:
    with EmbeddedEtcd() as server:
        cat = Catalog(server.endpoint, "restart", op_timeout=0.5, retry_deadline=20.0)
        lid = _publisher(cat, 0, 1)
        server.proc.send_signal(signal.SIGSTOP)  # etcd unreachable
        threading.Timer(1.0, server.proc.send_signal, (signal.SIGCONT,)).start()
        assert cat.versions.put_piece(1, lid) is True
        cat.close()


def test_bad_step_and_retention_are_rejected(etcd, catalog_factory) -> None:
    with pytest.raises(CatalogError, match="retention"):
        Catalog(etcd.endpoint, "ok", retention=0)
    cat = catalog_factory()
    with pytest.raises(CatalogError, match="no publisher session"):
        cat.versions.write_layout([row_shard(0, 1)], b"x")
    lid = _publisher(cat, 0, 1)
    for bad in (-1, 10**19, True, 1.5):
        with pytest.raises(CatalogError, match="step must be"):
            cat.versions.put_piece(bad, lid)  # type: ignore[arg-type]
    assert cat.versions.latest() is None


def test_session_is_visible_and_forgotten_on_close(etcd, namespace) -> None:
    cat = Catalog(etcd.endpoint, namespace)
    assert cat.session is None and cat.sessions.epoch() is None
    s = cat.sessions.open(rank=0, world_size=1, session_id="visible")
    assert cat.session == s and cat.sessions.require() == s
    assert cat.sessions.epoch() == s.epoch and cat.sessions.record()["session_id"] == "visible"
    cat.client.ping()
    cat.close()
    assert cat.session is None
    with Catalog(etcd.endpoint, namespace) as other:
        assert other.sessions.record() is None  # close revoked the session's lease
        assert other.sessions.live_ranks(s.epoch) == set()


def test_delivery_and_consumers(catalog_factory) -> None:
    pub, a, b = catalog_factory(), catalog_factory(), catalog_factory()
    lid = _publisher(pub, 0, 1)
    a.consumers.register("a", [(0, "w", row_shard(0, 1).box, None)])
    b.consumers.register("b", [(0, "w", row_shard(0, 1).box, "bfloat16")])
    assert pub.consumers.ids() == {"a", "b"}
    assert [(c, n, dt) for c, n, _box, dt in pub.consumers.pack_requests(0)] == [
        ("a", "w", None),
        ("b", "w", "bfloat16"),
    ]
    assert pub.consumers.pack_requests(1) == ()
    pub.versions.put_piece(1, lid)
    a.readers.begin_read(1, "a")
    assert a.readers.end_read(1, "a") is True
    # "gone" never registered: not waited for; "b" is alive and did not read: still missing.
    assert pub.readers.wait_delivered(1, {"a", "b", "gone"}, timeout=0.0) == {"b"}
    b.close()  # b's lease goes with it: a dead consumer is not waited for
    assert pub.readers.wait_delivered(1, {"a", "b"}, timeout=10.0) == set()


def test_replica_is_an_extra_source_until_removed(catalog_factory) -> None:
    pub, rep, cons = catalog_factory(), catalog_factory(), catalog_factory()
    lid = _publisher(pub, 0, 1)
    pub.versions.put_piece(1, lid)
    rlid = rep.replicas.add(1, "g0", "m0", [row_shard(0, 1)], b"replica-desc")
    v = cons.versions.layouts_of(cons.versions.read_version(1))
    assert set(v.replicas) == {"m0"} and v.replicas["m0"].layout_id == rlid
    assert v.replica_layouts["m0"].transport == b"replica-desc" and not v.missing
    assert rep.replicas.remove(1, "g0", "m0", rlid, timeout=5.0) == 0
    assert cons.versions.read_version(1).replicas == {}
    with pytest.raises(VersionNotFound):
        rep.replicas.add(9, "g0", "m0", [row_shard(0, 1)], b"replica-desc")


def test_checkpoint_index_lists_oldest_first(catalog_factory) -> None:
    cat = catalog_factory()
    for step in (12, 3, 7):
        cat.checkpoints.record(CheckpointEntry(step, f"file:///ckpt/{step}", 2, 100 + step, 1.5))
    assert [e.step for e in cat.checkpoints.list()] == [3, 7, 12]
    assert cat.checkpoints.list()[0] == CheckpointEntry(3, "file:///ckpt/3", 2, 103, 1.5)


def test_a_layout_over_etcds_request_limit_is_chunked_and_read_back_whole(catalog_factory) -> None:
    # 60,000 shards with incompressible names: several MiB, far over etcd's 1.5 MiB request limit.
    rng = random.Random(7)
    shards = [
        ShardRecord(
            f"layer.{rng.getrandbits(128):032x}.w",
            "float32",
            (4, 2),
            Box((2, 0), (2, 2)),
            (2, 1),
            0,
            0,
            64 * i,
        )
        for i in range(60_000)
    ]
    pub, cons = catalog_factory(), catalog_factory()
    pub.sessions.open(rank=0, world_size=1)
    lid = pub.versions.write_layout(shards, b"transport")
    assert pub.versions.put_piece(1, lid) is True
    version = cons.versions.layouts_of(cons.versions.read_version(1))
    assert not version.missing
    assert list(version.layouts[0].shards) == shards
    chunks = [
        m.key for _v, m in cons.client.raw.get_prefix(cons.client.key("manifests") + "/", keys_only=True)
    ]
    assert len(chunks) >= 3  # the head and its chunks
    assert list(cons.versions.manifests_of(version)[0].names) == [s.name for s in shards]


def test_etcd_refusals_are_raised_at_once_as_what_they_are(catalog_factory) -> None:
    cat = catalog_factory(retry_deadline=60.0)
    key = cat.client.key("too-big")
    rpcs = cat.client.rpcs
    with pytest.raises(CatalogRejected, match="refused put too-big: (RESOURCE_EXHAUSTED|INVALID_ARGUMENT)"):
        cat.client.call("put too-big", lambda: cat.client.raw.put(key, b"x" * (2 << 20)))
    assert cat.client.rpcs == rpcs + 1  # refused once, never retried as if etcd were down


def test_a_single_wait_is_one_read_and_the_second_opens_the_watch(catalog_factory) -> None:
    # A store that reads once (an agent session resuming) never opens a watch on latest; a
    # store that keeps reading gets one at its second wait, and steady waits then cost nothing.
    pub, cons = catalog_factory(), catalog_factory()
    lid = _publisher(pub, 0, 1)
    pub.versions.put_piece(1, lid)
    watch = cons.versions._latest
    rpcs = cons.client.rpcs
    assert cons.versions.wait_for(1, timeout=30) == 1
    assert cons.client.rpcs == rpcs + 1 and not watch._alive
    assert cons.versions.wait_for(1, timeout=30) == 1
    assert watch._alive
    rpcs = cons.client.rpcs
    pub.versions.put_piece(2, lid)
    assert cons.versions.wait_for(2, timeout=30) == 2  # the watch brings it
    assert cons.client.rpcs == rpcs

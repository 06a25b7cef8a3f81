"""Publisher sessions (catalog/sessions.py) on real etcd: the epoch counter, the fence every write
carries, joining, live ranks, and records that are not what their key says."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from pyetcd import transactions as tx

from astate_store.catalog import Catalog
from astate_store.catalog.records import pad20
from astate_store.catalog.sessions import Sessions
from astate_store.errors import CatalogCorrupted, CatalogError, StaleSessionError, WaitTimeout
from astate_store.model import codec

Factory = Callable[..., Catalog]


def _fenced_write(cat: Catalog, name: str) -> bool:
    """A write guarded by the session's fence, as every publisher write is."""
    c = cat.client
    ok, _ = c.txn("test write", cat.sessions.fence(), [tx.Put(c.key("probe", name), b"1")])
    return ok


def test_each_rank0_start_takes_the_next_epoch_and_fences_the_older(catalog_factory: Factory) -> None:
    a, b, reader = catalog_factory(), catalog_factory(), catalog_factory()
    assert reader.sessions.epoch() is None and reader.sessions.record() is None
    sa = a.sessions.open(rank=0, world_size=2, session_id="run-a")
    assert (sa.epoch, sa.session_id, sa.rank, sa.world_size) == (1, "run-a", 0, 2)
    assert _fenced_write(a, "a1")
    sb = b.sessions.open(rank=0, world_size=1)
    assert sb.epoch == 2 and len(sb.session_id) == 32  # a fresh id when none is given
    assert reader.sessions.epoch() == 2
    rec = reader.sessions.record()
    assert rec is not None and (rec["epoch"], rec["session_id"], rec["world_size"]) == (2, sb.session_id, 1)
    assert _fenced_write(b, "b1")
    assert not _fenced_write(a, "a2")  # overtaken: every later write of session 1 is rejected
    err = a.sessions.fenced_error("put piece")
    assert isinstance(err, StaleSessionError)
    assert "put piece rejected: session epoch 1 was fenced by a newer session (epoch 2)" in str(err)


def test_concurrent_rank0_starts_get_distinct_epochs(catalog_factory: Factory) -> None:
    cats = [catalog_factory() for _ in range(4)]
    got: list[int] = []
    barrier = threading.Barrier(len(cats))

    def start(cat: Catalog) -> None:
        barrier.wait(30)
        got.append(cat.sessions.open(rank=0, world_size=1).epoch)

    threads = [threading.Thread(target=start, args=(c,)) for c in cats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [1, 2, 3, 4]
    newest = max(cats, key=lambda c: c.session.epoch)  # type: ignore[union-attr]
    assert [_fenced_write(c, str(i)) for i, c in enumerate(cats)].count(True) == 1
    assert _fenced_write(newest, "again")


def test_a_rank_whose_lease_expired_is_fenced_in_its_own_session(catalog_factory: Factory) -> None:
    r0, r1 = catalog_factory(), catalog_factory()
    s0 = r0.sessions.open(rank=0, world_size=2, session_id="s")
    s1 = r1.sessions.open(rank=1, world_size=2, session_id="s")
    assert s1.epoch == s0.epoch and r0.sessions.live_ranks(s0.epoch) == {0, 1}
    r1.client.revoke(s1.lease_id)  # what expiry does: the member record vanishes
    assert r0.sessions.live_ranks(s0.epoch) == {0}
    assert not _fenced_write(r1, "zombie") and _fenced_write(r0, "alive")
    assert "rank 1's lease of session epoch 1 expired" in str(r1.sessions.fenced_error("put piece"))


def test_joining_needs_the_newest_matching_session(catalog_factory: Factory) -> None:
    r0, joiner = catalog_factory(), catalog_factory()
    r0.sessions.open(rank=0, world_size=2, session_id="mine")
    with pytest.raises(WaitTimeout, match="rank 1 found no session other of world size 2"):
        joiner.sessions.open(rank=1, world_size=2, session_id="other", join_timeout=0.3)
    with pytest.raises(WaitTimeout, match="found no session \\(any\\) of world size 3"):
        joiner.sessions.open(rank=1, world_size=3, join_timeout=0.3)
    s = joiner.sessions.open(rank=1, world_size=2)  # any live session of that size
    assert (s.session_id, s.rank) == ("mine", 1) and joiner.session == s


def test_a_rank_joins_a_session_started_while_it_waits(catalog_factory: Factory) -> None:
    r0, r1 = catalog_factory(), catalog_factory()
    joined: list[object] = []
    t = threading.Thread(
        target=lambda: joined.append(
            r1.sessions.open(rank=1, world_size=2, session_id="late", join_timeout=60)
        )
    )
    t.start()
    s0 = r0.sessions.open(rank=0, world_size=2, session_id="late")
    t.join(60)
    assert len(joined) == 1 and joined[0].epoch == s0.epoch  # type: ignore[attr-defined]


def test_bad_ranks_and_a_missing_session_are_typed_errors(catalog_factory: Factory) -> None:
    cat = catalog_factory()
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(CatalogError, match=f"rank {rank} is not in"):
            cat.sessions.open(rank=rank, world_size=world)
    with pytest.raises(CatalogError, match="no publisher session"):
        cat.sessions.require()
    with pytest.raises(CatalogError, match="no publisher session"):
        cat.sessions.fence()
    cat.sessions.open(rank=0, world_size=1)
    cat.sessions.clear()
    assert cat.sessions.current is None


def test_bad_member_records_are_skipped_and_counted(catalog_factory: Factory) -> None:
    cat, reader = catalog_factory(), catalog_factory()
    s = cat.sessions.open(rank=0, world_size=4)
    c = cat.client
    member = lambda epoch, rank: codec.encode(
        "member",
        {
            "epoch": epoch,
            "rank": rank,
            "host": "h",  # noqa: E731
            "pid": 1,
        },
    )
    c.raw.put(c.key("members", pad20(s.epoch), pad20(1)), b"\x00not a member")
    c.raw.put(c.key("members", pad20(s.epoch), pad20(2)), member(s.epoch, 3))  # says rank 3
    c.raw.put(c.key("members", pad20(s.epoch), pad20(3)), member(s.epoch + 1, 3))  # says another epoch
    c.raw.put(c.key("members", pad20(s.epoch), "x"), member(s.epoch, 0))  # not a numbered key
    assert reader.sessions.live_ranks(s.epoch) == {0}
    assert reader.sessions.skips.count == 4
    assert reader.skipped_records == 4


def test_corrupted_counters_and_session_records_are_typed_errors(catalog_factory: Factory) -> None:
    cat = catalog_factory()
    c = cat.client
    c.raw.put(c.key("epoch"), b"seven")
    with pytest.raises(CatalogCorrupted, match="counter .*/epoch is corrupted"):
        cat.sessions.epoch()
    with pytest.raises(CatalogCorrupted):
        cat.sessions.open(rank=0, world_size=1)  # no session on a guessed epoch
    c.raw.put(c.key("session"), b"\x00garbage")
    with pytest.raises(CatalogCorrupted, match="session record .* is corrupted"):
        Sessions(c).record()

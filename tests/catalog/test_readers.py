"""The retire protocol (catalog/readers.py) on real etcd: readers register with the commit they
read, publishers retire and wait, and torn marks fail exactly the reads that used that source."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from astate_store.catalog import Catalog
from astate_store.catalog.readers import replica_source
from astate_store.catalog.records import pad20
from astate_store.errors import CatalogCorrupted, CatalogError, VersionNotFound
from astate_store.model import codec
from astate_store.model.layout import Box, ShardRecord

Factory = Callable[..., Catalog]


def _publish(cat: Catalog, *steps: int) -> None:
    """A one-rank publisher session with ``steps`` committed."""
    cat.sessions.open(rank=0, world_size=1)
    lid = cat.versions.write_layout([ShardRecord("w", "float32", (8,), Box((0,), (8,)), (1,), 0, 0, 0)], b"d")
    for s in steps:
        assert cat.versions.put_piece(s, lid) is True


def _keys(cat: Catalog, family: str, step: int) -> set[str]:
    pre = cat.client.key(family, pad20(step)) + "/"
    return {m.key.decode()[len(pre) :] for _v, m in cat.client.raw.get_prefix(pre, keys_only=True)}


@pytest.fixture
def pub(catalog_factory: Factory) -> Catalog:
    cat = catalog_factory()
    _publish(cat, 1, 2)
    return cat


def test_a_good_read_registers_then_is_delivered(pub: Catalog, catalog_factory: Factory) -> None:
    cons = catalog_factory()
    v = cons.readers.begin_read(2, "r1")
    assert (v.step, v.world_size, sorted(v.pieces)) == (2, 1, [0])
    assert _keys(cons, "readers", 2) == {"r1"}
    rec = codec.decode("reader", cons.client.raw.get(cons.client.key("readers", pad20(2), "r1"))[0])
    assert (rec["step"], rec["reader_id"]) == (2, "r1")
    assert cons.readers.end_read(2, "r1", [0]) is True
    assert _keys(cons, "readers", 2) == set() and _keys(cons, "delivered", 2) == {"r1"}


def test_an_uncommitted_or_retired_step_takes_no_reader(pub: Catalog, catalog_factory: Factory) -> None:
    cons = catalog_factory()
    with pytest.raises(VersionNotFound, match="step 9 is not committed or was retired"):
        cons.readers.begin_read(9, "r")
    assert pub.readers.retire(1, timeout=5.0) == 0  # nobody reading: at once
    assert _keys(pub, "retired", 1) == {pad20(0)}
    with pytest.raises(VersionNotFound):
        cons.readers.begin_read(1, "r")
    assert _keys(cons, "readers", 1) == set() and _keys(cons, "readers", 9) == set()
    cons.readers.begin_read(2, "r")  # the other step is untouched
    assert cons.readers.end_read(2, "r") is True


def test_retire_without_a_session_is_refused(catalog_factory: Factory) -> None:
    with pytest.raises(CatalogError, match="no publisher session"):
        catalog_factory().readers.retire(1)


def test_giving_up_on_a_reader_marks_the_step_torn_for_this_rank(
    pub: Catalog, catalog_factory: Factory
) -> None:
    cons = catalog_factory()
    cons.readers.begin_read(2, "slow")
    assert pub.readers.retire(2, timeout=0.0) == 1
    assert _keys(pub, "torn", 2) == {pad20(0)}
    rec = codec.decode("retired", pub.client.raw.get(pub.client.key("torn", pad20(2), pad20(0)))[0])
    assert (rec["step"], rec["rank"], rec["epoch"]) == (2, 0, pub.session.epoch)  # type: ignore[union-attr]
    assert cons.readers.end_read(2, "slow", [0]) is False
    assert _keys(cons, "readers", 2) == set() and _keys(cons, "delivered", 2) == set()


def test_a_torn_mark_fails_only_reads_that_used_its_source(pub: Catalog, catalog_factory: Factory) -> None:
    cons = catalog_factory()
    for rid in ("rank0", "rank1", "replica", "any"):
        cons.readers.begin_read(1, rid)
    pub.readers.mark_torn(1, replica_source("m7"))
    assert replica_source("m7") == "r-m7"
    assert cons.readers.end_read(1, "rank0", [0]) is True
    assert cons.readers.end_read(1, "rank1", [1, "r-other"]) is True
    assert cons.readers.end_read(1, "replica", [0, replica_source("m7")]) is False
    assert cons.readers.end_read(1, "any", None) is False  # no sources named: every mark counts


def test_past_sixteen_ranks_one_range_compare_covers_every_rank(
    pub: Catalog, catalog_factory: Factory
) -> None:
    cons = catalog_factory()
    cons.readers.begin_read(1, "few")
    cons.readers.begin_read(1, "many")
    pub.readers.mark_torn(1, pad20(40))  # a rank neither read used
    assert cons.readers.end_read(1, "few", list(range(16))) is True
    # Conservative by design: O(1) compares, so a mark of any rank fails a wide read.
    assert cons.readers.end_read(1, "many", list(range(17))) is False


def test_a_reader_record_rewritten_or_lost_fails_the_read(pub: Catalog, catalog_factory: Factory) -> None:
    cons = catalog_factory()
    cons.readers.begin_read(1, "over")
    key = cons.client.key("readers", pad20(1), "over")
    cons.client.raw.put(key, cons.client.raw.get(key)[0])  # same bytes, another writer's revision
    assert cons.readers.end_read(1, "over") is False
    cons.readers.begin_read(2, "lost")
    cons.client.revoke(cons.client.reader_lease())  # the lease expired: nobody waited for this reader
    assert cons.readers.end_read(2, "lost") is False


def test_a_version_dropped_during_the_read_fails_it(pub: Catalog, catalog_factory: Factory) -> None:
    cons = catalog_factory()
    cons.readers.begin_read(1, "r")
    pub.versions.delete_step(1)
    assert cons.readers.end_read(1, "r") is False


def test_a_corrupt_version_unregisters_its_reader(pub: Catalog, catalog_factory: Factory) -> None:
    c = pub.client
    epoch = pub.session.epoch  # type: ignore[union-attr]
    c.raw.delete(c.key("versions", pad20(2), "pieces", pad20(epoch), pad20(0)))
    cons = catalog_factory()
    with pytest.raises(CatalogCorrupted, match="missing or bad"):
        cons.readers.begin_read(2, "r")
    assert _keys(cons, "readers", 2) == set()  # no publisher will wait for it


def test_records_that_are_not_readers_are_not_waited_for(pub: Catalog) -> None:
    c = pub.client
    c.raw.put(c.key("readers", pad20(2), "junk"), b"\x00not a reader")
    c.raw.put(
        c.key("readers", pad20(2), "liar"),
        codec.encode("reader", {"step": 1, "reader_id": "liar", "host": "h", "pid": 1}),
    )
    before = pub.readers.skips.count
    assert pub.readers.retire(2, timeout=30.0) == 0  # returns at once: no real reader is there
    assert pub.readers.skips.count == before + 2
    assert _keys(pub, "torn", 2) == set()

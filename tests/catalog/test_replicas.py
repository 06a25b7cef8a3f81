"""Replicas (catalog/replicas.py) on real etcd: offering a committed step from a consumer's
buffers, counting replica servers, waiting for them, and withdrawing an offer."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from astate_store.catalog import Catalog
from astate_store.catalog.records import pad20
from astate_store.catalog.replicas import SERVER_GROUP, server_group
from astate_store.errors import ReplicationTimeout, VersionNotFound
from astate_store.model import codec
from astate_store.model.layout import Box, ShardRecord

Factory = Callable[..., Catalog]
SHARDS = [ShardRecord("w", "float32", (8, 4), Box((0, 0), (8, 4)), (4, 1), 0, 3, 128)]


def _committed(cat: Catalog, *steps: int) -> None:
    cat.sessions.open(rank=0, world_size=1)
    lid = cat.versions.write_layout(SHARDS, b"pub")
    for s in steps:
        cat.versions.put_piece(s, lid)


def _under(cat: Catalog, *parts: str) -> set[str]:
    pre = cat.client.key(*parts) + "/"
    return {m.key.decode()[len(pre) :] for _v, m in cat.client.raw.get_prefix(pre, keys_only=True)}


@pytest.fixture
def pub(catalog_factory: Factory) -> Catalog:
    cat = catalog_factory()
    _committed(cat, 1, 2)
    return cat


def test_an_offer_is_a_source_of_the_step_with_its_own_layout(pub: Catalog, catalog_factory: Factory) -> None:
    rep, cons = catalog_factory(), catalog_factory()
    lid = rep.replicas.add(1, "grp", "m1", SHARDS, b"replica-transport")
    assert _under(cons, "versions", pad20(1), "replicas") == {"grp/m1"}
    v = cons.versions.layouts_of(cons.versions.read_version(1))
    assert v.replicas["m1"].layout_id == lid and v.replicas["m1"].group == "grp"
    lay = v.replica_layouts["m1"]
    assert lay.transport == b"replica-transport" and list(lay.shards) == SHARDS
    # The same buffers offered again are the same content address.
    assert rep.replicas.add(2, "grp", "m1", SHARDS, b"replica-transport") == lid
    with pytest.raises(VersionNotFound, match="step 5 is not committed; cannot re-serve it"):
        rep.replicas.add(5, "grp", "m1", SHARDS, b"replica-transport")
    assert _under(cons, "versions", pad20(5)) == set()


def test_an_offer_vanishes_with_its_consumer(pub: Catalog, catalog_factory: Factory) -> None:
    rep, cons = catalog_factory(), catalog_factory()
    rep.replicas.add(1, "grp", "m1", SHARDS, b"t")
    assert _under(cons, "layouts", "replicas", "m1")
    rep.close()
    assert cons.versions.read_version(1).replicas == {}
    assert _under(cons, "layouts", "replicas", "m1") == set()


def test_only_replica_servers_with_good_records_count(pub: Catalog, catalog_factory: Factory) -> None:
    a, b, solo = catalog_factory(), catalog_factory(), catalog_factory()
    assert server_group("abc") == SERVER_GROUP + "abc" == "server-abc"
    a.replicas.add(1, server_group("a"), "ma", SHARDS, b"t")
    b.replicas.add(1, server_group("b"), "mb", SHARDS, b"t")
    solo.replicas.add(1, "solo-x", "mx", SHARDS, b"t")  # a consumer, not a server
    c = pub.client
    c.raw.put(c.key("versions", pad20(1), "replicas", server_group("bad"), "m"), b"\x00junk")
    c.raw.put(
        c.key("versions", pad20(1), "replicas", server_group("liar"), "m"),
        codec.encode(
            "replica",
            {
                "step": 2,
                "group": server_group("liar"),
                "member": "m",
                "layout_id": "0" * 24,
                "manifest_id": "0" * 24,
            },
        ),
    )
    held, rev = pub.replicas.servers_holding(1)
    assert held == {"server-a", "server-b"} and rev > 0
    assert pub.replicas.servers_holding(2)[0] == set()
    assert pub.replicas.wait_servers(1, 2, timeout=5.0) == 2


def test_waiting_for_servers_wakes_on_an_offer_or_times_out(pub: Catalog, catalog_factory: Factory) -> None:
    server = catalog_factory()
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(pub.replicas.wait_servers(2, 1, timeout=60.0)))
    waiter.start()
    server.replicas.add(2, server_group("s1"), "m1", SHARDS, b"t")
    waiter.join(60)
    assert got == [1]
    with pytest.raises(ReplicationTimeout, match="1 of the 2 replica servers") as info:
        pub.replicas.wait_servers(2, 2, timeout=0.3)
    assert (info.value.step, info.value.held) == (2, 1)


def test_remove_waits_for_readers_then_marks_its_own_source_torn(
    pub: Catalog, catalog_factory: Factory
) -> None:
    rep, cons = catalog_factory(), catalog_factory()
    lid = rep.replicas.add(1, "grp", "m1", SHARDS, b"t")
    cons.readers.begin_read(1, "reader")
    assert rep.replicas.remove(1, "grp", "m1", lid, timeout=0.0) == 1  # gave up on the reader
    assert _under(cons, "torn", pad20(1)) == {"r-m1"}
    assert cons.readers.end_read(1, "reader", ["r-m1"]) is False  # read from the replica: discarded
    assert cons.versions.read_version(1).replicas == {}
    assert lid not in {k.split("/")[0] for k in _under(cons, "layouts", "replicas", "m1")}
    # Without readers, removal returns at once and marks nothing.
    lid2 = rep.replicas.add(2, "grp", "m1", SHARDS, b"t")
    assert rep.replicas.remove(2, "grp", "m1", lid2, timeout=30.0) == 0
    assert _under(cons, "torn", pad20(2)) == set()

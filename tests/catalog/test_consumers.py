"""Consumer records (catalog/consumers.py) on real etcd: pre-pack requests, who is alive, the
watch that says when to re-read, and records that are not what their key says."""

from __future__ import annotations

from collections.abc import Callable

from astate_store.catalog import Catalog
from astate_store.model import codec
from astate_store.model.layout import Box
from tests.support.waiting import wait_until

Factory = Callable[..., Catalog]
WAIT = 30.0


def test_pack_requests_are_per_rank_and_sorted(catalog_factory: Factory) -> None:
    pub, a, b = catalog_factory(), catalog_factory(), catalog_factory()
    b.consumers.register(
        "b", [(0, "w", Box((0, 0), (4, 4)), "bfloat16"), (1, "w", Box((4, 0), (4, 4)), None)]
    )
    a.consumers.register("a", [(0, "z", Box((0,), (2,)), None), (0, "w", Box((2, 0), (2, 4)), None)])
    assert pub.consumers.pack_requests(0) == (
        ("a", "w", Box((2, 0), (2, 4)), None),
        ("a", "z", Box((0,), (2,)), None),
        ("b", "w", Box((0, 0), (4, 4)), "bfloat16"),
    )
    assert pub.consumers.pack_requests(1) == (("b", "w", Box((4, 0), (4, 4)), None),)
    assert pub.consumers.pack_requests(2) == ()
    assert pub.consumers.ids() == {"a", "b"}


def test_a_watch_says_when_the_records_changed(catalog_factory: Factory) -> None:
    pub, a = catalog_factory(), catalog_factory()
    assert pub.consumers.changed()  # never read
    pub.consumers.pack_requests(0)
    wait_until(lambda: not pub.consumers.changed(), WAIT)  # read, and the watch is up
    a.consumers.register("a", [(0, "w", Box((0,), (4,)), None)])
    wait_until(pub.consumers.changed, WAIT)
    assert [r[0] for r in pub.consumers.pack_requests(0)] == ["a"]
    wait_until(lambda: not pub.consumers.changed(), WAIT)
    a.close()  # the record goes with the lease: a change too
    wait_until(pub.consumers.changed, WAIT)
    assert pub.consumers.pack_requests(0) == ()


def test_a_consumer_registers_once_and_again_on_a_new_lease(catalog_factory: Factory) -> None:
    cons, pub = catalog_factory(lease_ttl=1.5), catalog_factory()
    assert cons.consumers.ensure_registered("me") is True
    rpcs = cons.client.rpcs
    assert cons.consumers.ensure_registered("me") is False
    assert cons.client.rpcs == rpcs  # steady: no etcd request
    cons.consumers.register("me", [(0, "w", Box((0,), (8,)), "float16")])
    old = cons.client.reader_lease()
    cons.client.raw.revoke_lease(old)  # the lease is gone behind the client's back: so is the record
    assert pub.consumers.ids() == set()
    wait_until(lambda: cons.client.reader_lease() != old, WAIT)  # the keep-alive noticed: a new lease
    # The record comes back on the new lease, with the requests it last sent.
    assert cons.consumers.ensure_registered("me") is True
    assert pub.consumers.ids() == {"me"}
    assert pub.consumers.pack_requests(0) == (("me", "w", Box((0,), (8,)), "float16"),)


def test_records_that_are_not_consumers_are_skipped_and_counted(catalog_factory: Factory) -> None:
    pub, a = catalog_factory(), catalog_factory()
    a.consumers.register("a", [(0, "w", Box((0,), (4,)), None)])
    c = pub.client
    c.raw.put(pub.consumers.prefix + "garbage", b"\x00\x01")
    c.raw.put(pub.consumers.prefix + "impostor", codec.encode("consumer", {"reader_id": "a", "packs": []}))
    assert pub.consumers.ids() == {"a"}
    assert pub.consumers.skipped_records == 2
    assert [r[0] for r in pub.consumers.pack_requests(0)] == ["a"]
    assert pub.consumers.skipped_records == 4
    assert pub.skipped_records >= 4
    # Steady: the next listing re-reads no record (keys only), but still counts the bad ones.
    rpcs = c.rpcs
    assert pub.consumers.ids() == {"a"}
    assert c.rpcs == rpcs + 1 and pub.consumers.skipped_records == 6

"""Re-serving (put/serving.py) through real stores on real etcd, in one process: a consumer offers
the buffers it just pulled as a source of that step, others read from it after the publisher is
gone, and the offer is withdrawn (and its registrations released) at unserve or the next pull. Each
over shared memory and over tcp (the ``transport`` fixture)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from astate_store.errors import LayoutError, VersionNotFound
from astate_store.store import Store
from tests.support.data import value

SPEC = {"w": ((12, 5), "float32"), "b": ((7,), "bfloat16")}


def _tensors(step: int) -> dict[str, torch.Tensor]:
    return {n: value(n, s, dt, step) for n, (s, dt) in SPEC.items()}


def _bufs() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=getattr(torch, dt)) for n, (s, dt) in SPEC.items()}


@pytest.fixture
def stores(transport_store_factory: Callable[..., Store]) -> tuple[Store, Store, Store]:
    """(publisher, the re-serving consumer, another consumer), over this test's transport."""
    pub, server, late = (transport_store_factory(retire_timeout=5.0, read_timeout=60.0) for _ in range(3))
    return pub, server, late


def test_an_offer_is_a_replica_others_read_after_the_publisher_left(
    stores: tuple[Store, Store, Store],
) -> None:
    pub, server, late = stores
    pub.put(1, _tensors(1))
    bufs = _bufs()
    assert server.get_into(bufs, timeout=30) == 1
    server.serve(1, bufs, group="g1")
    v = late.catalog.versions.read_version(1)
    assert set(v.replicas) == {server.consumer_id} and v.replicas[server.consumer_id].group == "g1"
    assert server.stats.registrations >= 1
    pub.close()  # the trainer's memory is gone: the replica is the only source left
    out = _bufs()
    assert late.get_into(out, step=1, timeout=30) == 1
    for n, t in out.items():
        assert torch.equal(t, value(n, *SPEC[n], 1)), n


def test_the_default_group_is_the_consumers_own(stores: tuple[Store, Store, Store]) -> None:
    pub, server, _late = stores
    pub.put(2, _tensors(2))
    bufs = _bufs()
    server.get_into(bufs, timeout=30)
    server.serve(2, bufs)
    rep = server.catalog.versions.read_version(2).replicas[server.consumer_id]
    assert rep.group == f"solo-{server.consumer_id}"


def test_unserve_withdraws_the_offer_and_releases_its_registrations(
    stores: tuple[Store, Store, Store],
) -> None:
    pub, server, late = stores
    pub.put(1, _tensors(1))
    bufs = _bufs()
    server.get_into(bufs, timeout=30)
    server.serve(1, bufs)
    assert server.stats.registrations >= 1
    assert server.unserve() == 0
    assert late.catalog.versions.read_version(1).replicas == {}
    assert server.stats.registrations == 0  # the buffers are no longer exposed
    assert server.unserve() == 0  # nothing left to withdraw


def test_the_next_pull_withdraws_the_offer_before_writing(stores: tuple[Store, Store, Store]) -> None:
    pub, server, late = stores
    pub.put(1, _tensors(1))
    bufs = _bufs()
    server.get_into(bufs, timeout=30)
    server.serve(1, bufs)
    pub.put(2, _tensors(2))
    assert server.get_into(bufs, step=2, timeout=30) == 2
    assert late.catalog.versions.read_version(1).replicas == {}
    assert all(torch.equal(bufs[n], value(n, *SPEC[n], 2)) for n in SPEC)


def test_only_buffers_the_last_pull_filled_with_that_step_can_be_served(
    stores: tuple[Store, Store, Store],
) -> None:
    pub, server, late = stores
    pub.put(1, _tensors(1))
    with pytest.raises(LayoutError, match="serve\\(\\) of step 1 needs buffers that get_into filled"):
        server.serve(1, _bufs())  # never pulled
    bufs = _bufs()
    server.get_into(bufs, timeout=30)
    with pytest.raises(LayoutError, match="tensor 'b': serve\\(\\) of step 2"):
        server.serve(2, bufs)  # pulled step 1, not 2
    with pytest.raises(LayoutError, match="tensor 'x'"):
        server.serve(1, {**bufs, "x": torch.zeros(3)})
    assert late.catalog.versions.read_version(1).replicas == {}  # nothing was offered
    assert server.stats.registrations == 0


def test_a_failed_offer_leaves_the_buffers_unregistered(stores: tuple[Store, Store, Store]) -> None:
    pub, server, _late = stores
    pub.put(1, _tensors(1))
    bufs = _bufs()
    assert server.get_into(bufs, timeout=30) == 1
    pub.put(2, _tensors(2))
    pub.delete(1)  # dropped between the pull and the offer
    with pytest.raises(VersionNotFound):
        server.serve(1, bufs)
    assert server.get_into(bufs, step=2, timeout=30) == 2
    assert server.transport.num_regions == 0  # type: ignore[attr-defined]
    assert server.stats.registrations == 0


def test_a_view_with_other_strides_is_not_served_as_the_filled_buffer(
    stores: tuple[Store, Store, Store],
) -> None:
    pub, server, late = stores
    w = value("w", (12, 5), "float32", 1)
    pub.put(1, {"w": w})
    filled = torch.zeros(12, 5)
    assert server.get_into({"w": filled}, timeout=30) == 1
    other = torch.as_strided(filled, (12, 5), (1, 12))  # same first byte, other element order
    try:
        server.serve(1, {"w": other})
    except LayoutError:
        return  # refused before anything was offered: what the contract says
    pub.close()  # the replica is the only source now
    out = torch.zeros(12, 5)
    assert late.get_into({"w": out}, step=1, timeout=30) == 1
    assert torch.equal(out, w), "a replica served bytes that are not step 1's tensor as step 1"

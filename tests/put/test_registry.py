"""The registry of caller memory (put/registry.py): least exposure and reference counting.

Single process, one real ``UcxTransport("shm")``: what the registry registers is read back from
the transport itself (``region``, ``num_regions``).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from astate_store.model.validation import Entry, validate_tensors
from astate_store.put.registry import PAGE, Registry, storage_span
from astate_store.transport import UcxTransport


@pytest.fixture
def transport() -> Iterator[UcxTransport]:
    t = UcxTransport("shm")
    yield t
    t.close()


@pytest.fixture
def registry(transport: UcxTransport) -> Registry:
    return Registry(SimpleNamespace(transport=transport))  # what holds the transport (a StoreContext)


def _entries(**tensors: torch.Tensor) -> list[Entry]:
    return validate_tensors(tensors, "test")


def _pages(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) the registry must register for view ``t``: its span rounded out to pages,
    clamped to its storage."""
    st = t.untyped_storage()
    s0, s1 = st.data_ptr(), st.data_ptr() + st.nbytes()
    addr, n = storage_span(t)
    return max(s0, addr - addr % PAGE), min(s1, -(-(addr + n) // PAGE) * PAGE)


def test_storage_span_covers_first_to_last_element() -> None:
    base = torch.zeros(10, 20)
    assert storage_span(base) == (base.data_ptr(), 800)
    col = base[:, 3]  # every 20th float: 9 rows * 80 bytes + one element
    assert storage_span(col) == (base.data_ptr() + 12, 9 * 80 + 4)
    assert storage_span(base.t()) == (base.data_ptr(), 800)
    empty = base[2:2]
    assert storage_span(empty) == (empty.data_ptr(), 0)  # no bytes (torch gives empty views no address)


def test_a_view_is_registered_by_its_pages_not_its_whole_storage(
    registry: Registry, transport: UcxTransport
) -> None:
    storage = torch.zeros(64 * PAGE // 4)  # 64 pages of float32
    view = storage[20 * PAGE // 4 + 5 : 23 * PAGE // 4 + 7]
    (rec,) = registry.acquire("put", _entries(w=view), rank=3)
    info = transport.region(rec.region)
    lo, hi = _pages(view)
    assert (info.base, info.size) == (lo, hi - lo)
    assert info.size <= 5 * PAGE < storage.untyped_storage().nbytes()
    # The record addresses the view's first element inside that region.
    assert rec.byte_offset == view.data_ptr() - info.base
    assert (rec.name, rec.rank, rec.strides, rec.box.sizes) == ("w", 3, (1,), tuple(view.shape))
    assert registry.count == 1 and transport.num_regions == 1


def test_views_of_one_storage_share_a_registration_only_when_their_pages_meet(
    registry: Registry, transport: UcxTransport
) -> None:
    storage = torch.zeros(64 * PAGE // 4)
    per_page = PAGE // 4
    near_a = storage[per_page * 2 : per_page * 3 + 10]  # pages 2-3
    near_b = storage[per_page * 3 + 20 : per_page * 5]  # pages 3-4: overlaps near_a's last page
    far = storage[per_page * 40 : per_page * 41]  # page 40
    recs = {r.name: r for r in registry.acquire("put", _entries(a=near_a, b=near_b, c=far), rank=0)}
    assert recs["a"].region == recs["b"].region != recs["c"].region
    shared = transport.region(recs["a"].region)
    assert (shared.base, shared.base + shared.size) == (_pages(near_a)[0], _pages(near_b)[1])
    for name, view in (("a", near_a), ("b", near_b), ("c", far)):
        info = transport.region(recs[name].region)
        assert info.base + recs[name].byte_offset == view.data_ptr()
        assert recs[name].byte_offset + view.numel() * 4 <= info.size
    assert registry.count == 2
    # Another storage never shares: its own registration.
    other = torch.zeros(per_page)
    (rec,) = registry.acquire("put", _entries(d=other), rank=0)
    assert rec.region not in {recs["a"].region, recs["c"].region} and registry.count == 3


def test_a_covered_view_reuses_the_registration(registry: Registry, transport: UcxTransport) -> None:
    storage = torch.zeros(16 * PAGE // 4)
    (whole,) = registry.acquire("put", _entries(w=storage), rank=0)
    (part,) = registry.acquire("serve", _entries(p=storage[100:200]), rank=0)
    assert part.region == whole.region and part.byte_offset == 400
    assert registry.count == 1 and transport.num_regions == 1


def test_a_registration_lives_while_any_holder_holds_it(registry: Registry, transport: UcxTransport) -> None:
    t = torch.zeros(4 * PAGE // 4)
    entries = _entries(w=t)
    (rec,) = registry.acquire("put", entries, rank=0)
    registry.acquire("serve", _entries(w=t), rank=0)
    assert registry.idle == 0
    assert registry.release("put") == []  # "serve" still holds it
    assert registry.sweep() == 0 and transport.num_regions == 1
    assert registry.release("serve") == [rec.region]
    assert registry.idle == 1
    assert registry.sweep() == 1
    assert registry.count == 0 and transport.num_regions == 0
    assert transport.region(rec.region).size == 0  # unregistered in the transport too
    # Acquiring again registers anew (nothing stale is remembered).
    (again,) = registry.acquire("put", entries, rank=0)
    assert transport.region(again.region).size > 0 and registry.count == 1


def test_release_keeps_the_newest_acquires(registry: Registry) -> None:
    a, b = torch.zeros(PAGE), torch.zeros(PAGE)
    (ra,) = registry.acquire("put", _entries(w=a), rank=0)
    (rb,) = registry.acquire("put", _entries(w=b), rank=0)
    # Only the older acquire (a) is dropped.
    assert registry.release("put", keep_last=1) == [ra.region]
    assert registry.sweep() == 1 and registry.count == 1
    assert registry.release("put") == [rb.region]
    assert registry.release("put") == [] and registry.release("nobody") == []


def test_sweep_of_named_regions_spares_those_acquired_again(
    registry: Registry, transport: UcxTransport
) -> None:
    t = torch.zeros(PAGE)
    entries = _entries(w=t)
    registry.acquire("put", entries, rank=0)
    idle = registry.release("put")
    registry.acquire("put", entries, rank=0)  # wanted again before the sweep
    assert registry.sweep(idle) == 0
    assert registry.count == 1 and transport.num_regions == 1


def test_a_holder_that_never_releases_is_folded_and_released_whole(registry: Registry) -> None:
    t = torch.zeros(PAGE)
    entries = _entries(w=t)
    regions = {registry.acquire("put", entries, rank=0)[0].region for _ in range(10)}
    assert len(regions) == 1  # steady state: the same registration every time
    (region,) = regions
    assert registry.release("put", keep_last=1) == []  # the newest acquire still holds it
    assert registry.release("put") == [region]


def test_an_empty_view_and_a_strided_view_are_published_correctly(
    registry: Registry, transport: UcxTransport
) -> None:
    base = torch.zeros(8, PAGE // 8)
    col = base[:, 5]  # strided: spans the whole storage
    empty = torch.zeros(0)
    recs = {r.name: r for r in registry.acquire("put", _entries(col=col, empty=empty), rank=1)}
    info = transport.region(recs["col"].region)
    assert info.base + recs["col"].byte_offset == col.data_ptr()
    assert recs["col"].strides == (PAGE // 8,)
    assert recs["col"].byte_offset + ((8 - 1) * (PAGE // 8) + 1) * 4 <= info.size
    assert recs["empty"].box.sizes == (0,)
    held = registry.count
    assert len(registry.release("put")) == held and registry.sweep() == held
    assert registry.count == 0 and transport.num_regions == 0

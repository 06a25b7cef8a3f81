"""Versions (catalog/versions.py) on real etcd: layouts written once, pieces and the commit of the
last one, ``latest`` and waiting for it, retention, and deleting a step."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from astate_store.catalog import Catalog
from astate_store.catalog.records import pad20
from astate_store.errors import CatalogError, StaleStepError, VersionNotFound, WaitTimeout
from astate_store.model.layout import Box, ShardRecord

Factory = Callable[..., Catalog]


def _shard(rank: int, world: int) -> ShardRecord:
    per = 8 // world
    return ShardRecord("w", "float32", (8, 4), Box((rank * per, 0), (per, 4)), (4, 1), rank, 0, 0)


def _rank(cat: Catalog, rank: int, world: int, sid: str = "s") -> str:
    cat.sessions.open(rank=rank, world_size=world, session_id=sid)
    return cat.versions.write_layout([_shard(rank, world)], b"rank%d" % rank)


def _keys(cat: Catalog, *parts: str) -> list[str]:
    pre = cat.client.key(*parts) + "/"
    return sorted(m.key.decode()[len(pre) :] for _v, m in cat.client.raw.get_prefix(pre, keys_only=True))


def test_a_layout_is_written_once_per_content(catalog_factory: Factory) -> None:
    cat = catalog_factory()
    lid = _rank(cat, 0, 1)
    epoch = cat.session.epoch  # type: ignore[union-attr]
    rpcs = cat.client.rpcs
    assert cat.versions.write_layout([_shard(0, 1)], b"rank0") == lid
    assert cat.client.rpcs == rpcs  # already written: no request
    assert cat.versions.write_layout([_shard(0, 1)], b"other transport") != lid
    assert len(_keys(cat, "layouts", pad20(epoch), pad20(0))) == 2
    assert len(_keys(cat, "manifests")) == 1  # the same boxes: one manifest
    with pytest.raises(CatalogError, match="was not written by this process"):
        cat.versions.put_piece(1, "0" * 24)


def test_the_last_piece_commits_with_its_offsets(catalog_factory: Factory) -> None:
    r0, r1, reader = catalog_factory(), catalog_factory(), catalog_factory()
    l0, l1 = _rank(r0, 0, 2), _rank(r1, 1, 2)
    assert r0.versions.put_piece(3, l0, base_offset=4096, slot_bases=[0, 4096]) is False
    assert reader.versions.latest() is None and reader.versions.committed_steps() == []
    assert r1.versions.put_piece(3, l1) is True
    assert reader.versions.latest() == 3 and reader.versions.committed_steps() == [3]
    v = reader.versions.read_version(3)
    assert {r: (p.layout_id, p.base_offset, p.slot_bases) for r, p in v.pieces.items()} == {
        0: (l0, 4096, (0, 4096)),
        1: (l1, 0, ()),
    }
    full = reader.versions.layouts_of(v)
    assert not full.missing and [full.layouts[r].transport for r in (0, 1)] == [b"rank0", b"rank1"]


def test_latest_only_moves_forward_and_an_older_step_is_stale(catalog_factory: Factory) -> None:
    cat = catalog_factory(retention=10)
    lid = _rank(cat, 0, 1)
    assert cat.versions.put_piece(5, lid)
    with pytest.raises(StaleStepError):
        cat.versions.put_piece(4, lid)
    assert cat.versions.latest() == 5
    for bad in (-1, 10**19, "7"):
        with pytest.raises(CatalogError):
            cat.versions.put_piece(bad, lid)  # type: ignore[arg-type]


def test_waiting_wakes_on_the_commit_or_times_out(catalog_factory: Factory) -> None:
    pub, waiter = catalog_factory(), catalog_factory()
    lid = _rank(pub, 0, 1)
    with pytest.raises(WaitTimeout):
        waiter.versions.wait_for(None, timeout=0.3)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(waiter.versions.wait_for(2, timeout=60)))
    t.start()
    pub.versions.put_piece(1, lid)  # not enough
    pub.versions.put_piece(2, lid)
    t.join(60)
    assert got == [2]
    assert waiter.versions.wait_for(1, timeout=5) == 2  # the newest known, at least the one asked for


def test_retention_drops_old_versions_and_delete_drops_one(catalog_factory: Factory) -> None:
    cat = catalog_factory(retention=3)
    lid = _rank(cat, 0, 1)
    for step in range(1, 7):
        cat.versions.put_piece(step, lid)
    assert cat.versions.flush_retention(30.0)
    assert cat.versions.committed_steps() == [4, 5, 6]
    with pytest.raises(VersionNotFound):
        cat.versions.read_version(3)
    with pytest.raises(CatalogError, match="newest committed step and cannot be deleted"):
        cat.versions.delete_step(6)
    cat.versions.delete_step(4)
    assert cat.versions.committed_steps() == [5, 6] and _keys(cat, "versions", pad20(4)) == []
    with pytest.raises(VersionNotFound):
        cat.versions.delete_step(4)
    assert len(_keys(cat, "manifests")) == 1  # still used by the kept versions

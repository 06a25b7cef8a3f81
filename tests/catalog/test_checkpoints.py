"""The checkpoint index (catalog/checkpoints.py) on real etcd: complete checkpoints by step,
kept after their writers leave; records that are not what their key says are skipped."""

from __future__ import annotations

from collections.abc import Callable

from astate_store.catalog import Catalog, CheckpointEntry
from astate_store.catalog.records import pad20
from astate_store.model import codec

Factory = Callable[..., Catalog]


def _entry(step: int, uri: str | None = None) -> CheckpointEntry:
    return CheckpointEntry(step, uri or f"file:///ckpt/{step}", 4, 1000 * step, 1700000000.5 + step)


def test_the_index_lists_oldest_first_and_a_step_is_replaced(catalog_factory: Factory) -> None:
    cat = catalog_factory()
    assert cat.checkpoints.list() == []
    for step in (100, 9, 10):
        cat.checkpoints.record(_entry(step))
    assert cat.checkpoints.list() == [_entry(9), _entry(10), _entry(100)]  # numeric, not lexical, order
    cat.checkpoints.record(_entry(10, "s3://bucket/ckpt-10"))
    assert [e.uri for e in cat.checkpoints.list()] == [
        "file:///ckpt/9",
        "s3://bucket/ckpt-10",
        "file:///ckpt/100",
    ]


def test_the_index_outlives_its_writer(catalog_factory: Factory) -> None:
    writer = catalog_factory()
    writer.sessions.open(rank=0, world_size=1)
    writer.checkpoints.record(_entry(3))
    writer.close()  # its leases are revoked; the index is on none
    assert catalog_factory().checkpoints.list() == [_entry(3)]


def test_bad_index_records_are_skipped_and_counted(catalog_factory: Factory) -> None:
    cat, reader = catalog_factory(), catalog_factory()
    cat.checkpoints.record(_entry(5))
    c = cat.client
    c.raw.put(c.key("checkpoints", pad20(6)), b"\x00garbage")
    wrong = _entry(8)
    c.raw.put(
        c.key("checkpoints", pad20(7)),
        codec.encode(
            "checkpoint",
            {"step": wrong.step, "uri": wrong.uri, "world_size": 4, "bytes": 1, "written_at": 1.0},
        ),
    )
    c.raw.put(c.key("checkpoints", "latest"), b"x")
    assert reader.checkpoints.list() == [_entry(5)]
    assert reader.checkpoints.skips.count == 3
    assert reader.skipped_records == 3

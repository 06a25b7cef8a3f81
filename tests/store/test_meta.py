"""State beyond tensors: ``put(..., meta=...)`` commits with the version, ``Store.meta`` reads it
back per rank, checkpoints keep it, and a bad meta record is contained."""

from __future__ import annotations

import pytest
import torch

from astate_store import CatalogCorrupted, LayoutError, VersionNotFound
from astate_store.catalog.records import pad20
from astate_store.model import codec
from astate_store.model.usermeta import MAX_META_BYTES, rng_state, set_rng_state
from astate_store.store import Store
from tests._meta_workers import publisher, rank_meta, rank_tensors
from tests._procs import CTX


def _publish(etcd, ns: str, uri: str, steps: int = 2) -> None:
    out = CTX.Queue()
    procs = [
        CTX.Process(target=publisher, args=(etcd.endpoint, ns, r, steps, uri, out), daemon=True)
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120)[1] for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [0, 1] and all(p.exitcode == 0 for p in procs)


def test_meta_commits_per_rank_and_checkpoints_keep_it(etcd, namespace, tmp_path):
    uri = str(tmp_path / "ckpt")
    _publish(etcd, namespace, uri)
    with Store(namespace, endpoint=etcd.endpoint, transport="shm") as reader:
        # Each rank's own dict, for each retained step; msgpack gives tuples back as lists.
        for step in (1, 2):
            for rank in (0, 1):
                assert reader.meta(step, rank=rank) == rank_meta(rank, step)
        assert reader.meta(rank=1) == rank_meta(1, 2)  # newest committed step by default
        assert reader.meta(2, rank=1, uri=uri) == rank_meta(1, 2)  # from the checkpoint itself
        assert reader.meta(2, rank=5) == {}  # no such rank gave meta
        with pytest.raises(VersionNotFound):
            reader.meta(7)
    # Another namespace restores the checkpoint: its catalog never had step 2, the checkpoint has.
    with Store(namespace + "-r", endpoint=etcd.endpoint, transport="shm") as other:
        buf = torch.zeros(8, 8)
        assert other.restore({"w": buf}, uri=uri) == 2
        expect = torch.cat([rank_tensors(r, 2)["w"].tensor for r in (0, 1)])
        assert torch.equal(buf, expect)
        assert other.meta(2, rank=0) == rank_meta(0, 2)
        assert other.meta(rank=1) == rank_meta(1, 2)


def test_bad_meta_is_refused_before_anything_is_published(etcd, namespace):
    with Store(namespace, endpoint=etcd.endpoint, transport="shm") as store:
        t = {"x": torch.ones(4)}
        bad = [
            ([1, 2], "must be a dict"),
            ({1: "a"}, "is not a string"),
            ({"t": torch.ones(1)}, "Tensor"),
            ({"f": float("nan")}, "finite"),
            ({"big": b"x" * (MAX_META_BYTES + 1)}, "byte limit"),
            ({"n": 2**70}, "64 bits"),
        ]
        for meta, why in bad:
            with pytest.raises(LayoutError, match=why):
                store.put(1, t, meta=meta)
        assert store.latest() is None
        store.put(1, t, meta={"ok": 1})
        assert store.meta(1) == {"ok": 1}


def test_rng_state_round_trips_through_meta(etcd, namespace):
    with Store(namespace, endpoint=etcd.endpoint, transport="shm") as store:
        torch.manual_seed(3)
        store.put(1, {"x": torch.ones(2)}, meta={"rng": rng_state()})
        expect = torch.rand(5)
        torch.manual_seed(99)
        set_rng_state(store.meta(1)["rng"])
        assert torch.equal(torch.rand(5), expect)


def test_a_garbage_meta_record_is_a_typed_error_and_harms_nothing_else(etcd, namespace):
    with Store(namespace, endpoint=etcd.endpoint, transport="shm") as store:
        store.put(1, {"x": torch.arange(4.0)}, meta={"a": 1})
        raw, key = store.catalog.client.raw, store.catalog.client.key
        epoch = store.catalog.session.epoch
        raw.put(key("meta", pad20(1), pad20(epoch), pad20(0)), b"\x93garbage")
        skipped = store.stats.bad_records
        with pytest.raises(CatalogCorrupted):
            store.meta(1)
        assert store.stats.bad_records == skipped + 1
        # A well-formed record of another rank under rank 0's key is refused too.
        raw.put(
            key("meta", pad20(1), pad20(epoch), pad20(0)),
            codec.encode("meta", {"step": 1, "epoch": epoch, "rank": 3, "data": b"\x80"}),
        )
        with pytest.raises(CatalogCorrupted, match="another version or rank"):
            store.meta(1)
        with Store(namespace, endpoint=etcd.endpoint, transport="shm") as reader:
            buf = torch.zeros(4)
            assert reader.get_into({"x": buf}, timeout=30) == 1 and torch.equal(buf, torch.arange(4.0))


def test_meta_after_reading_the_version_is_one_request_of_the_committing_epoch(etcd, namespace):
    with Store(namespace, endpoint=etcd.endpoint, transport="shm") as store:
        store.put(1, {"x": torch.arange(4.0)}, meta={"a": 1})
        raw, key = store.catalog.client.raw, store.catalog.client.key
        epoch = store.catalog.session.epoch
        # a leftover of another (fenced) epoch under the same step must never be the answer
        raw.put(
            key("meta", pad20(1), pad20(epoch + 1), pad20(0)),
            codec.encode("meta", {"step": 1, "epoch": epoch + 1, "rank": 0, "data": b"\x81\xa1a\x02"}),
        )
        with Store(namespace, endpoint=etcd.endpoint, transport="shm") as reader:
            assert reader.meta(1) == {"a": 1}  # cold: the commit, then its epoch's record
            assert set(reader.keys(1)) == {"x"}  # reads the version: its epoch is remembered
            before = reader.catalog.client.rpcs
            assert reader.meta(1) == {"a": 1}
            assert reader.catalog.client.rpcs == before + 1
            assert reader.meta(1, rank=4) == {}  # no record: the commit is read to tell why
            with pytest.raises(VersionNotFound):
                reader.meta(9)

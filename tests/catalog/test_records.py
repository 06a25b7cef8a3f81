"""Decoding the catalog's records (catalog/records.py): every record is checked against its
schema and its key; what a version does not need is skipped and reported, what it needs is a
typed error. Pure functions: records are encoded here exactly as the catalog writes them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from astate_store.catalog.records import (
    Skips,
    counter_value,
    is_record_id,
    numbered_records,
    pad20,
    parse_pad20,
    version_from_kvs,
)
from astate_store.catalog.shard_tables import (
    layout_from_record,
    layout_record,
    manifest_from_record,
    manifest_record,
)
from astate_store.errors import CatalogCorrupted, CodecError, VersionNotFound
from astate_store.model import codec
from astate_store.model.layout import Box, ShardRecord

NS = "rec-test"
LID = "0123456789abcdef01234567"  # a well-formed content address


@dataclass
class _Meta:
    """What etcd's range read gives per key besides the value."""

    key: bytes
    mod_revision: int = 1


def _kv(key: str, value: bytes, rev: int = 1) -> tuple[bytes, _Meta]:
    return value, _Meta(key.encode(), rev)


def _shards(rank: int = 0) -> list[ShardRecord]:
    return [
        ShardRecord("w", "float32", (8, 4), Box((4, 0), (4, 4)), (4, 1), rank, 2, 256),
        ShardRecord("b", "bfloat16", (6,), Box((0,), (6,)), (1,), rank, 2, 0),
    ]


class _Reported:
    def __init__(self) -> None:
        self.keys: list[str] = []
        self.why: list[str] = []

    def __call__(self, key: str, why: str, rev: int | None) -> None:
        self.keys.append(key)
        self.why.append(why)


# ---- key numbers and ids --------------------------------------------------------------------


def test_pad20_orders_lexically_as_numbers_and_parses_only_its_own_form() -> None:
    steps = [0, 7, 10, 99, 100, 2**40]
    assert sorted(map(pad20, steps)) == [pad20(s) for s in sorted(steps)]
    assert all(parse_pad20(pad20(s)) == s for s in steps)
    for bad in (
        " " + pad20(7)[1:],
        "+" + pad20(7)[1:],
        pad20(7)[:-1],
        pad20(7) + "0",
        "1_" + pad20(7)[2:],
        "",
        "0" * 19 + "x",
        "٠" * 20,
    ):
        assert parse_pad20(bad) is None, bad


def test_record_ids_are_24_lowercase_hex_digits() -> None:
    assert is_record_id(LID)
    for bad in (LID.upper(), LID[:-1], LID + "0", LID[:-1] + "g", 12, None, b"0123456789abcdef01234567"):
        assert not is_record_id(bad), bad


def test_a_counter_that_is_not_one_is_corruption_naming_its_key() -> None:
    assert counter_value("/astate/x/latest", codec.encode_counter(42)) == 42
    with pytest.raises(CatalogCorrupted, match="counter /astate/x/latest is corrupted") as info:
        counter_value("/astate/x/latest", b"forty-two")
    assert info.value.key == "/astate/x/latest"


# ---- skips ----------------------------------------------------------------------------------


def test_skips_count_every_time_and_log_each_key_and_revision_once(caplog: pytest.LogCaptureFixture) -> None:
    skips = Skips(NS, "bad thing")
    with caplog.at_level(logging.WARNING, logger="astate_store.catalog"):
        for _ in range(3):
            skips("/k1", "garbage", 5)
        skips("/k1", "garbage again", 6)  # rewritten: a new revision is logged again
        skips("/k2", "other", 5)
    assert skips.count == 5
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"namespace {NS}: skipping bad thing record /k1: garbage",
        f"namespace {NS}: skipping bad thing record /k1: garbage again",
        f"namespace {NS}: skipping bad thing record /k2: other",
    ]


def test_a_flood_of_bad_records_logs_a_bounded_burst(caplog: pytest.LogCaptureFixture) -> None:
    skips = Skips(NS, "flood")
    with caplog.at_level(logging.WARNING, logger="astate_store.catalog"):
        for i in range(500):
            skips(f"/k{i}", "bad", 1)
    assert skips.count == 500
    assert len(caplog.records) == Skips._BURST


def test_numbered_records_yield_the_good_and_skip_the_rest() -> None:
    pre = "/astate/ns/members/"

    def member(rank: int) -> bytes:
        return codec.encode("member", {"epoch": 1, "rank": rank, "host": "h", "pid": 1})

    kvs = [
        _kv(pre + pad20(0), member(0), 3),
        _kv(pre + "7", member(7)),
        _kv(pre + pad20(2), b"\x00junk"),
        _kv(pre + pad20(1), member(9), 4),
    ]
    skips = Skips(NS, "member")
    got = [(k, n, d["rank"], rev) for k, n, d, rev in numbered_records(kvs, pre, "member", skips, "member")]
    # The number is the key's; whether the record agrees with it is the caller's check.
    assert got == [(pre + pad20(0), 0, 0, 3), (pre + pad20(1), 1, 9, 4)]
    assert skips.count == 2


# ---- manifests and layouts ------------------------------------------------------------------


def test_a_manifest_round_trips_and_is_checked_against_its_id() -> None:
    rec = codec.decode("manifest", codec.encode("manifest", manifest_record(_shards())))
    mid = rec["manifest_id"]
    assert is_record_id(mid)
    man = manifest_from_record(rec, mid)
    assert man.names == ("w", "b")
    # Boxes only: addresses come from a layout (contiguous at 0 without one).
    assert man.records(3) == tuple(
        ShardRecord(s.name, s.dtype, s.global_shape, s.box, s.strides, 3, 0, 0) for s in _shards()
    )
    with pytest.raises(CodecError, match="content does not match its id"):
        manifest_from_record(rec, "f" * 24)
    forged = dict(rec, names=["w", "c"])  # different content under the honest id
    with pytest.raises(CodecError, match="content does not match its id"):
        manifest_from_record(forged, mid)


def test_a_manifest_whose_box_leaves_its_tensor_is_refused() -> None:
    outside = [ShardRecord("w", "float32", (8, 4), Box((0, 0), (8, 4)), (4, 1), 0, 0, 0)]
    rec = manifest_record(outside)
    rec["sizes"] = np.array([9, 4], dtype=np.int64).tobytes()
    rec["manifest_id"] = ""
    from astate_store.catalog.shard_tables import manifest_id_of  # the honest id of the forged columns

    rec["manifest_id"] = manifest_id_of(rec)
    with pytest.raises(CodecError, match="outside its tensor's global shape"):
        manifest_from_record(rec, rec["manifest_id"])


def test_a_layout_round_trips_and_must_be_what_its_key_says() -> None:
    shards = _shards(rank=1)
    packed = [ShardRecord("w", "float32", (8, 4), Box((4, 1), (4, 2)), (2, 1), 1, 2, 4096)]
    man = manifest_from_record(manifest_record(shards), manifest_record(shards)["manifest_id"])
    rec = codec.decode("layout", codec.encode("layout", layout_record(5, 1, man, shards, b"desc", packed)))
    lid = rec["layout_id"]
    lay = layout_from_record(rec, man, key_id=lid, epoch=5, rank=1)
    assert (lay.layout_id, lay.epoch, lay.rank, lay.transport, lay.manifest_id) == (
        lid,
        5,
        1,
        b"desc",
        man.manifest_id,
    )
    assert list(lay.shards) == shards and lay.packed == tuple(packed)
    with pytest.raises(CodecError, match="content does not match its id"):
        layout_from_record(rec, man, key_id=LID)
    with pytest.raises(CodecError, match="differ from its key 6/1"):
        layout_from_record(rec, man, key_id=lid, epoch=6, rank=1)
    with pytest.raises(CodecError, match="differ from its key 5/0"):
        layout_from_record(rec, man, key_id=lid, epoch=5, rank=0)
    other = manifest_from_record(manifest_record(shards[:1]), manifest_record(shards[:1])["manifest_id"])
    with pytest.raises(CodecError, match="refers to manifest"):
        layout_from_record(rec, other, key_id=lid)
    # Another transport descriptor is another layout: a different id.
    assert layout_record(5, 1, man, shards, b"other", packed)["layout_id"] != lid


# ---- versions -------------------------------------------------------------------------------


def _vkey(step: int, *tail: str) -> str:
    return f"/astate/{NS}/versions/{pad20(step)}/" + "/".join(tail)


def _commit(step: int, epoch: int, world: int) -> tuple[bytes, _Meta]:
    return _kv(
        _vkey(step, "commit"),
        codec.encode("commit", {"step": step, "epoch": epoch, "world_size": world, "committed_at": 1.0}),
    )


def _piece(
    step: int, epoch: int, rank: int, world: int, fields: dict[str, Any] | None = None
) -> tuple[bytes, _Meta]:
    """The piece record at its key; ``fields`` override what the record itself says."""
    rec = {
        "step": step,
        "epoch": epoch,
        "rank": rank,
        "world_size": world,
        "layout_id": LID,
        "base_offset": 256 * rank,
        "manifest_id": LID,
    }
    rec.update(fields or {})
    return _kv(_vkey(step, "pieces", pad20(epoch), pad20(rank)), codec.encode("piece", rec))


def _replica(step: int, group: str, member: str, fields: dict[str, Any] | None = None) -> tuple[bytes, _Meta]:
    rec = {"step": step, "group": group, "member": member, "layout_id": LID, "manifest_id": LID}
    rec.update(fields or {})
    return _kv(_vkey(step, "replicas", group, member), codec.encode("replica", rec))


def test_a_version_is_its_commit_and_the_pieces_of_the_committing_epoch() -> None:
    kvs = [
        _commit(3, 2, 2),
        _piece(3, 2, 0, 2),
        _piece(3, 2, 1, 2, {"slot_bases": [0, 4096]}),
        _piece(3, 1, 0, 2, {"layout_id": "f" * 24}),  # a fenced session's leftover: not read, not reported
        _replica(3, "g", "m1"),
    ]
    rep = _Reported()
    v = version_from_kvs(NS, 3, kvs, rep)
    assert (v.step, v.epoch, v.world_size) == (3, 2, 2)
    assert {r: (p.layout_id, p.base_offset, p.slot_bases) for r, p in v.pieces.items()} == {
        0: (LID, 0, ()),
        1: (LID, 256, (0, 4096)),
    }
    assert set(v.replicas) == {"m1"} and v.replicas["m1"].group == "g"
    assert rep.keys == []


def test_records_a_version_can_do_without_are_skipped_and_reported() -> None:
    bad = [
        (_kv(_vkey(3, "replicas", "g", "m2"), b"\x00garbage"), "replica"),
        (_replica(3, "g", "m3", {"member": "someone-else"}), "another step, group or member"),
        (_replica(3, "g", "m4", {"layout_id": "../../etc"}), "not a content address"),
        (_kv(_vkey(3, "stray"), b"x"), "not a key of a version"),
        (_kv(f"/astate/{NS}/versions/{pad20(4)}/commit", b"x"), "not a key of this version"),
        (_kv(_vkey(3, "pieces", "7", pad20(0)), b"x"), "epoch and rank are 20 digits"),
        (_piece(3, 2, 5, 2), "outside the committed world size 1"),
    ]
    kvs = [_commit(3, 2, 1), _piece(3, 2, 0, 1), _replica(3, "g", "m1")] + [kv for kv, _ in bad]
    rep = _Reported()
    v = version_from_kvs(NS, 3, kvs, rep)
    assert set(v.pieces) == {0} and set(v.replicas) == {"m1"}
    assert rep.keys == [kv[1].key.decode() for kv, _ in bad]
    for why, (_pair, want) in zip(rep.why, bad):
        assert want in why, (why, want)


def test_records_a_version_needs_are_typed_errors() -> None:
    with pytest.raises(VersionNotFound, match="step 3 is not committed"):
        version_from_kvs(NS, 3, [_piece(3, 1, 0, 1)])
    with pytest.raises(CatalogCorrupted, match="commit record .* is corrupted"):
        version_from_kvs(NS, 3, [_kv(_vkey(3, "commit"), b"\x00"), _piece(3, 1, 0, 1)])
    with pytest.raises(CatalogCorrupted, match="is of step 4"):
        version_from_kvs(NS, 3, [_kv(_vkey(3, "commit"), _commit(4, 1, 1)[0]), _piece(3, 1, 0, 1)])
    # A committed piece missing, undecodable, or naming another step / rank: the version is not whole.
    for pieces in (
        [_piece(3, 1, 0, 2)],
        [_piece(3, 1, 0, 2), _kv(_vkey(3, "pieces", pad20(1), pad20(1)), b"\x00")],
        [_piece(3, 1, 0, 2), _piece(3, 1, 1, 2, {"step": 9})],
        [_piece(3, 1, 0, 2), _piece(3, 1, 1, 2, {"layout_id": "not-an-id"})],
    ):
        rep = _Reported()
        with pytest.raises(CatalogCorrupted, match=r"pieces of ranks \[1\] are missing or bad"):
            version_from_kvs(NS, 3, [_commit(3, 1, 2), *pieces], rep)
    # A world size no piece can fill is reported without enumerating it.
    with pytest.raises(CatalogCorrupted, match=r"ranks \[1, 2, 3, 4, 5, 6, 7, 8\] \.\.\."):
        version_from_kvs(NS, 3, [_commit(3, 1, 10**15), _piece(3, 1, 0, 10**15)])


def test_a_delta_record_of_another_tile_format_is_refused() -> None:
    """A change map is read only by a reader of its tile format (model/delta_format.py FORMAT):
    a record of another (an older publisher's) fails its schema, so its version is pulled whole."""
    from astate_store.catalog.deltas import Delta, delta_from_record, delta_record

    d = Delta(3, 0, 4096, 10, 8192, 640, 200, 10_000, 0x1234)
    rec = delta_record(4, 1, 0, LID, d)
    assert delta_from_record(codec.encode("delta", rec), 4, 1, 0, LID) == d
    for other in ({**rec, "format": 1}, {k: v for k, v in rec.items() if k != "format"}):
        data = _raw("delta", other)
        with pytest.raises(CodecError):
            delta_from_record(data, 4, 1, 0, LID)


def _raw(kind: str, record: dict[str, Any]) -> bytes:
    """A record encoded without the encoder's check (as another build would write it)."""
    import msgpack

    return msgpack.packb({"schema": f"{kind}/{codec.SCHEMA_VERSION}", **record}, use_bin_type=True)

"""Codec: msgpack records checked against schemas/*.json, both by our codec and by jsonschema."""

from __future__ import annotations

import base64
import json
import pickle
import random

import jsonschema
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astate_store.catalog.blobs import CHUNK_BYTES, blob_from_kvs, blob_requests
from astate_store.catalog.shard_tables import (
    layout_from_record,
    layout_record,
    manifest_from_record,
    manifest_record,
)
from astate_store.errors import CodecError
from astate_store.model import codec
from astate_store.model.layout import Box, ShardRecord

ints = st.integers(min_value=0, max_value=2**62)
names = st.from_regex(r"[A-Za-z0-9_.\-]{1,12}(/[A-Za-z0-9_.\-]{1,8}){0,2}", fullmatch=True).filter(
    lambda s: ".." not in s.split("/")
)


@st.composite
def shards(draw: st.DrawFn) -> ShardRecord:
    nd = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(1, 64), min_size=nd, max_size=nd)))
    offs = tuple(draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offs))
    return ShardRecord(
        draw(names),
        draw(st.sampled_from(["float32", "bfloat16", "int8", "float8_e4m3fn"])),
        shape,
        Box(offs, sizes),
        tuple(draw(st.lists(ints, min_size=nd, max_size=nd))),
        0,
        draw(st.integers(0, 100)),
        draw(ints),
    )


shard_lists = st.lists(shards(), max_size=5)
manifests = shard_lists.map(manifest_record)
layouts = st.builds(
    lambda e, sh, t: layout_record(e, 0, manifest_record(sh), sh, t),
    ints,
    shard_lists,
    st.binary(max_size=64),
)
hexid = st.from_regex(r"[0-9a-f]{24}", fullmatch=True)
pieces = st.builds(
    lambda s, e, r, w, l, b, m: {
        "step": s,
        "epoch": e,
        "rank": r,
        "world_size": w,
        "layout_id": l,
        "base_offset": b,
        "manifest_id": m,
    },
    ints,
    ints,
    ints,
    st.integers(1, 10**6),
    st.text(),
    ints,
    hexid,
)
descs = st.builds(
    lambda a, h, regs: {"kind": "ucx", "worker_address": a, "host": h, "regions": regs},
    st.binary(max_size=200),
    st.text(max_size=20),
    st.lists(
        st.builds(
            lambda b, s, k, m: {"base": b, "size": s, "rkey": k, "memory_type": m},
            ints,
            ints,
            st.binary(max_size=40),
            st.sampled_from(["host", "cuda"]),
        ),
        max_size=4,
    ),
)


def _as_json(v: object) -> object:
    if isinstance(v, bytes):
        return base64.b64encode(v).decode()
    if isinstance(v, dict):
        return {k: _as_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_as_json(x) for x in v]
    return v


def _jsonschema_check(kind: str, data: bytes) -> None:
    raw = msgpack.unpackb(data, raw=False)
    jsonschema.Draft202012Validator(codec.schema_of(kind)).validate(_as_json(raw))


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        layouts.map(lambda r: ("layout", r)),
        manifests.map(lambda r: ("manifest", r)),
        pieces.map(lambda r: ("piece", r)),
        descs.map(lambda r: ("ucx_descriptor", r)),
    )
)
def test_round_trip_and_schema(kind_rec: tuple[str, dict]) -> None:
    kind, rec = kind_rec
    data = codec.encode(kind, rec)
    assert codec.decode(kind, data) == rec
    _jsonschema_check(kind, data)


@settings(max_examples=60, deadline=None)
@given(pieces, st.data())
def test_truncated_bytes_are_rejected(rec: dict, data: st.DataObject) -> None:
    raw = codec.encode("piece", rec)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CodecError):
        codec.decode("piece", raw[:cut])


commits = st.builds(
    lambda s, e, w, t: {"step": s, "epoch": e, "world_size": w, "committed_at": t},
    ints,
    ints,
    st.integers(1, 10**6),
    st.floats(0, 2e9, allow_nan=False),
)


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        commits.map(lambda r: (r, msgpack.packb({"schema": "commit/1", **r}))),
        st.binary(max_size=64).map(lambda b: (None, b)),
    )
)
def test_garbage_is_refused_and_valid_records_decode(case: tuple[dict | None, bytes]) -> None:
    """Bytes decode exactly when they are a valid commit record: the record comes back whole; any
    other bytes raise ``CodecError`` (never another exception, never a half-filled record)."""
    rec, raw = case
    if rec is not None:
        assert codec.decode("commit", raw) == rec
        return
    try:
        got = codec.decode("commit", raw)
    except CodecError:
        return
    # random bytes that happen to decode must really be a complete, valid commit record
    assert set(got) == {"step", "epoch", "world_size", "committed_at"}
    _jsonschema_check("commit", raw)


def test_every_schema_file_is_valid_json_schema() -> None:
    files = sorted(codec.schema_dir().glob("*.json"))
    assert {f.stem for f in files} >= set(codec.KINDS) | {"counter"}
    for f in files:
        jsonschema.Draft202012Validator.check_schema(json.loads(f.read_text()))


def test_unknown_schema_version() -> None:
    raw = msgpack.packb({"schema": "commit/2", "step": 1, "epoch": 1, "world_size": 1, "committed_at": 0.0})
    with pytest.raises(CodecError, match="unknown schema version"):
        codec.decode("commit", raw)


def test_wrong_kind_missing_and_extra_fields() -> None:
    c = codec.encode("commit", {"step": 1, "epoch": 1, "world_size": 1, "committed_at": 0.0})
    with pytest.raises(CodecError, match="expected a piece record, got a commit"):
        codec.decode("piece", c)
    bad = msgpack.packb({"schema": "commit/1", "step": 1, "epoch": 1, "world_size": 1})
    with pytest.raises(CodecError, match="missing field 'committed_at'"):
        codec.decode("commit", bad)
    with pytest.raises(CodecError, match="unknown field 'extra'"):
        codec.encode("commit", {"step": 1, "epoch": 1, "world_size": 1, "committed_at": 0.0, "extra": 1})
    with pytest.raises(CodecError, match=r"world_size.*minimum"):
        codec.encode("commit", {"step": 1, "epoch": 1, "world_size": 0, "committed_at": 0.0})
    with pytest.raises(CodecError, match="trailing"):
        codec.decode("commit", c + b"\x00")
    with pytest.raises(CodecError, match="expected a map"):
        codec.decode("commit", msgpack.packb([1, 2]))


@pytest.mark.parametrize(
    "bad, why", [(7, "expected string"), ("a b", "does not match"), (b"x", "expected string")]
)
def test_a_bad_item_of_a_long_array_is_named(bad: object, why: str) -> None:
    # 10^4 names are checked in one pass; a bad one is still found and named by its index
    rec = manifest_record(
        [ShardRecord(f"t{i:05d}", "float32", (2,), Box((0,), (2,)), (1,), 0, 0, 0) for i in range(10_000)]
    )
    codec.validate("manifest", {"schema": "manifest/1", **rec})
    rec["names"][4321] = bad
    with pytest.raises(CodecError, match=rf"names\[4321\].*{why}"):
        codec.validate("manifest", {"schema": "manifest/1", **rec})


def test_piece_slot_bases_are_optional_and_bounded() -> None:
    rec = {
        "step": 1,
        "epoch": 1,
        "rank": 0,
        "world_size": 1,
        "layout_id": "x",
        "base_offset": 4096,
        "manifest_id": "0" * 24,
    }
    assert "slot_bases" not in codec.decode("piece", codec.encode("piece", rec))
    assert codec.decode("piece", codec.encode("piece", {**rec, "slot_bases": [0, 4096]}))["slot_bases"] == [
        0,
        4096,
    ]
    with pytest.raises(CodecError, match=r"slot_bases.*at most 64"):
        codec.encode("piece", {**rec, "slot_bases": list(range(65))})
    with pytest.raises(CodecError, match=r"slot_bases\[1\].*minimum"):
        codec.encode("piece", {**rec, "slot_bases": [0, -1]})


def test_counters() -> None:
    assert codec.decode_counter(codec.encode_counter(42)) == 42
    assert codec.encode_counter(None) == b"" and codec.decode_counter(b"") is None
    assert codec.encode_counter(9) < codec.encode_counter(10)  # bytewise order is numeric order
    with pytest.raises(CodecError):
        codec.decode_counter(b"12x")
    with pytest.raises(CodecError):
        codec.encode_counter(-1)


@settings(max_examples=40, deadline=None)
@given(shard_lists, st.integers(0, 9), st.binary(max_size=32))
def test_columnar_layouts_give_back_the_shards(shs: list, rank: int, transport: bytes) -> None:
    recs = [
        ShardRecord(s.name, s.dtype, s.global_shape, s.box, s.strides, rank, s.region, s.byte_offset)
        for s in shs
    ]
    man = manifest_record(recs)
    lay = layout_record(3, rank, man, recs, transport)
    m = manifest_from_record(codec.decode("manifest", codec.encode("manifest", man)), man["manifest_id"])
    back = layout_from_record(
        codec.decode("layout", codec.encode("layout", lay)), m, key_id=lay["layout_id"], epoch=3, rank=rank
    )
    assert len(back.shards) == len(recs) and "built" not in repr(back.shards)  # records built on first use
    assert list(back.shards) == recs and back.transport == transport
    assert back.shards == tuple(recs) and hash(back.shards) == hash(tuple(recs))
    assert pickle.loads(pickle.dumps(back)).shards == tuple(recs)  # pickles as the tuple of its records
    if (
        back.columns.spans is not None
    ):  # byte ranges near 2**62 (these strides) overflow int64: left to the records
        assert back.columns.spans.tolist() == [[r.region, *r.byte_range(r.box)] for r in recs]


small = st.integers(min_value=0, max_value=2**20)


@st.composite
def addressed_shards(draw: st.DrawFn) -> ShardRecord:
    """Shards with addresses a real layout has (empty boxes and 0-d tensors too)."""
    nd = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 64), min_size=nd, max_size=nd)))
    offs = tuple(draw(st.integers(0, s)) for s in shape)
    sizes = tuple(draw(st.integers(0, s - o)) for s, o in zip(shape, offs))
    return ShardRecord(
        draw(names),
        draw(st.sampled_from(["float32", "bfloat16", "int8", "float64"])),
        shape,
        Box(offs, sizes),
        tuple(draw(st.lists(small, min_size=nd, max_size=nd))),
        0,
        draw(st.integers(0, 100)),
        draw(small),
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(addressed_shards(), max_size=8))
def test_layout_spans_are_each_shards_byte_range(recs: list[ShardRecord]) -> None:
    """``Layout.columns.spans`` (column-wise, for a first pull's warm hint) is what each record's
    ``byte_range`` of its whole box says, empty boxes and 0-d tensors included."""
    man = manifest_record(recs)
    lay = layout_record(1, 0, man, recs, b"")
    back = layout_from_record(lay, manifest_from_record(man, man["manifest_id"]), key_id=lay["layout_id"])
    assert back.columns.spans is not None
    assert back.columns.spans.tolist() == [[r.region, *r.byte_range(r.box)] for r in recs]


def test_records_that_are_not_what_their_key_says_are_rejected() -> None:
    recs = [ShardRecord("w", "float32", (8, 4), Box((0, 0), (4, 4)), (4, 1), 1, 2, 64)]
    man = manifest_record(recs)
    lay = layout_record(5, 1, man, recs, b"t")
    m = manifest_from_record(man, man["manifest_id"])
    with pytest.raises(CodecError, match="does not match its id"):
        manifest_from_record({**man, "names": ["x"]}, man["manifest_id"])  # content changed under its id
    with pytest.raises(CodecError, match="does not match its id"):
        layout_from_record(lay, m, key_id="0" * 24)  # filed under another layout's id
    with pytest.raises(CodecError, match="differ from its key"):
        layout_from_record(lay, m, key_id=lay["layout_id"], epoch=5, rank=0)  # another rank's key
    bad = manifest_record([ShardRecord("w", "float32", (8, 4), Box((6, 0), (4, 4)), (4, 1), 0, 0, 0)])
    with pytest.raises(CodecError, match="outside its tensor"):
        manifest_from_record(bad, bad["manifest_id"])


class _Meta:
    def __init__(self, key: str):
        self.key = key.encode()


@pytest.mark.parametrize("size", [0, 100, 5000, 3 * CHUNK_BYTES + 17])
def test_blobs_round_trip_and_detect_damage(size: int) -> None:
    data = random.Random(size).randbytes(size)  # incompressible: the large one is chunked
    chunks, head = blob_requests("/k/b", data)
    assert bool(chunks) == (size > CHUNK_BYTES)
    kvs = [(op.value, _Meta(op.key)) for ops in chunks for op in ops] + [(head.value, _Meta(head.key))]
    assert blob_from_kvs("/k/b", kvs) == data
    assert blob_from_kvs("/k/b", kvs[:-1]) is None  # no head yet: not there (never half a record)
    if chunks:
        with pytest.raises(CodecError, match="chunks"):
            blob_from_kvs("/k/b", kvs[1:])  # a chunk missing
        damaged = [(v[:-1] + b"?", m) if i == 0 else (v, m) for i, (v, m) in enumerate(kvs)]
        with pytest.raises(CodecError, match="digest"):
            blob_from_kvs("/k/b", damaged)

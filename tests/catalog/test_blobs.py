"""Records of any size (catalog/blobs.py): written to real etcd and read back in one range read,
whole or not at all; every way a stored blob can be wrong is a CodecError, never wrong bytes."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import xxhash
from pyetcd import transactions as tx

from astate_store.catalog import Catalog
from astate_store.catalog.blobs import CHUNK_BYTES, blob_from_kvs, blob_range, blob_requests
from astate_store.errors import CodecError
from astate_store.etcd.client import EtcdClient
from astate_store.model import codec


def _write(c: EtcdClient, key: str, data: bytes, lease: int | None = None) -> int:
    """Chunks first, then the head, as the catalog writes them; returns the chunk count."""
    chunks, head = blob_requests(key, data, lease)
    for ops in chunks:
        c.txn("chunk", [], ops)
    c.txn("head", [], [head])
    return len(chunks)


def _kvs(c: EtcdClient, key: str) -> list[tuple[bytes, Any]]:
    _ok, resp = c.txn("get blob", [], [tx.Get(*blob_range(key))])
    return list(resp[0])


def _read(c: EtcdClient, key: str) -> bytes | None:
    return blob_from_kvs(key, _kvs(c, key))


def _head(c: EtcdClient, key: str) -> dict[str, Any]:
    raw, _ = c.raw.get(key)
    return codec.decode("blob", raw)


def _put_head(c: EtcdClient, key: str, stored: bytes, **over: Any) -> None:
    head = {
        "size": len(stored),
        "codec": "none",
        "digest": xxhash.xxh3_64_hexdigest(stored),
        "chunks": 0,
        "data": stored,
    }
    head.update(over)
    c.raw.put(key, codec.encode("blob", head))


@pytest.fixture
def client(catalog_factory: Callable[..., Catalog]) -> EtcdClient:
    return catalog_factory().client


def test_a_small_blob_is_one_inline_head(client: EtcdClient) -> None:
    key = client.key("blobs", "small")
    assert _write(client, key, b"hello") == 0
    assert _read(client, key) == b"hello"
    head = _head(client, key)
    assert (head["size"], head["codec"], head["chunks"], head["data"]) == (5, "none", 0, b"hello")
    assert len(_kvs(client, key)) == 1
    assert _write(client, client.key("blobs", "empty"), b"") == 0
    assert _read(client, client.key("blobs", "empty")) == b""


def test_a_repetitive_blob_is_compressed_and_an_incompressible_one_is_not(client: EtcdClient) -> None:
    rep = b"layer.0.attention.qkv.weight float32 (4096, 4096)\n" * 400
    noise = os.urandom(20_000)
    for name, data, how in (("rep", rep, "zlib"), ("noise", noise, "none"), ("edge", b"a" * 4096, "none")):
        key = client.key("blobs", name)
        _write(client, key, data)
        head = _head(client, key)
        assert head["codec"] == how and head["size"] == len(data), name
        assert _read(client, key) == data, name
    assert len(_head(client, client.key("blobs", "rep"))["data"]) < len(rep) // 10


def test_a_blob_over_one_request_is_chunked_and_read_back_whole(client: EtcdClient) -> None:
    data = os.urandom(2 * CHUNK_BYTES + 12345)  # incompressible: three chunks
    key = client.key("blobs", "big")
    assert _write(client, key, data) == 3
    keys = sorted(m.key.decode() for _v, m in _kvs(client, key))
    assert keys == [key, key + "/000000", key + "/000001", key + "/000002"]
    assert _head(client, key)["chunks"] == 3 and "data" not in _head(client, key)
    assert _read(client, key) == data


def test_chunks_without_their_head_read_as_absent(client: EtcdClient) -> None:
    key = client.key("blobs", "half")
    chunks, _head_put = blob_requests(key, os.urandom(CHUNK_BYTES + 1))
    for ops in chunks:  # a writer that died before its head
        client.txn("chunk", [], ops)
    assert len(_kvs(client, key)) == 2
    assert _read(client, key) is None
    assert _read(client, client.key("blobs", "never")) is None


def test_a_missing_or_corrupted_chunk_is_refused(client: EtcdClient) -> None:
    data = os.urandom(CHUNK_BYTES + 100)
    key = client.key("blobs", "c")
    _write(client, key, data)
    good = client.raw.get(key + "/000001")[0]
    client.raw.put(key + "/000001", bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(CodecError, match="digest mismatch"):
        _read(client, key)
    client.raw.delete(key + "/000001")
    with pytest.raises(CodecError, match=r"expected chunks 0\.\.1, found \[0\]"):
        _read(client, key)
    client.raw.put(key + "/000001", good)
    client.raw.put(key + "/000007", b"extra")
    with pytest.raises(CodecError, match="expected chunks 0..1"):
        _read(client, key)
    client.raw.delete(key + "/000007")
    assert _read(client, key) == data


def test_keys_that_are_not_chunks_of_the_blob_are_ignored(client: EtcdClient) -> None:
    key = client.key("blobs", "k")
    _write(client, key, b"payload")
    client.raw.put(key + "x", b"a sibling key in the same range")
    client.raw.put(key + "/notes", b"not a chunk number")
    assert len(_kvs(client, key)) == 3
    assert _read(client, key) == b"payload"


def test_heads_that_lie_are_refused(client: EtcdClient) -> None:
    key = client.key("blobs", "lie")
    _put_head(client, key, b"twelve bytes", size=13)
    with pytest.raises(CodecError, match="12 bytes, head says 13"):
        _read(client, key)
    _put_head(client, key, b"abc", digest="0" * 16)
    with pytest.raises(CodecError, match="digest mismatch"):
        _read(client, key)
    # zlib: a bomb that inflates past the size its head claims stops at that size.
    bomb = zlib.compress(b"\0" * (8 << 20))
    _put_head(client, key, bomb, codec="zlib", size=1000)
    with pytest.raises(CodecError, match="1001 bytes, head says 1000"):
        _read(client, key)
    _put_head(client, key, b"not zlib at all", codec="zlib", size=5)
    with pytest.raises(CodecError, match="bad zlib data"):
        _read(client, key)
    client.raw.put(key, b"\xc1 not msgpack")
    with pytest.raises(CodecError):
        _read(client, key)


def test_a_blob_on_a_lease_goes_whole_with_it(client: EtcdClient) -> None:
    lease = client.new_lease()
    key = client.key("blobs", "leased")
    assert _write(client, key, os.urandom(CHUNK_BYTES + 1), lease=lease) == 2
    assert len(_kvs(client, key)) == 3  # the head and two chunks
    client.revoke(lease)
    assert _kvs(client, key) == [] and _read(client, key) is None

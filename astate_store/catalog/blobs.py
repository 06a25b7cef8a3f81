"""Records of any size in etcd: compressed, split into chunks within etcd's request limit, and
written so that a reader never sees half of one.

A blob under ``key`` is a small head record at ``key`` (``blob``: size, codec, chunk count,
digest; the bytes inline when they fit) plus chunks at ``key/<i>``. The chunks are written first,
the head last: a reader that finds the head finds every chunk. Readers get the head and its
chunks in one range read (one revision), check the digest, and decompress. Keys of blobs are
content-addressed ids, so a blob never changes once written; leases and retention delete head
and chunks in one revision.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import xxhash
from pyetcd import transactions as tx

from astate_store.errors import CodecError
from astate_store.model import codec

__all__ = ["CHUNK_BYTES", "blob_requests", "blob_from_kvs", "blob_range"]

# etcd refuses requests over --max-request-bytes (1.5 MiB by default): one chunk per request,
# with room for the key and the request's own framing.
CHUNK_BYTES = 1 << 20
# Compressing pays for itself on the repetitive names and shapes of a layout past a few KiB.
_COMPRESS_OVER = 4096


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def blob_requests(key: str, data: bytes, lease: int | None = None) -> tuple[list[list[Any]], Any]:
    """The etcd puts that store ``data`` at ``key``: (chunk requests, each its own transaction's
    operations, to run first; the head put, to run last, inside the caller's fenced transaction)."""
    stored, how = data, "none"
    if len(data) > _COMPRESS_OVER:
        packed = zlib.compress(data, 1)
        if len(packed) < 0.9 * len(data):
            stored, how = packed, "zlib"
    head: dict[str, Any] = {"size": len(data), "codec": how, "digest": _digest(stored)}
    chunks: list[list[Any]] = []
    if len(stored) <= CHUNK_BYTES:
        head["chunks"], head["data"] = 0, stored
    else:
        parts = [stored[i : i + CHUNK_BYTES] for i in range(0, len(stored), CHUNK_BYTES)]
        head["chunks"] = len(parts)
        chunks = [[tx.Put(f"{key}/{i:06d}", part, lease=lease)] for i, part in enumerate(parts)]
    value = codec.encode("blob", head)
    put = tx.Put(key, value, lease=lease) if lease is not None else tx.Put(key, value)
    return chunks, put


def blob_range(key: str) -> tuple[str, bytes]:
    """The range (start, end) that holds a blob's head and its chunks, for one range read."""
    from astate_store.etcd.client import range_end

    return key, range_end(key)


def blob_from_kvs(key: str, kvs: Iterable[tuple[bytes, Any]]) -> bytes | None:
    """The bytes of the blob at ``key`` from a range read of :func:`blob_range`; None when its head
    is absent (not written yet, or gone with its lease).

    Raises:
        CodecError: a bad head, missing or extra chunks, a digest mismatch, or bad compression.
    """
    head_raw = None
    chunks: dict[int, bytes] = {}
    for value, meta in kvs:
        k = bytes(meta.key).decode("utf-8", "replace")  # a stranger's key may not be UTF-8
        if k == key:
            head_raw = value
        elif k.startswith(key + "/") and k[len(key) + 1 :].isdigit():
            chunks[int(k[len(key) + 1 :])] = value
    if head_raw is None:
        return None
    head = codec.decode("blob", head_raw)
    n = head["chunks"]
    if n == 0:
        stored = head.get("data", b"")
    else:
        # Compare counts before building anything sized by the head: it is a stranger's word.
        if len(chunks) != n or sorted(chunks) != list(range(n)):
            raise CodecError(f"blob {key}: expected chunks 0..{n - 1}, found {sorted(chunks)[:8]}")
        stored = b"".join(chunks[i] for i in range(n))
    if _digest(stored) != head["digest"]:
        raise CodecError(f"blob {key}: digest mismatch (corrupted or foreign chunks)")
    if head["codec"] == "zlib":
        # At most the size the head claims (+1 to notice more): no decompression bomb.
        z = zlib.decompressobj()
        try:
            data = z.decompress(stored, head["size"] + 1)
        except zlib.error as exc:
            raise CodecError(f"blob {key}: bad zlib data ({exc})") from None
    else:
        data = bytes(stored)
    if len(data) != head["size"]:
        raise CodecError(f"blob {key}: {len(data)} bytes, head says {head['size']}")
    return data

"""What the catalog's etcd records mean in Python: the frozen record types, the wire form of a
shard, content-addressed layout ids, the 20-digit key numbers, and decoding records read back.

Pure functions and data only: no etcd access here, so every role decodes a record the same way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .. import codec
from ..errors import CatalogError, VersionNotFound
from ..layout import Box, ShardRecord

__all__ = ["Session", "Layout", "Piece", "Replica", "Version", "CheckpointEntry", "shard_to_wire",
           "shard_from_wire", "layout_id_of", "pad20", "layout_from_record", "version_from_kvs"]


def pad20(v: int) -> str:
    """A step or epoch as it appears in keys and counters: 20 digits, so lexical order is numeric."""
    return "%020d" % v


def shard_to_wire(s: ShardRecord) -> dict[str, Any]:
    return {
        "name": s.name, "dtype": s.dtype, "global_shape": list(s.global_shape),
        "offsets": list(s.box.offsets), "sizes": list(s.box.sizes), "strides": list(s.strides),
        "region": s.region, "byte_offset": s.byte_offset,
    }


def shard_from_wire(d: Mapping[str, Any], rank: int) -> ShardRecord:
    return ShardRecord(
        name=d["name"], dtype=d["dtype"], global_shape=tuple(d["global_shape"]),
        box=Box(tuple(d["offsets"]), tuple(d["sizes"])), strides=tuple(d["strides"]),
        rank=rank, region=d["region"], byte_offset=d["byte_offset"],
    )


@dataclass(frozen=True)
class Session:
    """A publisher group's membership: all ranks of one session share ``epoch``."""

    epoch: int
    session_id: str
    rank: int
    world_size: int
    lease_id: int


@dataclass(frozen=True)
class Layout:
    layout_id: str
    epoch: int
    rank: int
    shards: tuple[ShardRecord, ...]
    transport: bytes
    packed: tuple[tuple[str, ShardRecord], ...] = ()  # (consumer, contiguous copy) pre-packed for it


@dataclass(frozen=True)
class Piece:
    step: int
    epoch: int
    rank: int
    world_size: int
    layout_id: str
    base_offset: int


@dataclass(frozen=True)
class Replica:
    """A consumer re-serving a version from its buffers (P2P fan-out)."""

    step: int
    group: str
    member: str
    layout_id: str


@dataclass(frozen=True)
class Version:
    """A committed version as one consumer read it: commit, pieces, replicas, and (when asked)
    the layouts that are still alive (``missing``: publisher ranks whose layout lease is gone)."""

    step: int
    epoch: int
    world_size: int
    pieces: Mapping[int, Piece]
    replicas: Mapping[str, Replica] = field(default_factory=dict)
    layouts: Mapping[int, Layout] = field(default_factory=dict)
    replica_layouts: Mapping[str, Layout] = field(default_factory=dict)
    missing: frozenset[int] = frozenset()

    @property
    def layout_key(self) -> tuple[object, ...]:
        """Identifies the source layout: unchanged key means the cached plan still holds."""
        return (tuple(self.pieces[r].layout_id for r in sorted(self.pieces)),
                tuple((m, self.replicas[m].group, self.replicas[m].layout_id) for m in sorted(self.replica_layouts)))


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    uri: str
    world_size: int
    bytes: int
    written_at: float


def layout_id_of(epoch: int, rank: int, shards: Sequence[ShardRecord], transport: bytes,
                 packed: Sequence[tuple[str, ShardRecord]] = ()) -> str:
    """Content address of a layout: the same shards and transport of the same rank give the same
    id, which is what lets a publisher skip rewriting an unchanged layout."""
    h = hashlib.blake2b(digest_size=12)
    h.update(b"%d/%d/" % (epoch, rank))
    h.update(transport)
    for s in shards:
        h.update(repr(shard_to_wire(s)).encode())
    for c, s in packed:
        h.update(c.encode() + repr(shard_to_wire(s)).encode())
    return h.hexdigest()


def layout_from_record(rec: Mapping[str, Any]) -> Layout:
    """A decoded ``layout`` record as a :class:`Layout` (its shards carry the record's rank)."""
    rank = rec["rank"]
    shards = tuple(shard_from_wire(d, rank) for d in rec["shards"])
    packed = tuple((p["consumer"], shard_from_wire(p["shard"], rank)) for p in rec.get("packed", ()))
    return Layout(rec["layout_id"], rec["epoch"], rank, shards, rec["transport"], packed)


def version_from_kvs(namespace: str, step: int, kvs: Iterable[tuple[bytes, Any]]) -> Version:
    """The :class:`Version` of ``step`` from the (value, meta) pairs under ``versions/<step>/``.

    Only pieces of the committing epoch count: a fenced session may have left pieces of the same
    step behind.

    Raises:
        VersionNotFound: no commit record among ``kvs``.
        CatalogError: committed, but a piece of the committing session is missing.
    """
    commit = None
    pieces_raw: dict[tuple[int, int], bytes] = {}
    replicas: dict[str, Replica] = {}
    for value, meta in kvs:
        k = meta.key.decode()
        tail = k.rsplit("/versions/", 1)[1].split("/")[1:]
        if tail == ["commit"]:
            commit = codec.decode("commit", value)
        elif len(tail) == 3 and tail[0] == "pieces":
            pieces_raw[(int(tail[1]), int(tail[2]))] = value
        elif len(tail) == 3 and tail[0] == "replicas":
            r = codec.decode("replica", value)
            replicas[r["member"]] = Replica(r["step"], r["group"], r["member"], r["layout_id"])
    if commit is None:
        raise VersionNotFound(f"namespace {namespace!r}: step {step} is not committed")
    epoch = commit["epoch"]
    pieces = {}
    for (e, r), value in pieces_raw.items():
        if e == epoch:
            p = codec.decode("piece", value)
            pieces[r] = Piece(p["step"], p["epoch"], p["rank"], p["world_size"], p["layout_id"], p["base_offset"])
    if set(pieces) != set(range(commit["world_size"])):
        raise CatalogError(
            f"namespace {namespace!r}: step {step} is committed but pieces of ranks "
            f"{sorted(set(range(commit['world_size'])) - set(pieces))} are missing")
    return Version(step, epoch, commit["world_size"], pieces, replicas)

"""Reading what is committed: the complete steps under a root, their commit markers and manifests."""

from __future__ import annotations

import base64
import json
import posixpath
import zlib
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from astate_store.checkpoint.format import COMMIT_NAME, FORMAT, MANIFEST_SCHEMA, STEP_RE, parquet_meta
from astate_store.checkpoint.storage import URI, Location, read_all, resolve
from astate_store.errors import CheckpointCorrupted, CheckpointError, CheckpointNotFound
from astate_store.model.layout import check_step

__all__ = [
    "CheckpointInfo",
    "is_committed",
    "list_checkpoints",
    "load_marker",
    "checkpoint_info",
    "load_manifest",
    "read_manifest",
]

# Keys every commit marker has; the others (bytes, tensors, shards, written_at) are informational.
_MARKER_KEYS = (
    "manifest",
    "manifest_bytes",
    "manifest_crc32",
    "files",
    "world_size",
    "checksum",
    "block_size",
)


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint, from its commit marker (fields of the catalog ``checkpoint`` record)."""

    step: int
    uri: str
    world_size: int
    bytes: int
    tensors: int
    shards: int
    files: dict
    manifest: str
    checksum: str
    block_size: int
    written_at: float


def is_committed(loc: Location, step: int) -> bool:
    """Whether ``step`` has a commit marker (anything there counts: it is never removed)."""
    path = posixpath.join(loc.step_dir(step), COMMIT_NAME)
    return bool(loc.fs.get_file_info(path).type != pafs.FileType.NotFound)


def list_checkpoints(uri: URI) -> list[int]:
    """Steps with a complete checkpoint (a commit marker) under ``uri``, ascending; [] if none."""
    loc = resolve(uri)
    try:
        entries = loc.fs.get_file_info(pafs.FileSelector(loc.root, allow_not_found=True))
    except (OSError, pa.ArrowException):
        return []
    steps = []
    for e in entries:
        m = STEP_RE.match(e.base_name)
        if m and e.type == pafs.FileType.Directory:
            steps.append(int(m.group(1)))
    if not steps:
        return []
    steps.sort()
    infos = loc.fs.get_file_info([posixpath.join(loc.step_dir(s), COMMIT_NAME) for s in steps])
    return [s for s, i in zip(steps, infos) if i.type == pafs.FileType.File]


def load_marker(loc: Location, step: int | None) -> tuple[int, dict[str, Any]]:
    """``(step, commit marker)`` of ``step`` (None: the newest complete one).

    Raises:
        CheckpointNotFound: no complete checkpoint (of that step). CheckpointCorrupted: a malformed marker.
    """
    if step is None:
        steps = list_checkpoints((loc.fs, loc.root))
        if not steps:
            raise CheckpointNotFound(f"no complete checkpoint under {loc.uri}")
        step = steps[-1]
    else:
        step = check_step(step, CheckpointError)
    sdir = loc.step_dir(step)
    path = posixpath.join(sdir, COMMIT_NAME)
    try:
        raw = read_all(loc.fs, path)
    except FileNotFoundError:
        partial = loc.fs.get_file_info(sdir).type == pafs.FileType.Directory
        raise CheckpointNotFound(
            f"no complete checkpoint of step {step} under {loc.uri}"
            f"{' (only an uncommitted partial one)' if partial else ''}; complete: "
            f"{list_checkpoints((loc.fs, loc.root))}"
        ) from None
    try:
        marker = json.loads(raw)
        if not isinstance(marker, dict) or marker.get("format") != FORMAT or marker.get("step") != step:
            raise ValueError(f"format/step {marker.get('format') if isinstance(marker, dict) else marker!r}")
        for k in _MARKER_KEYS:
            if k not in marker:
                raise ValueError(f"missing {k!r}")
    except ValueError as exc:
        raise CheckpointCorrupted(f"step {step}: commit marker {path} is malformed: {exc}") from None
    return step, marker


def checkpoint_info(uri: URI, step: int | None = None) -> CheckpointInfo:
    """The commit marker of ``step`` (default: the newest complete one).

    Raises:
        CheckpointNotFound: no complete checkpoint (of that step).
        CheckpointCorrupted: a malformed commit marker.
    """
    loc = resolve(uri)
    step, m = load_marker(loc, step)
    return CheckpointInfo(
        step,
        loc.uri,
        int(m["world_size"]),
        int(m.get("bytes", 0)),
        int(m.get("tensors", 0)),
        int(m.get("shards", 0)),
        dict(m["files"]),
        m["manifest"],
        m["checksum"],
        int(m["block_size"]),
        float(m.get("written_at", 0.0)),
    )


def read_meta(uri: URI, step: int | None = None, rank: int = 0) -> tuple[int, bytes | None]:
    """``(step, the msgpack bytes rank put with it)`` from a complete checkpoint (default: the
    newest); None when that rank gave no meta.

    Raises:
        CheckpointNotFound: no complete checkpoint (of that step).
        CheckpointCorrupted: a malformed commit marker or meta entry.
    """
    loc = resolve(uri)
    step, m = load_marker(loc, step)
    entry = (m.get("meta") or {}).get(str(rank))
    if entry is None:
        return step, None
    try:
        return step, base64.b64decode(entry, validate=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointCorrupted(
            f"step {step}: the commit marker's meta of rank {rank} is not base64: {exc}"
        ) from None


def load_manifest(loc: Location, step: int, marker: dict[str, Any]) -> pa.Table:
    """The merged manifest ``marker`` names, checked against the size and crc32 the marker gives.

    Raises:
        CheckpointCorrupted: missing, failing its check, or unreadable.
    """
    path = posixpath.join(loc.step_dir(step), marker["manifest"])
    try:
        data = read_all(loc.fs, path)
    except FileNotFoundError:
        raise CheckpointCorrupted(f"step {step}: manifest {path} is missing") from None
    if len(data) != marker["manifest_bytes"] or zlib.crc32(data) != marker["manifest_crc32"]:
        raise CheckpointCorrupted(
            f"step {step}: manifest {path} fails its size/crc32 check "
            f"({len(data)} bytes, commit marker says {marker['manifest_bytes']})"
        )
    try:
        table = pq.read_table(pa.BufferReader(data))
        parquet_meta(table)
        if not table.schema.remove_metadata().equals(MANIFEST_SCHEMA):
            raise ValueError(f"columns {table.schema.names}")
    except (ValueError, pa.ArrowException) as exc:
        raise CheckpointCorrupted(f"step {step}: manifest {path} is unreadable: {exc}") from exc
    return table


def read_manifest(uri: URI, step: int | None = None) -> pa.Table:
    """The merged manifest of a complete checkpoint as a ``pyarrow.Table`` (one row per shard).

    Raises:
        CheckpointNotFound, CheckpointCorrupted.
    """
    loc = resolve(uri)
    step, marker = load_marker(loc, step)
    return load_manifest(loc, step, marker)

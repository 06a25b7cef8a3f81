"""Committing a step: merge every rank's part manifest, write the merged manifest, then ``COMMIT``
last; afterwards delete data files the manifest does not use.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from astate_store.checkpoint.format import (
    COMMIT_NAME,
    DATA_RE,
    FORMAT,
    manifest_name,
    manifest_records,
    parquet_bytes,
    parquet_meta,
    part_name,
)
from astate_store.checkpoint.index import is_committed
from astate_store.checkpoint.storage import URI, Location, fsync_path, hook, put_atomic, read_all, resolve
from astate_store.checkpoint.writer import check_world_size
from astate_store.errors import CheckpointCorrupted, CheckpointError, LayoutError
from astate_store.model.layout import TensorLayout, check_step, group_layouts

__all__ = ["try_commit"]

log = logging.getLogger("astate_store.checkpoint")


def try_commit(
    uri: URI,
    step: int,
    world_size: int,
    *,
    attempt: str | None = None,
    fsync: bool = True,
    cleanup: bool = True,
) -> bool:
    """Commit ``step`` if all ``world_size`` parts are there: merged manifest first, ``COMMIT`` last.

    Safe to call from every rank, concurrently and repeatedly: committers write identical
    content-named manifests and atomically replace ``COMMIT``; a step already committed returns True.

    Args:
        attempt: count only parts written with this ``attempt`` tag (None: any part).
        cleanup: after committing, delete data files of this step that the manifest does not use
            (left by crashed earlier attempts).

    Returns:
        True if the step is committed (by this call or before), False if parts are still missing.

    Raises:
        CheckpointError: the parts do not form a valid checkpoint (shards that disagree or do not
            tile a tensor, mixed checksum settings), or a filesystem error.
        CheckpointCorrupted: a part's data file is missing or has the wrong size.
    """
    step = check_step(step, CheckpointError)
    check_world_size(world_size)
    loc = resolve(uri)
    sdir = loc.step_dir(step)
    try:
        if is_committed(loc, step):
            return True
        parts = _read_parts(loc, step, world_size, attempt)
        if parts is None:
            return False
        tables, metas = parts
        if len({(m["checksum"], m["block_size"]) for m in metas}) != 1:
            raise CheckpointError(
                f"step {step}: ranks used different checksum settings "
                f"{sorted({(m['checksum'], m['block_size']) for m in metas})}"
            )
        files = {m["file"]: int(m["file_bytes"]) for m in metas}
        _check_data_files(loc, step, files)
        table, layouts = _merge(tables, step)
        _write_commit(loc, step, world_size, metas, files, table, layouts, fsync)
        if cleanup:
            _cleanup(loc, sdir, set(files))
        return True
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointError(f"step {step}: committing under {loc.uri} failed: {exc}") from exc


def _read_parts(
    loc: Location, step: int, world_size: int, attempt: str | None
) -> tuple[list[pa.Table], list[dict[str, Any]]] | None:
    """Every rank's part manifest and its metadata; None while one is missing or from another run."""
    sdir = loc.step_dir(step)
    paths = [posixpath.join(sdir, part_name(r)) for r in range(world_size)]
    if any(i.type == pafs.FileType.NotFound for i in loc.fs.get_file_info(paths)):
        return None
    tables, metas = [], []
    for r, p in enumerate(paths):
        try:
            table = pq.read_table(pa.BufferReader(read_all(loc.fs, p)))
            meta = parquet_meta(table)
        except FileNotFoundError:
            return None
        except (ValueError, pa.ArrowException) as exc:
            raise CheckpointCorrupted(f"step {step}: part manifest {p} is unreadable: {exc}") from exc
        if (meta.get("step"), meta.get("rank"), meta.get("world_size")) != (step, r, world_size) or (
            attempt is not None and meta.get("attempt") != str(attempt)
        ):
            log.debug("step %d: part %s is from another run (%s); not committing", step, p, meta)
            return None
        tables.append(table)
        metas.append(meta)
    return tables, metas


def _check_data_files(loc: Location, step: int, files: Mapping[str, int]) -> None:
    """Every part's data file exists with the size its part manifest gives (a writer renames the data
    file into place before its part, so a mismatch is damage, not a write in progress)."""
    sdir = loc.step_dir(step)
    infos = loc.fs.get_file_info([posixpath.join(sdir, f) for f in files])
    for (f, size), inf in zip(files.items(), infos):
        if inf.type == pafs.FileType.NotFound:
            raise CheckpointCorrupted(
                f"step {step}: data file {posixpath.join(sdir, f)} of a part is missing"
            )
        if inf.size != size:
            raise CheckpointCorrupted(
                f"step {step}: data file {posixpath.join(sdir, f)} has {inf.size} bytes, "
                f"its part manifest says {size}"
            )


def _merge(tables: Sequence[pa.Table], step: int) -> tuple[pa.Table, Mapping[str, TensorLayout]]:
    """The merged manifest rows, sorted by (name, rank, byte_offset), and the layouts they form.

    Raises:
        CheckpointError: the shards disagree or do not tile a tensor.
    """
    table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    table = table.take(
        pc.sort_indices(
            table, sort_keys=[("name", "ascending"), ("rank", "ascending"), ("byte_offset", "ascending")]
        )
    )
    try:
        layouts = group_layouts(manifest_records(table))
    except (LayoutError, ValueError) as exc:
        raise CheckpointError(f"step {step}: the parts do not form a checkpoint: {exc}") from exc
    return table, layouts


def _write_commit(
    loc: Location,
    step: int,
    world_size: int,
    part_metas: Sequence[Mapping[str, Any]],
    files: Mapping[str, int],
    table: pa.Table,
    layouts: Mapping[str, TensorLayout],
    fsync: bool,
) -> None:
    """The merged manifest, then the ``COMMIT`` marker that names it: the step exists from here on."""
    sdir = loc.step_dir(step)
    part_meta = part_metas[0]
    meta = {
        "format": FORMAT,
        "kind": "manifest",
        "step": step,
        "world_size": world_size,
        "checksum": part_meta["checksum"],
        "block_size": part_meta["block_size"],
    }
    data = parquet_bytes(table, meta)
    crc = zlib.crc32(data)
    mname = manifest_name(crc)
    put_atomic(loc, posixpath.join(sdir, mname), data, fsync=fsync)
    hook("manifest_written")
    marker = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "manifest": mname,
        "manifest_bytes": len(data),
        "manifest_crc32": crc,
        "files": dict(files),
        "bytes": int(sum(lay.nbytes for lay in layouts.values())),
        "tensors": len(layouts),
        "shards": table.num_rows,
        "checksum": meta["checksum"],
        "block_size": meta["block_size"],
        "written_at": time.time(),
    }
    user_meta = {str(m["rank"]): m["meta"] for m in part_metas if isinstance(m.get("meta"), str)}
    if user_meta:
        marker["meta"] = user_meta  # every rank's put(meta=...), base64 msgpack
    put_atomic(
        loc, posixpath.join(sdir, COMMIT_NAME), json.dumps(marker, sort_keys=True).encode(), fsync=fsync
    )
    if loc.local and fsync:
        fsync_path(loc.root, directory=True)  # the step directory's own entry
    hook("committed")


def _cleanup(loc: Location, sdir: str, keep: set[str]) -> None:
    """Best effort: delete data files (and temporaries) of crashed attempts; a failure leaves debris only."""
    try:
        entries = loc.fs.get_file_info(pafs.FileSelector(sdir, allow_not_found=True))
    except (OSError, pa.ArrowException):
        return
    for e in entries:
        base = e.base_name
        if DATA_RE.match(base) and base not in keep:
            try:
                loc.fs.delete_file(e.path)
            except (OSError, pa.ArrowException):
                pass

"""Writing one rank's part of a step: shard validation, the data file with its block checksums, and
the part manifest (``write_part``; ``AsyncCheckpointer`` shares everything after the snapshot).
"""

from __future__ import annotations

import base64
import posixpath
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from astate_store.checkpoint.checksum import BlockSums, Checksum, check_block_size, checksum_algo
from astate_store.checkpoint.format import (
    BLOCK_SIZE,
    FORMAT,
    align_up,
    data_file_name,
    manifest_table,
    parquet_bytes,
    part_name,
)
from astate_store.checkpoint.index import is_committed
from astate_store.checkpoint.storage import URI, Location, fsync_path, hook, put_atomic, resolve, temp_path
from astate_store.errors import CheckpointError, LayoutError
from astate_store.model.dtypes import DTYPES, dtype_name
from astate_store.model.layout import (
    ShardRecord,
    TensorLayout,
    TensorLike,
    check_step,
    contiguous_strides,
    validate_name,
)
from astate_store.model.progress import Progress, ProgressCounter
from astate_store.model.validation import validate_tensors, with_aliases

__all__ = [
    "WRITE_CHUNK",
    "PartInfo",
    "PartTarget",
    "local_shards",
    "owned_shards",
    "validate_shards",
    "check_world_size",
    "check_part_args",
    "file_layout",
    "write_part_files",
    "write_part",
]

#: Bytes per write call (a multiple of BLOCK_SIZE, so whole blocks are summed in one shot).
WRITE_CHUNK = 16 << 20

Pairs = Sequence[tuple[ShardRecord, torch.Tensor]]


@dataclass(frozen=True)
class PartInfo:
    """What one ``write_part`` wrote."""

    step: int
    rank: int
    world_size: int
    uri: str
    file: str  #: data file, relative to the step directory
    part: str  #: part manifest, relative to the step directory
    bytes: int  #: shard bytes written (without alignment padding)
    file_bytes: int  #: size of the data file
    shards: int
    seconds: float
    committed: bool | None = None  #: set by ``AsyncCheckpointer(commit=True)``: try_commit's result


@dataclass(frozen=True)
class PartTarget:
    """Where one part goes and how it is written (checked arguments of ``write_part`` / ``save``)."""

    loc: Location
    step: int
    rank: int
    world_size: int
    attempt: str
    algo: Checksum
    block_size: int
    fsync: bool
    meta: bytes | None = None  # the rank's put(meta=...) of the step: kept in its part manifest


# ----------------------------------------------------------------------------------------------
# Shard input


def local_shards(tensors: Mapping[str, TensorLike], rank: int = 0) -> list[tuple[ShardRecord, torch.Tensor]]:
    """``write_part`` input from the store's user form: names -> ``torch.Tensor`` (whole) or ``Shard``.

    Raises:
        LayoutError: bad names, dtypes or boxes.
    """
    if isinstance(tensors, Mapping) and not tensors:
        return []  # a rank may hold nothing; validate_tensors refuses an empty mapping
    # tied weights (one tensor under several names) are written under each name
    return [
        (r, e.tensor)
        for e in validate_tensors(tensors, "local_shards(tensors)")
        for r in with_aliases([e], [e.record(rank, strides=contiguous_strides(e.box.sizes))])
    ]


def owned_shards(
    shards: Pairs, layouts: Mapping[str, TensorLayout], rank: int
) -> list[tuple[ShardRecord, torch.Tensor]]:
    """Keep the shards this rank writes: of replicas (the same box on several ranks in ``layouts``),
    only the lowest rank writes. Shards whose box ``layouts`` does not list are kept."""
    out = []
    for rec, t in shards:
        lay = layouts.get(rec.name)
        holders = [s.rank for s in lay.shards if s.box == rec.box] if lay is not None else []
        if not holders or min(holders) >= rank:
            out.append((rec, t))
    return out


def _check_pair(item: Any) -> tuple[ShardRecord, torch.Tensor]:
    try:
        rec, t = item
    except (TypeError, ValueError):
        raise LayoutError(f"shards must be (ShardRecord, torch.Tensor) pairs, got {item!r:.80}") from None
    if not isinstance(rec, ShardRecord) or not isinstance(t, torch.Tensor):
        raise LayoutError(
            f"shards must be (ShardRecord, torch.Tensor) pairs, got "
            f"({type(rec).__name__}, {type(t).__name__})"
        )
    validate_name(rec.name)
    if rec.dtype not in DTYPES:
        raise LayoutError(f"tensor {rec.name!r}: unknown dtype name {rec.dtype!r}")
    got = dtype_name(t.dtype, tensor=rec.name)
    if got != rec.dtype:
        raise LayoutError(f"tensor {rec.name!r}: record dtype {rec.dtype} but the tensor is {got}")
    if tuple(t.shape) != tuple(rec.box.sizes):
        raise LayoutError(
            f"tensor {rec.name!r}: tensor shape {tuple(t.shape)} differs from the record's box "
            f"sizes {rec.box.sizes}"
        )
    if not rec.box.within(rec.global_shape):
        raise LayoutError(
            f"tensor {rec.name!r}: box {rec.box.offsets}+{rec.box.sizes} is out of bounds of "
            f"{rec.global_shape}"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise LayoutError(f"tensor {rec.name!r}: device {t.device} is not supported (cpu or cuda)")
    return rec, t


def validate_shards(shards: Pairs) -> list[tuple[ShardRecord, torch.Tensor]]:
    """Checked ``(record, detached tensor)`` pairs in file order (name, then box).

    Raises:
        LayoutError: not a pair, a bad name or dtype, a tensor that does not match its record, or a
            box given twice.
    """
    seen: set = set()
    out = []
    for item in shards:
        rec, t = _check_pair(item)
        key = (rec.name, rec.box)
        if key in seen:
            raise LayoutError(f"tensor {rec.name!r}: box {rec.box.offsets}+{rec.box.sizes} given twice")
        seen.add(key)
        out.append((rec, t.detach()))
    out.sort(key=lambda p: (p[0].name, p[0].box.offsets, p[0].box.sizes))
    return out


def check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def check_part_args(step: Any, rank: Any, world_size: Any) -> int:
    """The checked step of a part.

    Raises:
        CheckpointError: a bad step, world size, or rank.
    """
    step = check_step(step, CheckpointError)
    check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise CheckpointError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return step


# ----------------------------------------------------------------------------------------------
# Data file and part manifest


def file_layout(shards: Pairs) -> tuple[list[int], int]:
    """Byte offset of each shard in the data file (each ``ALIGN``-aligned) and the file size."""
    offs, pos = [], 0
    for rec, _ in shards:
        pos = align_up(pos)
        offs.append(pos)
        pos += rec.nbytes
    return offs, pos


def _u8(t: torch.Tensor) -> np.ndarray:
    """Bytes of a contiguous CPU tensor as a numpy uint8 array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def tensor_chunks(t: torch.Tensor, chunk: int) -> Iterator[np.ndarray]:
    """The tensor's bytes in row-major order, at most ~``chunk`` bytes of host memory at a time."""
    n = t.numel() * t.element_size()
    if n == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        flat = _u8(t)
        for i in range(0, n, chunk):
            yield flat[i : i + chunk]
        return
    if t.dim() == 0 or n <= chunk:
        yield _u8(t.contiguous().cpu())
        return
    row = max(1, n // t.shape[0])
    per = max(1, chunk // row)
    for i in range(0, t.shape[0], per):
        yield _u8(t[i : i + per].contiguous().cpu())


ChunksOf = Callable[[int], Iterable[np.ndarray]]


def _write_data(
    target: PartTarget, path: str, recs: Sequence[ShardRecord], offsets: Sequence[int], chunks_of: ChunksOf
) -> list[list[int]]:
    """Write the data file (to a temporary name, renamed into place where possible) and return the
    per-shard block checksums. Checksums of a chunk are computed on a helper thread while the
    chunk is written (both release the GIL)."""
    loc = target.loc
    tmp = temp_path(loc, path)
    out_sums: list[list[int]] = []
    pool = ThreadPoolExecutor(1, thread_name_prefix="astate-ckpt-sum")
    first = True
    try:
        with loc.fs.open_output_stream(tmp, compression=None) as out:
            pos = 0
            for i in range(len(recs)):
                pad = offsets[i] - pos
                if pad:
                    out.write(b"\0" * pad)
                    pos += pad
                sums = BlockSums(target.algo, target.block_size)
                pending: Future | None = None
                for ch in chunks_of(i):
                    fut = pool.submit(sums.feed, ch)
                    out.write(ch)
                    pos += len(ch)
                    if pending is not None:
                        pending.result()
                    pending = fut
                    if first:
                        first = False
                        hook("data_started")
                if pending is not None:
                    pending.result()
                out_sums.append(sums.finish())
        if loc.local and target.fsync:
            fsync_path(tmp)
        if tmp != path:
            loc.fs.move(tmp, path)
    except BaseException:
        if tmp != path:
            try:
                loc.fs.delete_file(tmp)
            except (OSError, pa.ArrowException):
                pass
        raise
    finally:
        pool.shutdown(wait=True)
    return out_sums


def _write_part_manifest(
    target: PartTarget,
    fname: str,
    file_bytes: int,
    recs: Sequence[ShardRecord],
    offsets: Sequence[int],
    sums: Sequence[Sequence[int]],
) -> PartInfo:
    t = target
    table = manifest_table(recs, [t.rank] * len(recs), [fname] * len(recs), offsets, sums, t.block_size)
    meta = {
        "format": FORMAT,
        "kind": "part",
        "step": t.step,
        "rank": t.rank,
        "world_size": t.world_size,
        "attempt": str(t.attempt),
        "file": fname,
        "file_bytes": file_bytes,
        "checksum": t.algo.name,
        "block_size": t.block_size,
    }
    if t.meta is not None:
        meta["meta"] = base64.b64encode(t.meta).decode("ascii")
    pname = part_name(t.rank)
    # The directory entries of the data file and the part are flushed by the committer (one fsync of
    # the step directory before COMMIT covers every rank's names).
    put_atomic(
        t.loc,
        posixpath.join(t.loc.step_dir(t.step), pname),
        parquet_bytes(table, meta),
        fsync=t.fsync,
        sync_dir=False,
    )
    hook("part_written")
    return PartInfo(
        t.step,
        t.rank,
        t.world_size,
        t.loc.uri,
        fname,
        pname,
        sum(r.nbytes for r in recs),
        file_bytes,
        len(recs),
        0.0,
    )


def write_part_files(
    target: PartTarget,
    recs: Sequence[ShardRecord],
    offsets: Sequence[int],
    file_bytes: int,
    chunks_of: ChunksOf,
) -> PartInfo:
    """Write a part: refuse a committed step, then the data file (shard ``i``'s bytes from
    ``chunks_of(i)``), then the part manifest. ``seconds`` of the result is left 0.

    Raises:
        CheckpointError: the step is already committed, or a filesystem error.
    """
    loc, step = target.loc, target.step
    sdir = loc.step_dir(step)
    try:
        if is_committed(loc, step):
            raise CheckpointError(
                f"step {step} is already committed under {loc.uri}; checkpoints are immutable"
            )
        loc.fs.create_dir(sdir, recursive=True)
        fname = data_file_name(target.rank)
        sums = _write_data(target, posixpath.join(sdir, fname), recs, offsets, chunks_of)
        hook("data_written")
        return _write_part_manifest(target, fname, file_bytes, recs, offsets, sums)
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointError(
            f"step {step} rank {target.rank}: writing under {loc.uri} failed: {exc}"
        ) from exc


def write_part(
    uri: URI,
    step: int,
    rank: int,
    world_size: int,
    shards: Pairs,
    *,
    layouts: Mapping[str, TensorLayout] | None = None,
    attempt: str = "",
    checksum: str | None = None,
    block_size: int = BLOCK_SIZE,
    fsync: bool = True,
    progress: Progress | None = None,
    meta: bytes | None = None,
) -> PartInfo:
    """Write publisher rank ``rank``'s shards of version ``step`` (one data file + its part manifest).

    Args:
        uri: checkpoint root: a local path, ``file://``, ``s3://``, ``gs://``, ``hdfs://`` URI, or a
            ``(pyarrow.fs.FileSystem, path)`` pair.
        shards: ``(ShardRecord, tensor)`` pairs: the record gives name, dtype, global shape and box
            (its strides/rank/region/byte_offset are ignored); the tensor holds the box's values, any
            strides, CPU or CUDA. See :func:`local_shards` for the ``{name: Tensor | Shard}`` form.
        layouts: the version's full layout (all ranks): replicas (the same box on several ranks) are
            then written by the lowest rank only. Without it every given shard is written; a caller
            that already passes only the shards it owns needs nothing else.
        attempt: tag of this run (e.g. the session id); ``try_commit(attempt=...)`` counts only parts
            with the same tag, so parts left by a crashed earlier run of the same step are not mixed in.
        checksum: ``"xxh3_64"`` (needs ``xxhash``) or ``"crc32"`` (zlib); None: ``DEFAULT_CHECKSUM``
            (xxh3_64 when xxhash is installed). All ranks of a step must use the same one.
        block_size: checksum block in bytes (a multiple of 4096).
        fsync: flush the data file and part manifest to stable storage (local filesystems) before
            they are renamed into place; False still survives a process crash, not a machine crash.
        progress: called with (bytes written, bytes of this part) as the data file is written
            (:mod:`astate_store.model.progress`).
        meta: this rank's small non-tensor state of the step (msgpack bytes, see
            ``astate_store.model.usermeta``); the commit marker keeps every rank's (:func:`read_meta`).

    Returns:
        PartInfo of the written part. Other ranks' parts and :func:`try_commit` complete the step.

    Raises:
        LayoutError: a bad record / tensor pair (before anything is written).
        CheckpointError: the step is already committed under ``uri`` (checkpoints are immutable), a
            bad argument, or a filesystem error.
    """
    t0 = time.perf_counter()
    step = check_part_args(step, rank, world_size)
    algo = checksum_algo(checksum)
    block_size = check_block_size(block_size)
    items = validate_shards(shards)
    if layouts is not None:
        items = owned_shards(items, layouts, rank)
    target = PartTarget(resolve(uri), step, rank, world_size, attempt, algo, block_size, fsync, meta)
    offsets, file_bytes = file_layout(items)
    counter = ProgressCounter(progress, sum(r.nbytes for r, _ in items))
    info = write_part_files(
        target,
        [r for r, _ in items],
        offsets,
        file_bytes,
        lambda i: counter.chunks(tensor_chunks(items[i][1], WRITE_CHUNK), len),
    )
    counter.finish()
    return replace(info, seconds=time.perf_counter() - t0)

"""Checkpoints of a sharded state on any ``pyarrow.fs`` filesystem: write per rank, commit, restore resharded.

Storage only: no etcd, no transport. ``Store.checkpoint`` / ``Store.restore`` call into this module.

On-disk format (``docs/checkpoint.md``, ``schemas/checkpoint_manifest.json``)::

    <uri>/step-<step:020d>/
        rank-<rank:05d>-<token>.bin      shard bytes of one rank, row-major, each shard 4096-aligned
        rank-<rank:05d>.part.parquet     that rank's part manifest (written after its data file)
        manifest-<crc32:08x>.parquet     merged manifest: one row per shard (written by try_commit)
        COMMIT                           JSON commit marker, written LAST; only steps with one exist

Every file is written to a temporary name and renamed into place on filesystems with an atomic
rename (local, HDFS); on object stores (S3, GCS) an object becomes visible whole when its upload
completes. A reader accepts a step only when ``COMMIT`` exists, and ``COMMIT`` names the manifest
(with its size and crc32) and the size of every data file, so a crash at any point leaves either the
previous complete checkpoint or the new complete one.

Checksums: the bytes of each shard are cut into ``block_size`` blocks (4 MiB) counted from the
shard's first byte; the manifest keeps one checksum per block (``xxh3_64`` from the ``xxhash``
package by default when it is installed, else ``zlib.crc32``). A restore verifies exactly the
blocks it reads.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import posixpath
import re
import threading
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from .errors import CheckpointCorrupted, CheckpointError, CheckpointNotFound, LayoutError, PlanError
from .layout import (
    DTYPES,
    Box,
    ShardRecord,
    TensorLayout,
    TensorLike,
    contiguous_strides,
    dtype_name,
    group_layouts,
    is_floating,
    itemsize,
    local_box,
    torch_dtype,
    validate_name,
)
from .plan import DTYPE_CODES, plan_consumer

__all__ = [
    "FORMAT",
    "ALIGN",
    "BLOCK_SIZE",
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "MANIFEST_SCHEMA",
    "PartInfo",
    "CheckpointInfo",
    "AsyncCheckpointer",
    "local_shards",
    "owned_shards",
    "write_part",
    "try_commit",
    "list_checkpoints",
    "checkpoint_info",
    "read_manifest",
    "restore",
]

log = logging.getLogger("astate_store.checkpoint")

#: Format tag in every part manifest, merged manifest and commit marker.
FORMAT = "astate-checkpoint/1"
#: Byte alignment of every shard inside a data file.
ALIGN = 4096
#: Default checksum block: shard bytes ``[k * block_size, (k + 1) * block_size)`` are block ``k``.
BLOCK_SIZE = 4 << 20
COMMIT_NAME = "COMMIT"
_WRITE_CHUNK = 16 << 20  # bytes per write call (a multiple of BLOCK_SIZE)
_ITEM = 32 << 20  # source bytes per restore work item
_MAX_STEP = 10**20 - 1
_STEP_RE = re.compile(r"^step-(\d{20})$")
_PART_RE = re.compile(r"^rank-(\d{5})\.part\.parquet$")
_DATA_RE = re.compile(r"^rank-\d{5}-[0-9a-f]+\.bin(\.tmp-[0-9a-f]+)?$")

#: One row per shard. ``offsets``/``sizes``/``global_shape`` in elements; ``byte_offset``/``length`` in
#: bytes of ``file`` (relative to the step directory); ``checksums[k]`` covers shard bytes
#: ``[k * block_size, min((k + 1) * block_size, length))``.
MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("global_shape", pa.list_(pa.int64()), nullable=False),
        pa.field("offsets", pa.list_(pa.int64()), nullable=False),
        pa.field("sizes", pa.list_(pa.int64()), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("file", pa.string(), nullable=False),
        pa.field("byte_offset", pa.int64(), nullable=False),
        pa.field("length", pa.int64(), nullable=False),
        pa.field("block_size", pa.int64(), nullable=False),
        pa.field("checksums", pa.list_(pa.uint64()), nullable=False),
    ]
)


class _Checksum:
    """A block checksum: one-shot ``digest(buffer)`` and streaming ``new()`` / ``update`` / ``value``."""

    name = "?"

    def digest(self, data: Any) -> int:
        raise NotImplementedError

    def new(self) -> Any:
        raise NotImplementedError

    def update(self, state: Any, data: Any) -> Any:
        raise NotImplementedError

    def value(self, state: Any) -> int:
        raise NotImplementedError


class _Crc32(_Checksum):
    name = "crc32"

    def digest(self, data: Any) -> int:
        return zlib.crc32(data)

    def new(self) -> Any:
        return 0

    def update(self, state: Any, data: Any) -> Any:
        return zlib.crc32(data, state)

    def value(self, state: Any) -> int:
        return int(state)


class _Xxh3(_Checksum):
    name = "xxh3_64"

    def __init__(self) -> None:
        try:
            import xxhash
        except ImportError:  # pragma: no cover - depends on the environment
            raise CheckpointError("checksum 'xxh3_64' needs the package xxhash (pip install xxhash), or restore "
                                  "with verify=False") from None
        self._x = xxhash

    def digest(self, data: Any) -> int:
        return self._x.xxh3_64_intdigest(data)  # type: ignore[no-any-return]

    def new(self) -> Any:
        return self._x.xxh3_64()

    def update(self, state: Any, data: Any) -> Any:
        state.update(data)
        return state

    def value(self, state: Any) -> int:
        return state.intdigest()  # type: ignore[no-any-return]


#: Checksum algorithms by manifest name -> factory.
CHECKSUMS: dict[str, Callable[[], _Checksum]] = {"crc32": _Crc32, "xxh3_64": _Xxh3}


def _have_xxhash() -> bool:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


#: Algorithm used when ``checksum=None``: xxh3_64 (~4x faster than zlib's crc32 here) when the
#: ``xxhash`` package is installed, else crc32 (standard library).
DEFAULT_CHECKSUM = "xxh3_64" if _have_xxhash() else "crc32"


def _algo(name: Optional[str]) -> _Checksum:
    name = DEFAULT_CHECKSUM if name is None else name
    if name not in CHECKSUMS:
        raise CheckpointError(f"unknown checksum {name!r}; known: {sorted(CHECKSUMS)}")
    return CHECKSUMS[name]()


# Crash-test hook: tests set this in a child process to pause or die at a named point
# ("data_started", "data_written", "part_written", "manifest_written", "committed").
_TEST_HOOK: Optional[Callable[[str], None]] = None


def _hook(point: str) -> None:
    if _TEST_HOOK is not None:
        _TEST_HOOK(point)


# ----------------------------------------------------------------------------------------------
# Results


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
    committed: Optional[bool] = None  #: set by ``AsyncCheckpointer(commit=True)``: try_commit's result


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


# ----------------------------------------------------------------------------------------------
# Filesystem helpers


@dataclass(frozen=True)
class _Loc:
    fs: pafs.FileSystem
    root: str
    uri: str

    @property
    def local(self) -> bool:
        return self.fs.type_name == "local"

    @property
    def renames(self) -> bool:
        """Whether ``move`` is an atomic rename (else each object appears whole on close)."""
        return self.fs.type_name in ("local", "hdfs")

    def step_dir(self, step: int) -> str:
        return posixpath.join(self.root, f"step-{step:020d}") if self.root else f"step-{step:020d}"


URI = Union[str, "os.PathLike[str]", tuple]


def _resolve(uri: URI) -> _Loc:
    """``uri``: a local path, a URI pyarrow understands (file://, s3://, gs://, hdfs://, ...), or a
    ``(pyarrow.fs.FileSystem, path)`` pair for a filesystem configured by the caller."""
    if isinstance(uri, tuple):
        fs, path = uri
        if not isinstance(fs, pafs.FileSystem):
            raise CheckpointError(f"uri pair must be (pyarrow.fs.FileSystem, path), got {type(fs).__name__}")
        return _Loc(fs, str(path).rstrip("/"), f"{fs.type_name}:{path}")
    text = os.fspath(uri)
    if not isinstance(text, str) or not text:
        raise CheckpointError(f"bad checkpoint uri {uri!r}")
    if "://" not in text:
        text = os.path.abspath(text)
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot open checkpoint uri {text!r}: {exc}") from exc
    return _Loc(fs, path.rstrip("/") if path != "/" else path, text)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= int(step) <= _MAX_STEP:
        raise CheckpointError(f"step must be an int in [0, 1e20), got {step!r}")
    return int(step)


def _info(fs: pafs.FileSystem, path: str) -> pafs.FileInfo:
    return fs.get_file_info(path)


def _read_all(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path, compression=None) as f:
        return f.read()  # type: ignore[no-any-return]


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_atomic(loc: _Loc, path: str, data: bytes, *, fsync: bool, sync_dir: bool = True) -> None:
    """Write a small file so that readers see either nothing / the old content or all of it.

    With ``fsync`` (local filesystems) the content is flushed before the rename, so after a machine
    crash the name never points at a short file; ``sync_dir`` also flushes the directory entry."""
    target = f"{path}.tmp-{uuid.uuid4().hex[:12]}" if loc.renames else path
    with loc.fs.open_output_stream(target, compression=None) as out:
        out.write(data)
    if loc.local and fsync:
        _fsync_path(target)
    if target != path:
        loc.fs.move(target, path)
    if loc.local and fsync and sync_dir:
        _fsync_path(posixpath.dirname(path), directory=True)


# ----------------------------------------------------------------------------------------------
# Shard input


def local_shards(tensors: Mapping[str, TensorLike], rank: int = 0) -> list[tuple[ShardRecord, torch.Tensor]]:
    """``write_part`` input from the store's user form: names -> ``torch.Tensor`` (whole) or ``Shard``.

    Raises:
        LayoutError: bad names, dtypes or boxes.
    """
    out = []
    for name in sorted(tensors):
        t, box, gshape, dt = local_box(name, tensors[name])
        out.append((ShardRecord(name, dt, tuple(gshape), box, contiguous_strides(box.sizes), rank, 0, 0), t))
    return out


def owned_shards(shards: Sequence[tuple[ShardRecord, torch.Tensor]], layouts: Mapping[str, TensorLayout],
                 rank: int) -> list[tuple[ShardRecord, torch.Tensor]]:
    """Keep the shards this rank writes: of replicas (the same box on several ranks in ``layouts``),
    only the lowest rank writes. Shards whose box ``layouts`` does not list are kept."""
    out = []
    for rec, t in shards:
        lay = layouts.get(rec.name)
        holders = [s.rank for s in lay.shards if s.box == rec.box] if lay is not None else []
        if not holders or min(holders) >= rank:
            out.append((rec, t))
    return out


def _validate_shards(shards: Sequence[tuple[ShardRecord, torch.Tensor]]) -> list[tuple[ShardRecord, torch.Tensor]]:
    seen: set = set()
    out = []
    for item in shards:
        try:
            rec, t = item
        except (TypeError, ValueError):
            raise LayoutError(f"shards must be (ShardRecord, torch.Tensor) pairs, got {item!r:.80}") from None
        if not isinstance(rec, ShardRecord) or not isinstance(t, torch.Tensor):
            raise LayoutError(f"shards must be (ShardRecord, torch.Tensor) pairs, got "
                              f"({type(rec).__name__}, {type(t).__name__})")
        validate_name(rec.name)
        if rec.dtype not in DTYPES:
            raise LayoutError(f"tensor {rec.name!r}: unknown dtype name {rec.dtype!r}")
        got = dtype_name(t.dtype, tensor=rec.name)
        if got != rec.dtype:
            raise LayoutError(f"tensor {rec.name!r}: record dtype {rec.dtype} but the tensor is {got}")
        if tuple(t.shape) != tuple(rec.box.sizes):
            raise LayoutError(f"tensor {rec.name!r}: tensor shape {tuple(t.shape)} differs from the record's box "
                              f"sizes {rec.box.sizes}")
        if not rec.box.within(rec.global_shape):
            raise LayoutError(f"tensor {rec.name!r}: box {rec.box.offsets}+{rec.box.sizes} is out of bounds of "
                              f"{rec.global_shape}")
        if t.device.type not in ("cpu", "cuda"):
            raise LayoutError(f"tensor {rec.name!r}: device {t.device} is not supported (cpu or cuda)")
        key = (rec.name, rec.box)
        if key in seen:
            raise LayoutError(f"tensor {rec.name!r}: box {rec.box.offsets}+{rec.box.sizes} given twice")
        seen.add(key)
        out.append((rec, t.detach()))
    out.sort(key=lambda p: (p[0].name, p[0].box.offsets, p[0].box.sizes))
    return out


def _u8(t: torch.Tensor) -> np.ndarray:
    """Bytes of a contiguous CPU tensor as a numpy uint8 array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _chunks(t: torch.Tensor, chunk: int) -> Iterator[np.ndarray]:
    """The tensor's bytes in row-major order, at most ~``chunk`` bytes of host memory at a time."""
    n = t.numel() * t.element_size()
    if n == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        flat = _u8(t)
        for i in range(0, n, chunk):
            yield flat[i:i + chunk]
        return
    if t.dim() == 0 or n <= chunk:
        yield _u8(t.contiguous().cpu())
        return
    row = max(1, n // t.shape[0])
    per = max(1, chunk // row)
    for i in range(0, t.shape[0], per):
        yield _u8(t[i:i + per].contiguous().cpu())


def _file_layout(shards: Sequence[tuple[ShardRecord, torch.Tensor]]) -> tuple[list[int], int]:
    offs, pos = [], 0
    for rec, _ in shards:
        pos = -(-pos // ALIGN) * ALIGN
        offs.append(pos)
        pos += rec.nbytes
    return offs, pos


class _BlockSums:
    """Running per-block checksums of one shard's bytes fed in order (chunks of any size)."""

    def __init__(self, algo: _Checksum, block: int):
        self.algo, self.block = algo, block
        self.sums: list[int] = []
        self._state: Any = None
        self._len = 0

    def feed(self, data: np.ndarray) -> None:
        mv = memoryview(data).cast("B")
        pos, n = 0, len(mv)
        while pos < n:
            take = min(self.block - self._len, n - pos)
            piece = mv[pos:pos + take]
            if take == self.block:  # a whole block in one piece: one-shot
                self.sums.append(self.algo.digest(piece))
            else:
                if self._state is None:
                    self._state = self.algo.new()
                self._state = self.algo.update(self._state, piece)
                self._len += take
                if self._len == self.block:
                    self._flush()
            pos += take

    def _flush(self) -> None:
        self.sums.append(self.algo.value(self._state))
        self._state, self._len = None, 0

    def finish(self) -> list[int]:
        if self._len:
            self._flush()
        return self.sums


def _block_size_ok(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < ALIGN or block_size % ALIGN:
        raise CheckpointError(f"block_size must be a positive multiple of {ALIGN}, got {block_size!r}")
    return block_size


def _write_data(loc: _Loc, path: str, shards: Sequence[tuple[ShardRecord, Any]], offsets: Sequence[int],
                chunks_of: Callable[[int], Iterable[np.ndarray]], *, algo: _Checksum, block_size: int,
                fsync: bool) -> list[list[int]]:
    """Write the data file (to a temporary name, renamed into place where possible) and return the
    per-shard block checksums. Checksums of a chunk are computed on a helper thread while the
    chunk is written (both release the GIL)."""
    target = f"{path}.tmp-{uuid.uuid4().hex[:12]}" if loc.renames else path
    out_sums: list[list[int]] = []
    pool = ThreadPoolExecutor(1, thread_name_prefix="astate-ckpt-sum")
    first = True
    try:
        with loc.fs.open_output_stream(target, compression=None) as out:
            pos = 0
            for i, (rec, _) in enumerate(shards):
                pad = offsets[i] - pos
                if pad:
                    out.write(b"\0" * pad)
                    pos += pad
                sums = _BlockSums(algo, block_size)
                pending: Optional[Future] = None
                for ch in chunks_of(i):
                    fut = pool.submit(sums.feed, ch)
                    out.write(ch)
                    pos += len(ch)
                    if pending is not None:
                        pending.result()
                    pending = fut
                    if first:
                        first = False
                        _hook("data_started")
                if pending is not None:
                    pending.result()
                out_sums.append(sums.finish())
        if loc.local and fsync:
            _fsync_path(target)
        if target != path:
            loc.fs.move(target, path)
    except BaseException:
        if target != path:
            try:
                loc.fs.delete_file(target)
            except (OSError, pa.ArrowException):
                pass
        raise
    finally:
        pool.shutdown(wait=True)
    return out_sums


def _manifest_table(rows: Sequence[ShardRecord], rank_of: Sequence[int], files: Sequence[str],
                    offsets: Sequence[int], sums: Sequence[Sequence[int]], block_size: int) -> pa.Table:
    return pa.table(
        {
            "name": [r.name for r in rows],
            "dtype": [r.dtype for r in rows],
            "global_shape": [list(r.global_shape) for r in rows],
            "offsets": [list(r.box.offsets) for r in rows],
            "sizes": [list(r.box.sizes) for r in rows],
            "rank": list(rank_of),
            "file": list(files),
            "byte_offset": list(offsets),
            "length": [r.nbytes for r in rows],
            "block_size": [block_size] * len(rows),
            "checksums": [list(s) for s in sums],
        },
        schema=MANIFEST_SCHEMA,
    )


def _parquet_bytes(table: pa.Table, meta: dict) -> bytes:
    table = table.replace_schema_metadata({"astate.checkpoint": json.dumps(meta, sort_keys=True)})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()  # type: ignore[no-any-return]


def _parquet_meta(table: pa.Table) -> dict:
    raw = (table.schema.metadata or {}).get(b"astate.checkpoint")
    if raw is None:
        raise ValueError("no astate.checkpoint metadata")
    meta = json.loads(raw)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else meta!r} is not {FORMAT}")
    return meta


# ----------------------------------------------------------------------------------------------
# Writing


def write_part(uri: URI, step: int, rank: int, world_size: int, shards: Sequence[tuple[ShardRecord, torch.Tensor]],
               *, layouts: Optional[Mapping[str, TensorLayout]] = None, attempt: str = "",
               checksum: Optional[str] = None, block_size: int = BLOCK_SIZE, fsync: bool = True) -> PartInfo:
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

    Returns:
        PartInfo of the written part. Other ranks' parts and :func:`try_commit` complete the step.

    Raises:
        LayoutError: a bad record / tensor pair (before anything is written).
        CheckpointError: the step is already committed under ``uri`` (checkpoints are immutable), a
            bad argument, or a filesystem error.
    """
    t0 = time.perf_counter()
    step = _check_step(step)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise CheckpointError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    algo = _algo(checksum)
    block_size = _block_size_ok(block_size)
    items = _validate_shards(shards)
    if layouts is not None:
        items = owned_shards(items, layouts, rank)
    loc = _resolve(uri)
    sdir = loc.step_dir(step)
    try:
        if _info(loc.fs, posixpath.join(sdir, COMMIT_NAME)).type != pafs.FileType.NotFound:
            raise CheckpointError(f"step {step} is already committed under {loc.uri}; checkpoints are immutable")
        loc.fs.create_dir(sdir, recursive=True)
        offsets, file_bytes = _file_layout(items)
        fname = f"rank-{rank:05d}-{uuid.uuid4().hex[:16]}.bin"
        sums = _write_data(loc, posixpath.join(sdir, fname), items, offsets,
                           lambda i: _chunks(items[i][1], _WRITE_CHUNK), algo=algo,
                           block_size=block_size, fsync=fsync)
        _hook("data_written")
        info = _write_part_manifest(loc, step, rank, world_size, attempt, fname, file_bytes,
                                    [r for r, _ in items], offsets, sums, algo.name, block_size, fsync)
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointError(f"step {step} rank {rank}: writing under {loc.uri} failed: {exc}") from exc
    return replace(info, seconds=time.perf_counter() - t0)


def _write_part_manifest(loc: _Loc, step: int, rank: int, world_size: int, attempt: str, fname: str,
                         file_bytes: int, recs: Sequence[ShardRecord], offsets: Sequence[int],
                         sums: Sequence[Sequence[int]], checksum: str, block_size: int, fsync: bool) -> PartInfo:
    table = _manifest_table(recs, [rank] * len(recs), [fname] * len(recs), offsets, sums, block_size)
    meta = {"format": FORMAT, "kind": "part", "step": step, "rank": rank, "world_size": world_size,
            "attempt": str(attempt), "file": fname, "file_bytes": file_bytes, "checksum": checksum,
            "block_size": block_size}
    pname = f"rank-{rank:05d}.part.parquet"
    # The directory entries of the data file and the part are flushed by the committer (one fsync of
    # the step directory before COMMIT covers every rank's names).
    _put_atomic(loc, posixpath.join(loc.step_dir(step), pname), _parquet_bytes(table, meta), fsync=fsync,
                sync_dir=False)
    _hook("part_written")
    return PartInfo(step, rank, world_size, loc.uri, fname, pname, sum(r.nbytes for r in recs), file_bytes,
                    len(recs), 0.0)


def try_commit(uri: URI, step: int, world_size: int, *, attempt: Optional[str] = None, fsync: bool = True,
               cleanup: bool = True) -> bool:
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
    step = _check_step(step)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"world_size must be a positive int, got {world_size!r}")
    loc = _resolve(uri)
    sdir = loc.step_dir(step)
    try:
        if _info(loc.fs, posixpath.join(sdir, COMMIT_NAME)).type != pafs.FileType.NotFound:
            return True
        paths = [posixpath.join(sdir, f"rank-{r:05d}.part.parquet") for r in range(world_size)]
        if any(i.type == pafs.FileType.NotFound for i in loc.fs.get_file_info(paths)):
            return False
        tables, metas = [], []
        for r, p in enumerate(paths):
            try:
                table = pq.read_table(pa.BufferReader(_read_all(loc.fs, p)))
                meta = _parquet_meta(table)
            except FileNotFoundError:
                return False
            except (ValueError, pa.ArrowException) as exc:
                raise CheckpointCorrupted(f"step {step}: part manifest {p} is unreadable: {exc}") from exc
            if (meta.get("step"), meta.get("rank"), meta.get("world_size")) != (step, r, world_size) or \
                    (attempt is not None and meta.get("attempt") != str(attempt)):
                log.debug("step %d: part %s is from another run (%s); not committing", step, p, meta)
                return False
            tables.append(table)
            metas.append(meta)
        if len({(m["checksum"], m["block_size"]) for m in metas}) != 1:
            raise CheckpointError(f"step {step}: ranks used different checksum settings "
                                  f"{sorted({(m['checksum'], m['block_size']) for m in metas})}")
        files = {m["file"]: int(m["file_bytes"]) for m in metas}
        infos = loc.fs.get_file_info([posixpath.join(sdir, f) for f in files])
        for (f, size), inf in zip(files.items(), infos):
            if inf.type == pafs.FileType.NotFound:
                raise CheckpointCorrupted(f"step {step}: data file {posixpath.join(sdir, f)} of a part is missing")
            if inf.size != size:
                raise CheckpointCorrupted(f"step {step}: data file {posixpath.join(sdir, f)} has {inf.size} bytes, "
                                          f"its part manifest says {size}")
        table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
        table = table.take(pc.sort_indices(table, sort_keys=[("name", "ascending"), ("rank", "ascending"),
                                                            ("byte_offset", "ascending")]))
        try:
            recs = _records(table)
            layouts = group_layouts(recs)
        except (LayoutError, ValueError) as exc:
            raise CheckpointError(f"step {step}: the parts do not form a checkpoint: {exc}") from exc
        meta = {"format": FORMAT, "kind": "manifest", "step": step, "world_size": world_size,
                "checksum": metas[0]["checksum"], "block_size": metas[0]["block_size"]}
        data = _parquet_bytes(table, meta)
        crc = zlib.crc32(data)
        mname = f"manifest-{crc:08x}.parquet"
        _put_atomic(loc, posixpath.join(sdir, mname), data, fsync=fsync)
        _hook("manifest_written")
        marker = {
            "format": FORMAT,
            "step": step,
            "world_size": world_size,
            "manifest": mname,
            "manifest_bytes": len(data),
            "manifest_crc32": crc,
            "files": files,
            "bytes": int(sum(lay.nbytes for lay in layouts.values())),
            "tensors": len(layouts),
            "shards": table.num_rows,
            "checksum": meta["checksum"],
            "block_size": meta["block_size"],
            "written_at": time.time(),
        }
        _put_atomic(loc, posixpath.join(sdir, COMMIT_NAME), json.dumps(marker, sort_keys=True).encode(), fsync=fsync)
        if loc.local and fsync:
            _fsync_path(loc.root, directory=True)  # the step directory's own entry
        _hook("committed")
        if cleanup:
            _cleanup(loc, sdir, set(files))
        return True
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointError(f"step {step}: committing under {loc.uri} failed: {exc}") from exc


def _cleanup(loc: _Loc, sdir: str, keep: set) -> None:
    try:
        entries = loc.fs.get_file_info(pafs.FileSelector(sdir, allow_not_found=True))
    except (OSError, pa.ArrowException):
        return
    for e in entries:
        base = e.base_name
        if _DATA_RE.match(base) and base not in keep:
            try:
                loc.fs.delete_file(e.path)
            except (OSError, pa.ArrowException):
                pass


# ----------------------------------------------------------------------------------------------
# Reading the catalog of checkpoints


def list_checkpoints(uri: URI) -> list[int]:
    """Steps with a complete checkpoint (a commit marker) under ``uri``, ascending; [] if none."""
    loc = _resolve(uri)
    try:
        entries = loc.fs.get_file_info(pafs.FileSelector(loc.root, allow_not_found=True))
    except (OSError, pa.ArrowException):
        return []
    steps = []
    for e in entries:
        m = _STEP_RE.match(e.base_name)
        if m and e.type == pafs.FileType.Directory:
            steps.append(int(m.group(1)))
    if not steps:
        return []
    steps.sort()
    infos = loc.fs.get_file_info([posixpath.join(loc.step_dir(s), COMMIT_NAME) for s in steps])
    return [s for s, i in zip(steps, infos) if i.type == pafs.FileType.File]


def _marker(loc: _Loc, step: Optional[int]) -> tuple[int, dict]:
    if step is None:
        steps = list_checkpoints((loc.fs, loc.root))
        if not steps:
            raise CheckpointNotFound(f"no complete checkpoint under {loc.uri}")
        step = steps[-1]
    else:
        step = _check_step(step)
    sdir = loc.step_dir(step)
    path = posixpath.join(sdir, COMMIT_NAME)
    try:
        raw = _read_all(loc.fs, path)
    except FileNotFoundError:
        partial = _info(loc.fs, sdir).type == pafs.FileType.Directory
        raise CheckpointNotFound(f"no complete checkpoint of step {step} under {loc.uri}"
                                 f"{' (only an uncommitted partial one)' if partial else ''}; complete: "
                                 f"{list_checkpoints((loc.fs, loc.root))}") from None
    try:
        marker = json.loads(raw)
        if not isinstance(marker, dict) or marker.get("format") != FORMAT or marker.get("step") != step:
            raise ValueError(f"format/step {marker.get('format') if isinstance(marker, dict) else marker!r}")
        for k in ("manifest", "manifest_bytes", "manifest_crc32", "files", "world_size", "checksum", "block_size"):
            if k not in marker:
                raise ValueError(f"missing {k!r}")
    except ValueError as exc:
        raise CheckpointCorrupted(f"step {step}: commit marker {path} is malformed: {exc}") from None
    return step, marker


def checkpoint_info(uri: URI, step: Optional[int] = None) -> CheckpointInfo:
    """The commit marker of ``step`` (default: the newest complete one).

    Raises:
        CheckpointNotFound: no complete checkpoint (of that step).
        CheckpointCorrupted: a malformed commit marker.
    """
    loc = _resolve(uri)
    step, m = _marker(loc, step)
    return CheckpointInfo(step, loc.uri, int(m["world_size"]), int(m.get("bytes", 0)), int(m.get("tensors", 0)),
                          int(m.get("shards", 0)), dict(m["files"]), m["manifest"], m["checksum"],
                          int(m["block_size"]), float(m.get("written_at", 0.0)))


def _load_manifest(loc: _Loc, step: int, marker: dict) -> pa.Table:
    path = posixpath.join(loc.step_dir(step), marker["manifest"])
    try:
        data = _read_all(loc.fs, path)
    except FileNotFoundError:
        raise CheckpointCorrupted(f"step {step}: manifest {path} is missing") from None
    if len(data) != marker["manifest_bytes"] or zlib.crc32(data) != marker["manifest_crc32"]:
        raise CheckpointCorrupted(f"step {step}: manifest {path} fails its size/crc32 check "
                                  f"({len(data)} bytes, commit marker says {marker['manifest_bytes']})")
    try:
        table = pq.read_table(pa.BufferReader(data))
        _parquet_meta(table)
        if not table.schema.remove_metadata().equals(MANIFEST_SCHEMA):
            raise ValueError(f"columns {table.schema.names}")
    except (ValueError, pa.ArrowException) as exc:
        raise CheckpointCorrupted(f"step {step}: manifest {path} is unreadable: {exc}") from exc
    return table


def read_manifest(uri: URI, step: Optional[int] = None) -> pa.Table:
    """The merged manifest of a complete checkpoint as a ``pyarrow.Table`` (one row per shard).

    Raises:
        CheckpointNotFound, CheckpointCorrupted.
    """
    loc = _resolve(uri)
    step, marker = _marker(loc, step)
    return _load_manifest(loc, step, marker)


def _records(table: pa.Table, file_index: Optional[Mapping[str, int]] = None) -> list[ShardRecord]:
    cols = table.to_pydict()
    files = cols["file"]
    out = []
    for i in range(table.num_rows):
        sizes = tuple(cols["sizes"][i])
        dt = cols["dtype"][i]
        if dt not in DTYPES:
            raise LayoutError(f"tensor {cols['name'][i]!r}: unknown dtype {dt!r}")
        if cols["length"][i] != math.prod(sizes) * itemsize(dt):
            raise LayoutError(f"tensor {cols['name'][i]!r}: length {cols['length'][i]} does not match sizes {sizes}")
        out.append(ShardRecord(cols["name"][i], dt, tuple(cols["global_shape"][i]),
                               Box(tuple(cols["offsets"][i]), sizes), contiguous_strides(sizes),
                               file_index[files[i]] if file_index is not None else int(cols["rank"][i]), 0,
                               int(cols["byte_offset"][i])))
    return out


# ----------------------------------------------------------------------------------------------
# Restoring


class _File:
    """One data file of a checkpoint being restored: its shards (sorted by byte offset), their
    block checksums, and a way to read it (a private memory map for local files, ``read_at``
    through a pyarrow RandomAccessFile otherwise)."""

    def __init__(self, loc: _Loc, path: str, name: str, size: int):
        self.loc, self.path, self.name, self.size = loc, path, name, size
        self.starts = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)
        self.sum_base = np.zeros(0, np.int64)
        self.labels: list[str] = []
        self.verified: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._mm: Optional[mmap.mmap] = None
        self.tensor: Optional[torch.Tensor] = None
        self.mv: Optional[memoryview] = None
        self._remote: Any = None

    def open(self) -> None:
        if self.loc.local:
            if self.size == 0:
                self.tensor = torch.zeros(0, dtype=torch.uint8)
                self.mv = memoryview(b"")
                return
            with open(self.path, "rb") as f:
                # ACCESS_COPY: a private mapping, writable in memory (torch wants writable arrays);
                # nothing ever writes to it, so no page is copied and the file is never changed.
                self._mm = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY)
            if hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
                try:
                    self._mm.madvise(mmap.MADV_SEQUENTIAL)
                except OSError:
                    pass
            arr = np.frombuffer(self._mm, dtype=np.uint8)
            self.tensor = torch.from_numpy(arr)
            self.mv = memoryview(self._mm)
        else:
            self._remote = self.loc.fs.open_input_file(self.path)

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, memoryview]:
        """Bytes ``[lo, hi)`` as a writable uint8 tensor (remote files) plus a memoryview of them."""
        buf = self._remote.read_at(hi - lo, lo)
        if len(buf) != hi - lo:
            raise CheckpointCorrupted(f"data file {self.path} is short: wanted bytes [{lo}, {hi}), got {len(buf)}")
        arr = np.frombuffer(buf, dtype=np.uint8).copy()
        return torch.from_numpy(arr), memoryview(arr)

    def close(self) -> None:
        self.tensor = None
        if self.mv is not None:
            self.mv.release()
            self.mv = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it
                pass
            self._mm = None
        if self._remote is not None:
            self._remote.close()
            self._remote = None

    def claim(self, shard: int, lo: int, hi: int) -> list[int]:
        """Blocks ``[lo, hi)`` of a shard not verified yet (marked as taken)."""
        with self._lock:
            v = self.verified[shard]
            todo = [int(b) for b in np.flatnonzero(~v[lo:hi]) + lo]
            v[todo] = True
        return todo


@dataclass
class _Item:
    file: int
    dst: int
    so: int  # source byte offset of the first run
    do: int  # destination byte offset of the first run
    n: int  # runs
    length: int  # source bytes per run
    sdelta: int
    ddelta: int
    sdt: int
    ddt: int


@dataclass
class _Ctx:
    step: int
    files: list
    dests: list
    sums: np.ndarray
    algo: _Checksum
    block: int
    verify: bool
    errors: list = field(default_factory=list)


def _progressions(reads: np.ndarray) -> list[_Item]:
    """Group reads (sorted by file and source offset) into arithmetic progressions: runs of equal
    length whose source and destination offsets advance by constant steps. A column slice of a
    row-major shard becomes one strided copy instead of one copy per row."""
    n = len(reads)
    if n == 0:
        return []
    so = reads["src_offset"].astype(np.int64)
    do = reads["dst_offset"].astype(np.int64)
    ln = reads["length"].astype(np.int64)
    fr = reads["src_rank"].astype(np.int64)
    dr = reads["dst_region"].astype(np.int64)
    sd = reads["src_dtype"].astype(np.int64)
    dd = reads["dst_dtype"].astype(np.int64)
    if n == 1:
        return [_Item(int(fr[0]), int(dr[0]), int(so[0]), int(do[0]), 1, int(ln[0]), 0, 0, int(sd[0]), int(dd[0]))]
    dso = np.diff(so)
    ddo = np.diff(do)
    # link i joins read i to read i + 1
    link = (fr[1:] == fr[:-1]) & (dr[1:] == dr[:-1]) & (ln[1:] == ln[:-1]) & (sd[1:] == sd[:-1]) & \
        (dd[1:] == dd[:-1]) & (dso >= ln[:-1]) & (ddo > 0)
    # a new link group starts where a link is invalid or its deltas differ from the previous link
    same = np.zeros(n - 1, bool)
    same[1:] = link[1:] & link[:-1] & (dso[1:] == dso[:-1]) & (ddo[1:] == ddo[:-1])
    starts = np.flatnonzero(~same)
    ends = np.append(starts[1:], n - 1)  # link group g covers links [starts[g], ends[g])
    out: list[_Item] = []
    nxt = 0  # first read not yet assigned
    so_l, do_l, ln_l, fr_l, dr_l, sd_l, dd_l = (a.tolist() for a in (so, do, ln, fr, dr, sd, dd))
    dso_l, ddo_l, link_l = dso.tolist(), ddo.tolist(), link.tolist()

    def single(i: int) -> None:
        out.append(_Item(fr_l[i], dr_l[i], so_l[i], do_l[i], 1, ln_l[i], 0, 0, sd_l[i], dd_l[i]))

    for a, b in zip(starts.tolist(), ends.tolist()):
        if not link_l[a]:
            continue
        first = max(a, nxt)  # reads first..b are a progression when first < b
        while nxt < first:
            single(nxt)
            nxt += 1
        if first >= b + 1:
            continue
        cnt = b + 1 - first
        if cnt == 1:
            continue
        out.append(_Item(fr_l[first], dr_l[first], so_l[first], do_l[first], cnt, ln_l[first], dso_l[first],
                         ddo_l[first], sd_l[first], dd_l[first]))
        nxt = b + 1
    while nxt < n:
        single(nxt)
        nxt += 1
    return out


def _split(items: list[_Item], item_bytes: int) -> list[_Item]:
    """Cut big progressions into work items of about ``item_bytes`` source bytes (element aligned)."""
    out = []
    for it in items:
        if it.n == 1 and it.length > item_bytes:
            sisz, disz = itemsize(DTYPE_CODES[it.sdt]), itemsize(DTYPE_CODES[it.ddt])
            step = max(sisz, item_bytes // sisz * sisz)
            for p in range(0, it.length, step):
                ln = min(step, it.length - p)
                out.append(_Item(it.file, it.dst, it.so + p, it.do + p // sisz * disz, 1, ln, 0, 0, it.sdt, it.ddt))
        elif it.n > 1 and it.n * max(it.sdelta, 1) > item_bytes:
            k = max(1, item_bytes // max(it.sdelta, 1))
            for j in range(0, it.n, k):
                m = min(k, it.n - j)
                out.append(_Item(it.file, it.dst, it.so + j * it.sdelta, it.do + j * it.ddelta, m, it.length,
                                 it.sdelta, it.ddelta, it.sdt, it.ddt))
        else:
            out.append(it)
    return out


def _touched(f: _File, it: _Item, block: int) -> list[tuple[int, int, int]]:
    """(shard, first block, end block) of every block an item reads."""
    hi_all = it.so + (it.n - 1) * it.sdelta + it.length
    if it.n == 1 or it.sdelta - it.length < block:
        spans = [(it.so, hi_all)]
    else:
        spans = [(it.so + j * it.sdelta, it.so + j * it.sdelta + it.length) for j in range(it.n)]
    out = []
    for lo, hi in spans:
        s = int(np.searchsorted(f.starts, lo, side="right")) - 1
        while s < len(f.starts) and f.starts[s] < hi:
            s0 = int(f.starts[s])
            s1 = s0 + int(f.lengths[s])
            a, b = max(lo, s0), min(hi, s1)
            if b > a:
                out.append((s, (a - s0) // block, (b - 1 - s0) // block + 1))
            s += 1
    return out


def _verify_blocks(ctx: _Ctx, f: _File, shard: int, blocks: Iterable[int], mv: memoryview, base: int) -> None:
    s0 = int(f.starts[shard])
    n = int(f.lengths[shard])
    for k in blocks:
        a = s0 + k * ctx.block
        b = min(a + ctx.block, s0 + n)
        got = ctx.algo.digest(mv[a - base:b - base])
        want = int(ctx.sums[int(f.sum_base[shard]) + k])
        if got != want:
            raise CheckpointCorrupted(
                f"step {ctx.step}: tensor {f.labels[shard]} in file {f.path}: block {k} (bytes [{a}, {b})) fails "
                f"its checksum (stored {want:#x}, read {got:#x})")


def _run_item(ctx: _Ctx, it: _Item) -> None:
    f: _File = ctx.files[it.file]
    hi = it.so + (it.n - 1) * it.sdelta + it.length
    if f.loc.local:
        src_all, base = f.tensor, 0
        assert src_all is not None and f.mv is not None
        if hi > f.size:
            raise CheckpointCorrupted(f"step {ctx.step}: data file {f.path} is short ({f.size} bytes, need {hi})")
        if ctx.verify:
            for shard, b0, b1 in _touched(f, it, ctx.block):
                todo = f.claim(shard, b0, b1)
                if todo:
                    _verify_blocks(ctx, f, shard, todo, f.mv, 0)
    else:
        if ctx.verify:
            touched = _touched(f, it, ctx.block)
            lo = min(int(f.starts[s]) + b0 * ctx.block for s, b0, _ in touched) if touched else it.so
            rd_hi = max(min(int(f.starts[s]) + b1 * ctx.block, int(f.starts[s] + f.lengths[s]))
                        for s, _, b1 in touched) if touched else hi
            lo, rd_hi = min(lo, it.so), max(rd_hi, hi)
        else:
            touched, lo, rd_hi = [], it.so, hi
        src_all, mv = f.read(lo, rd_hi)
        base = lo
        for shard, b0, b1 in touched:
            _verify_blocks(ctx, f, shard, range(b0, b1), mv, lo)
    sdt, ddt = torch_dtype(DTYPE_CODES[it.sdt]), torch_dtype(DTYPE_CODES[it.ddt])
    sisz, disz = itemsize(DTYPE_CODES[it.sdt]), itemsize(DTYPE_CODES[it.ddt])
    elems = it.length // sisz
    src = src_all[it.so - base:hi - base].view(sdt)
    dst_t: torch.Tensor = ctx.dests[it.dst]
    doff = dst_t.storage_offset() + it.do // disz
    if it.n == 1:
        s_view = src
        d_view = dst_t.as_strided((elems,), (1,), doff)
    else:
        s_view = src.as_strided((it.n, elems), (it.sdelta // sisz, 1))
        d_view = dst_t.as_strided((it.n, elems), (it.ddelta // disz, 1), doff)
    with torch.no_grad():
        d_view.copy_(s_view)


def _dest_entries(buffers: Mapping[str, TensorLike]) -> list[tuple[str, torch.Tensor, Box, tuple, str]]:
    if not isinstance(buffers, Mapping):
        raise LayoutError(f"restore(buffers) must map names to tensors or Shards, got {type(buffers).__name__}")
    if not buffers:
        raise LayoutError("restore(buffers) is empty")
    out = []
    for name in sorted(buffers):
        t, box, gshape, dt = local_box(name, buffers[name])
        if t.device.type not in ("cpu", "cuda"):
            raise LayoutError(f"tensor {name!r}: device {t.device} is not supported (cpu or cuda)")
        out.append((name, t.detach(), box, tuple(gshape), dt))
    return out


def restore(uri: URI, buffers: Mapping[str, TensorLike], *, step: Optional[int] = None, verify: bool = True,
            threads: Optional[int] = None) -> int:
    """Fill preallocated buffers, in place, from the newest complete checkpoint under ``uri`` (or ``step``).

    Buffers may have any layout (resharding): each reads only the byte ranges of its box, from
    whichever saved shards hold them, through a memory map (local files) or ranged reads (other
    filesystems, coalesced into reads of up to ~32 MiB). A float buffer of another float dtype than
    the saved one is converted on the fly.

    Args:
        buffers: names -> ``torch.Tensor`` (the whole tensor) or ``Shard`` (a box), any strides, CPU or
            CUDA; any subset of the saved names.
        step: the step to restore (None: the newest complete one; an older one is never substituted
            when the newest is corrupted).
        verify: check the checksum of every block read (the default). With it a restore reads each
            whole 4 MiB block it touches; a corrupted block raises before its bytes are copied, but
            blocks read before it may already be in the buffers.
        threads: worker threads (default: up to 4, at most the CPU count).

    Returns:
        The restored step.

    Raises:
        CheckpointNotFound: no complete checkpoint under ``uri`` (or of ``step``).
        LayoutError: a buffer with an unknown name, another global shape, a bad box, or a dtype that
            is not the saved one or a float -> float conversion (before any byte is written).
        CheckpointCorrupted: a malformed marker or manifest, a missing or short data file (before
            any byte is written), or a block failing its checksum.
    """
    dests = _dest_entries(buffers)
    loc = _resolve(uri)
    step, marker = _marker(loc, step)
    table = _load_manifest(loc, step, marker)
    names = {d[0] for d in dests}
    all_names = set(table.column("name").to_pylist())
    for name, t, box, gshape, dt in dests:
        if name not in all_names:
            near = ", ".join(sorted(all_names)[:8])
            raise LayoutError(f"tensor {name!r} is not in checkpoint step {step} ({near}"
                              f"{', ...' if len(all_names) > 8 else ''})")
    table = table.filter(pc.is_in(table.column("name"), value_set=pa.array(sorted(names))))
    file_names = sorted(set(table.column("file").to_pylist()))
    findex = {f: i for i, f in enumerate(file_names)}
    sdir = loc.step_dir(step)
    try:
        recs = _records(table, findex)
        layouts = group_layouts(recs)
    except LayoutError as exc:
        raise CheckpointCorrupted(f"step {step}: manifest {marker['manifest']} is inconsistent: {exc}") from exc
    for name, t, box, gshape, dt in dests:
        lay = layouts[name]
        if lay.global_shape != gshape:
            raise LayoutError(f"tensor {name!r}: buffer expects global shape {gshape}, checkpoint step {step} has "
                              f"{lay.global_shape}")
        if dt != lay.dtype and not (is_floating(dt) and is_floating(lay.dtype)):
            raise LayoutError(f"tensor {name!r}: buffer dtype {dt} does not match checkpoint dtype {lay.dtype}, and "
                              f"{lay.dtype} -> {dt} is not a float conversion")
    request = [ShardRecord(name, dt, gshape, box, tuple(t.stride()), -1, i, 0)
               for i, (name, t, box, gshape, dt) in enumerate(dests)]
    try:
        plan = plan_consumer(layouts, request)
    except PlanError as exc:
        raise LayoutError(str(exc)) from exc
    reads = plan.reads
    if not len(reads):
        return step
    used = sorted(set(np.unique(reads["src_rank"]).tolist()))
    # Files: existence and exact size before any byte is written.
    expect = marker["files"]
    paths = [posixpath.join(sdir, file_names[i]) for i in used]
    infos = loc.fs.get_file_info(paths)
    files: list = [None] * len(file_names)
    for i, p, inf in zip(used, paths, infos):
        fname = file_names[i]
        if inf.type != pafs.FileType.File:
            raise CheckpointCorrupted(f"step {step}: data file {p} is missing")
        want = expect.get(fname)
        if want is None or inf.size != int(want):
            raise CheckpointCorrupted(f"step {step}: data file {p} has {inf.size} bytes, the commit marker says {want}")
        files[i] = _File(loc, p, fname, int(inf.size))
    # Shard tables per file, for checksum lookups.
    cols = table.select(["name", "offsets", "file", "byte_offset", "length", "block_size"]).to_pydict()
    block = int(marker["block_size"])
    sumcol = table.column("checksums").combine_chunks()  # .values + absolute .offsets stay consistent
    sums = sumcol.values.to_numpy(zero_copy_only=False).astype(np.uint64) if len(sumcol) else np.zeros(0, np.uint64)
    sum_off = sumcol.offsets.to_numpy() if len(sumcol) else np.zeros(1, np.int64)
    per_file: dict[int, list[int]] = {}
    for r, fname in enumerate(cols["file"]):
        if cols["block_size"][r] != block:
            raise CheckpointCorrupted(f"step {step}: manifest row {r} has block size {cols['block_size'][r]}, "
                                      f"marker says {block}")
        per_file.setdefault(findex[fname], []).append(r)
    for i in used:
        rows = sorted(per_file.get(i, []), key=lambda r: cols["byte_offset"][r])
        f = files[i]
        f.starts = np.array([cols["byte_offset"][r] for r in rows], np.int64)
        f.lengths = np.array([cols["length"][r] for r in rows], np.int64)
        f.sum_base = np.array([sum_off[r] for r in rows], np.int64)
        for r in rows:
            nb = -(-cols["length"][r] // block)
            if sum_off[r + 1] - sum_off[r] != nb:
                raise CheckpointCorrupted(f"step {step}: manifest lists {sum_off[r + 1] - sum_off[r]} checksums for "
                                          f"tensor {cols['name'][r]!r} shard at {cols['offsets'][r]}, needs {nb}")
        if len(rows) and int((f.starts + f.lengths).max()) > f.size:
            raise CheckpointCorrupted(f"step {step}: data file {f.path} has {f.size} bytes, the manifest places shards "
                                      f"up to byte {int((f.starts + f.lengths).max())}")
        f.labels = [f"{cols['name'][r]!r} (shard at {tuple(cols['offsets'][r])})" for r in rows]
        f.verified = [np.zeros(-(-cols["length"][r] // block), bool) for r in rows]
    order = np.lexsort((reads["src_offset"], reads["src_rank"]))
    items = _split(_progressions(reads[order]), _ITEM)
    if marker["checksum"] not in CHECKSUMS:
        raise CheckpointCorrupted(f"step {step}: unknown checksum {marker['checksum']!r} in the commit marker")
    ctx = _Ctx(step, files, [d[1] for d in dests], sums, CHECKSUMS[marker["checksum"]]() if verify else _Crc32(),
               block, verify)
    nthreads = threads or max(1, min(4, os.cpu_count() or 1))
    try:
        for i in used:
            files[i].open()
        if nthreads == 1 or len(items) == 1:
            for it in items:
                _run_item(ctx, it)
        else:
            with ThreadPoolExecutor(nthreads, thread_name_prefix="astate-restore") as pool:
                futs = [pool.submit(_run_item, ctx, it) for it in items]
                err: Optional[BaseException] = None
                for fut in futs:
                    try:
                        fut.result()
                    except BaseException as exc:  # first error wins; stop the rest
                        if err is None:
                            err = exc
                            for other in futs:
                                other.cancel()
                if err is not None:
                    raise err
        if any(d[1].device.type == "cuda" for d in dests):
            torch.cuda.synchronize()
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointCorrupted(f"step {step}: reading data files under {loc.uri} failed: {exc}") from exc
    finally:
        for f in files:
            if f is not None:
                f.close()
    return step


# ----------------------------------------------------------------------------------------------
# Asynchronous writes


class AsyncCheckpointer:
    """Write parts in a background thread so training continues.

    ``save`` first snapshots this rank's shards into a host buffer laid out exactly like the data
    file (a device-to-host copy for CUDA tensors; pinned memory when CUDA is available), then returns a
    ``Future[PartInfo]``; the tensors may change as soon as ``save`` returns. The background thread
    writes the buffer, the part manifest and, with ``commit=True``, calls :func:`try_commit`
    (``PartInfo.committed`` tells whether that completed the step).

    Two call forms: bind the destination once, ``AsyncCheckpointer(uri, rank, world_size)`` then
    ``save(step, shards)``; or share one checkpointer, ``AsyncCheckpointer()`` then
    ``save(uri, step, rank, world_size, shards)``. Writes run one at a time, in call order.

    Memory is bounded: at most ``max_pending`` snapshots exist at once (``save`` blocks until the
    oldest write finishes when that many are in flight), and buffers are reused, so the host memory
    held is ``max_pending`` x the part size (plus alignment padding).
    """

    def __init__(self, uri: Optional[URI] = None, rank: Optional[int] = None, world_size: Optional[int] = None, *,
                 max_pending: int = 1, commit: bool = True, attempt: str = "", checksum: Optional[str] = None,
                 block_size: int = BLOCK_SIZE, fsync: bool = True):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise CheckpointError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self._algo = _algo(checksum)
        self.uri, self.rank, self.world_size = uri, rank, world_size
        self.max_pending, self.commit, self.attempt = max_pending, commit, attempt
        self.checksum, self.block_size, self.fsync = self._algo.name, _block_size_ok(block_size), fsync
        self._loc = _resolve(uri) if uri is not None else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="astate-ckpt-write")
        self._pending: list[Future] = []
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._closed = False

    def save(self, *args: Any, layouts: Optional[Mapping[str, TensorLayout]] = None,
             attempt: Optional[str] = None) -> "Future[PartInfo]":
        """``save(step, shards)`` or ``save(uri, step, rank, world_size, shards)``: snapshot ``shards``
        now and write them as this rank's part of ``step`` in the background.

        Args:
            shards: as in :func:`write_part`; ``layouts``: as in :func:`write_part`.
            attempt: run tag for this part and its commit (default: the constructor's).

        Raises (synchronously):
            LayoutError: bad shards. CheckpointError: closed, or bad arguments.
        Errors of the write itself (for example a step already committed) are raised by
        ``future.result()``.
        """
        if self._closed:
            raise CheckpointError("AsyncCheckpointer is closed")
        if len(args) == 2:
            if self._loc is None or self.rank is None or self.world_size is None:
                raise CheckpointError("save(step, shards) needs AsyncCheckpointer(uri, rank, world_size); or call "
                                      "save(uri, step, rank, world_size, shards)")
            uri, loc, rank, world = self.uri, self._loc, self.rank, self.world_size
            step, shards = args
        elif len(args) == 5:
            uri, step, rank, world, shards = args
            loc = _resolve(uri)
        else:
            raise CheckpointError("use save(step, shards) or save(uri, step, rank, world_size, shards)")
        step = _check_step(step)
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise CheckpointError(f"world_size must be a positive int, got {world!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise CheckpointError(f"rank must be an int in [0, {world}), got {rank!r}")
        items = _validate_shards(shards)
        if layouts is not None:
            items = owned_shards(items, layouts, rank)
        self._drain(self.max_pending - 1)
        t0 = time.perf_counter()
        offsets, total = _file_layout(items)
        buf = self._buffer(total, any(t.device.type == "cuda" for _, t in items))
        cuda = False
        for (rec, t), off in zip(items, offsets):
            if rec.nbytes == 0:
                continue
            view = buf[off:off + rec.nbytes].view(t.dtype).view(tuple(rec.box.sizes))
            view.copy_(t, non_blocking=t.device.type == "cuda")
            cuda = cuda or t.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        snap = time.perf_counter() - t0
        job = (uri, loc, rank, world, self.attempt if attempt is None else str(attempt))
        fut = self._pool.submit(self._write, job, step, items, offsets, total, buf, snap)
        with self._lock:
            self._pending.append(fut)
        return fut

    def _buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.numel() >= nbytes:
                    return self._free.pop(i)
            if self._free:
                self._free.pop(0)  # too small: drop it, allocate a bigger one
        size = max(nbytes, 1)
        if pin and torch.cuda.is_available():
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return torch.from_numpy(np.empty(size, dtype=np.uint8))

    def _write(self, job: tuple, step: int, items: list, offsets: list, total: int, buf: torch.Tensor,
               snap: float) -> PartInfo:
        uri, loc, rank, world, attempt = job
        t0 = time.perf_counter()
        try:
            sdir = loc.step_dir(step)
            try:
                if _info(loc.fs, posixpath.join(sdir, COMMIT_NAME)).type != pafs.FileType.NotFound:
                    raise CheckpointError(f"step {step} is already committed under {loc.uri}; checkpoints are "
                                          "immutable")
                loc.fs.create_dir(sdir, recursive=True)
                flat = buf.numpy()
                fname = f"rank-{rank:05d}-{uuid.uuid4().hex[:16]}.bin"

                def chunks_of(i: int) -> Iterator[np.ndarray]:
                    a = offsets[i]
                    b = a + items[i][0].nbytes
                    for p in range(a, b, _WRITE_CHUNK):
                        yield flat[p:min(b, p + _WRITE_CHUNK)]

                sums = _write_data(loc, posixpath.join(sdir, fname), items, offsets, chunks_of,
                                   algo=self._algo, block_size=self.block_size, fsync=self.fsync)
                _hook("data_written")
                info = _write_part_manifest(loc, step, rank, world, attempt, fname, total,
                                            [r for r, _ in items], offsets, sums, self._algo.name, self.block_size,
                                            self.fsync)
            except (OSError, pa.ArrowException) as exc:
                raise CheckpointError(f"step {step} rank {rank}: writing under {loc.uri} failed: {exc}") from exc
        finally:
            with self._lock:
                self._free.append(buf)
        committed = try_commit(uri, step, world, attempt=attempt if attempt else None,
                               fsync=self.fsync) if self.commit else None
        return replace(info, uri=loc.uri, seconds=snap + time.perf_counter() - t0, committed=committed)

    def _drain(self, keep: int) -> None:
        while True:
            with self._lock:
                self._pending = [f for f in self._pending if not f.done()]
                if len(self._pending) <= keep:
                    return
                oldest = self._pending[0]
            try:
                oldest.result()
            except BaseException:  # the caller sees it through its own future
                pass

    def wait(self) -> None:
        """Block until every write started so far has finished (errors stay in their futures)."""
        self._drain(0)

    def close(self) -> None:
        """Wait for pending writes and stop the background thread."""
        if self._closed:
            return
        self._closed = True
        self._drain(0)
        self._pool.shutdown(wait=True)
        self._free.clear()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""``restore``: fill preallocated buffers of any layout from a committed checkpoint, in named steps
(match the buffers to the manifest, plan the reads, check the files, then verify and copy).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import torch

from astate_store.checkpoint.checksum import CHECKSUMS, Checksum, Crc32
from astate_store.checkpoint.format import manifest_records
from astate_store.checkpoint.index import load_manifest, load_marker
from astate_store.checkpoint.leases import LEASE_TTL, ReaderLease
from astate_store.checkpoint.reads import (
    CopyItem,
    DataFile,
    ReadContext,
    progressions,
    run_items,
    split_items,
)
from astate_store.checkpoint.storage import URI, Location, resolve
from astate_store.errors import CheckpointCorrupted, CheckpointError, LayoutError, PlanError
from astate_store.model.layout import TensorLayout, TensorLike, check_step, group_layouts
from astate_store.model.progress import Progress, ProgressCounter
from astate_store.model.validation import Entry, check_fit, validate_tensors
from astate_store.plan import plan_consumer

__all__ = ["ITEM_BYTES", "restore", "checksum_arrays"]

#: Source bytes per restore work item: large enough to amortize a task, small enough to spread a
#: big shard over the worker threads.
ITEM_BYTES = 32 << 20


def restore(
    uri: URI,
    buffers: Mapping[str, TensorLike],
    *,
    step: int | None = None,
    verify: bool = True,
    threads: int | None = None,
    progress: Progress | None = None,
    lease_ttl: float = LEASE_TTL,
) -> int:
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
        progress: called with (bytes copied, bytes to copy), from the worker threads
            (:mod:`astate_store.model.progress`).
        lease_ttl: seconds the reader lease that keeps retention off this step lasts without
            renewal (renewed every third of it while reading; see ``leases``).

    Returns:
        The restored step.

    Raises:
        CheckpointNotFound: no complete checkpoint under ``uri`` (or of ``step``).
        LayoutError: a buffer with an unknown name, another global shape, a bad box, or a dtype that
            is not the saved one or a float -> float conversion (before any byte is written).
        CheckpointCorrupted: a malformed marker or manifest, a missing or short data file (before
            any byte is written), or a block failing its checksum.
    """
    entries = validate_tensors(buffers, "restore(buffers)")
    loc = resolve(uri)
    step = load_marker(loc, None)[0] if step is None else check_step(step, CheckpointError)
    with ReaderLease(loc, step, lease_ttl):  # retention leaves the step alone while this reads
        return _restore(loc, entries, step, verify, threads, progress)


def _restore(
    loc: Location,
    entries: Sequence[Entry],
    step: int,
    verify: bool,
    threads: int | None,
    progress: Progress | None,
) -> int:
    step, marker = load_marker(loc, step)
    table = _rows_for(load_manifest(loc, step, marker), entries, step)
    file_names = sorted(set(table.column("file").to_pylist()))
    layouts = _saved_layouts(table, file_names, step, marker)
    _check_buffers(entries, layouts, step)
    reads = _plan_reads(entries, layouts)
    if not len(reads):
        return step
    used = sorted(set(np.unique(reads["src_rank"]).tolist()))
    files = _data_files(loc, step, marker, file_names, used)
    sums = _index_shards(table, files, used, step, int(marker["block_size"]))
    order = np.lexsort((reads["src_offset"], reads["src_rank"]))
    items = split_items(progressions(reads[order]), ITEM_BYTES)
    counter = ProgressCounter(progress, sum(it.n * it.length for it in items))
    ctx = ReadContext(
        step,
        files,
        [e.tensor.detach() for e in entries],
        sums,
        _verifier(marker, step, verify),
        int(marker["block_size"]),
        verify,
        counter.add,
    )
    _copy(ctx, loc, items, used, threads or max(1, min(4, os.cpu_count() or 1)))
    counter.finish()
    return step


def _rows_for(table: pa.Table, entries: Sequence[Entry], step: int) -> pa.Table:
    """The manifest rows of the buffers' tensors.

    Raises:
        LayoutError: a buffer names a tensor the checkpoint does not have.
    """
    all_names = set(table.column("name").to_pylist())
    for e in entries:
        if e.name not in all_names:
            near = ", ".join(sorted(all_names)[:8])
            raise LayoutError(
                f"tensor {e.name!r} is not in checkpoint step {step} ({near}"
                f"{', ...' if len(all_names) > 8 else ''})"
            )
    names = sorted({e.name for e in entries})
    return table.filter(pc.is_in(table.column("name"), value_set=pa.array(names)))


def _saved_layouts(
    table: pa.Table, file_names: Sequence[str], step: int, marker: Mapping[str, Any]
) -> Mapping[str, TensorLayout]:
    """The saved layouts, each shard's ``rank`` being the index of its data file in ``file_names``
    (so the planner's sources are files).

    Raises:
        CheckpointCorrupted: rows that do not form valid layouts.
    """
    findex = {f: i for i, f in enumerate(file_names)}
    try:
        return group_layouts(manifest_records(table, findex))
    except LayoutError as exc:
        raise CheckpointCorrupted(
            f"step {step}: manifest {marker['manifest']} is inconsistent: {exc}"
        ) from exc


def _check_buffers(entries: Sequence[Entry], layouts: Mapping[str, TensorLayout], step: int) -> None:
    """Raises LayoutError: a buffer of another global shape, or a dtype that is neither the saved one
    nor a float -> float conversion."""
    for e in entries:
        check_fit(e, layouts[e.name], f"checkpoint step {step}")


def _plan_reads(entries: Sequence[Entry], layouts: Mapping[str, TensorLayout]) -> np.ndarray:
    """The planner's reads: buffer ``i`` is request region ``i`` (``src_rank`` is a file index)."""
    request = [e.record(-1, region=i) for i, e in enumerate(entries)]
    try:
        plan = plan_consumer(layouts, request)
    except PlanError as exc:
        raise LayoutError(str(exc)) from exc
    return plan.reads


def _data_files(
    loc: Location, step: int, marker: Mapping[str, Any], file_names: Sequence[str], used: Sequence[int]
) -> list[DataFile | None]:
    """The data files the reads use (None for the others), each checked to exist with the exact size
    the commit marker gives before any byte is written.

    Raises:
        CheckpointCorrupted: a file missing, or of another size.
    """
    expect = marker["files"]
    sdir = loc.step_dir(step)
    paths = [posixpath.join(sdir, file_names[i]) for i in used]
    files: list[DataFile | None] = [None] * len(file_names)
    for i, p, inf in zip(used, paths, loc.fs.get_file_info(paths)):
        fname = file_names[i]
        if inf.type != pafs.FileType.File:
            raise CheckpointCorrupted(f"step {step}: data file {p} is missing")
        want = expect.get(fname)
        if want is None or inf.size != int(want):
            raise CheckpointCorrupted(
                f"step {step}: data file {p} has {inf.size} bytes, the commit marker says {want}"
            )
        files[i] = DataFile(loc, p, fname, int(inf.size))
    return files


def checksum_arrays(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Every row's checksums flat, and row ``r``'s span ``[offsets[r], offsets[r + 1])`` in them."""
    sumcol = table.column("checksums").combine_chunks()  # .values + absolute .offsets stay consistent
    sums = (
        sumcol.values.to_numpy(zero_copy_only=False).astype(np.uint64)
        if len(sumcol)
        else np.zeros(0, np.uint64)
    )
    sum_off = sumcol.offsets.to_numpy() if len(sumcol) else np.zeros(1, np.int64)
    return sums, sum_off


def _index_shards(
    table: pa.Table, files: Sequence[DataFile | None], used: Sequence[int], step: int, block: int
) -> np.ndarray:
    """Give each used file its shard table (sorted by byte offset) for checksum lookups; return the
    flat checksums.

    Raises:
        CheckpointCorrupted: a row of another block size, the wrong number of checksums, or shards
            placed past the end of their file.
    """
    cols = table.select(["name", "offsets", "file", "byte_offset", "length", "block_size"]).to_pydict()
    sums, sum_off = checksum_arrays(table)
    findex = {f.name: i for i, f in enumerate(files) if f is not None}
    per_file: dict[int, list[int]] = {}
    for r, fname in enumerate(cols["file"]):
        if cols["block_size"][r] != block:
            raise CheckpointCorrupted(
                f"step {step}: manifest row {r} has block size {cols['block_size'][r]}, marker says {block}"
            )
        if fname in findex:
            per_file.setdefault(findex[fname], []).append(r)
    for i in used:
        rows = sorted(per_file.get(i, []), key=lambda r: cols["byte_offset"][r])
        f = files[i]
        assert f is not None
        f.starts = np.array([cols["byte_offset"][r] for r in rows], np.int64)
        f.lengths = np.array([cols["length"][r] for r in rows], np.int64)
        f.sum_base = np.array([sum_off[r] for r in rows], np.int64)
        for r in rows:
            nb = -(-cols["length"][r] // block)
            if sum_off[r + 1] - sum_off[r] != nb:
                raise CheckpointCorrupted(
                    f"step {step}: manifest lists {sum_off[r + 1] - sum_off[r]} checksums for "
                    f"tensor {cols['name'][r]!r} shard at {cols['offsets'][r]}, needs {nb}"
                )
        if len(rows) and int((f.starts + f.lengths).max()) > f.size:
            raise CheckpointCorrupted(
                f"step {step}: data file {f.path} has {f.size} bytes, the manifest places shards "
                f"up to byte {int((f.starts + f.lengths).max())}"
            )
        f.labels = [f"{cols['name'][r]!r} (shard at {tuple(cols['offsets'][r])})" for r in rows]
        f.verified = [np.zeros(-(-cols["length"][r] // block), bool) for r in rows]
    return sums


def _verifier(marker: Mapping[str, Any], step: int, verify: bool) -> Checksum:
    """The marker's checksum algorithm (any one when not verifying: it is then never called).

    Raises:
        CheckpointCorrupted: the marker names an unknown algorithm.
    """
    if marker["checksum"] not in CHECKSUMS:
        raise CheckpointCorrupted(
            f"step {step}: unknown checksum {marker['checksum']!r} in the commit marker"
        )
    return CHECKSUMS[marker["checksum"]]() if verify else Crc32()


def _copy(ctx: ReadContext, loc: Location, items: list[CopyItem], used: Sequence[int], threads: int) -> None:
    """Open the used files, run the items, wait for CUDA copies; the files are closed whatever happens.

    Raises:
        CheckpointCorrupted: a read failed, or a block fails its checksum.
    """
    try:
        for i in used:
            f = ctx.files[i]
            assert f is not None
            f.open()
        run_items(ctx, items, threads)
        if any(t.device.type == "cuda" for t in ctx.dests):
            torch.cuda.synchronize()
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointCorrupted(
            f"step {ctx.step}: reading data files under {loc.uri} failed: {exc}"
        ) from exc
    finally:
        for f in ctx.files:
            if f is not None:
                f.close()

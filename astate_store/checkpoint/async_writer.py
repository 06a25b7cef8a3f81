"""``AsyncCheckpointer``: snapshot a rank's shards into a reused host buffer, then write the part (and
commit) on a background thread so training continues.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from astate_store.checkpoint.checksum import check_block_size, checksum_algo
from astate_store.checkpoint.commit import try_commit
from astate_store.checkpoint.format import BLOCK_SIZE
from astate_store.checkpoint.storage import URI, resolve
from astate_store.checkpoint.writer import (
    WRITE_CHUNK,
    PartInfo,
    PartTarget,
    check_part_args,
    file_layout,
    owned_shards,
    validate_shards,
    write_part_files,
)
from astate_store.errors import CheckpointError
from astate_store.model.layout import ShardRecord, TensorLayout
from astate_store.model.progress import Progress, ProgressCounter

__all__ = ["AsyncCheckpointer"]


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

    def __init__(
        self,
        uri: URI | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        max_pending: int = 1,
        commit: bool = True,
        attempt: str = "",
        checksum: str | None = None,
        block_size: int = BLOCK_SIZE,
        fsync: bool = True,
    ):
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise CheckpointError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self._algo = checksum_algo(checksum)
        self.uri, self.rank, self.world_size = uri, rank, world_size
        self.max_pending, self.commit, self.attempt = max_pending, commit, attempt
        self.checksum, self.block_size, self.fsync = self._algo.name, check_block_size(block_size), fsync
        self._loc = resolve(uri) if uri is not None else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="astate-ckpt-write")
        self._pending: list[Future] = []
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._closed = False

    def save(
        self,
        *args: Any,
        layouts: Mapping[str, TensorLayout] | None = None,
        attempt: str | None = None,
        progress: Progress | None = None,
        meta: bytes | None = None,
    ) -> Future[PartInfo]:
        """``save(step, shards)`` or ``save(uri, step, rank, world_size, shards)``: snapshot ``shards``
        now and write them as this rank's part of ``step`` in the background.

        Args:
            shards: as in :func:`write_part`; ``layouts``: as in :func:`write_part`.
            attempt: run tag for this part and its commit (default: the constructor's).
            progress: called from the writer thread with (bytes written, bytes of this part).
            meta: as in :func:`write_part`.

        Raises (synchronously):
            LayoutError: bad shards. CheckpointError: closed, or bad arguments.
        Errors of the write itself (for example a step already committed) are raised by
        ``future.result()``.
        """
        if self._closed:
            raise CheckpointError("AsyncCheckpointer is closed")
        if len(args) == 2:
            if self._loc is None or self.rank is None or self.world_size is None:
                raise CheckpointError(
                    "save(step, shards) needs AsyncCheckpointer(uri, rank, world_size); or call "
                    "save(uri, step, rank, world_size, shards)"
                )
            uri, loc, rank, world = self.uri, self._loc, self.rank, self.world_size
            step, shards = args
        elif len(args) == 5:
            uri, step, rank, world, shards = args
            loc = resolve(uri)
        else:
            raise CheckpointError("use save(step, shards) or save(uri, step, rank, world_size, shards)")
        step = check_part_args(step, rank, world)
        items = validate_shards(shards)
        if layouts is not None:
            items = owned_shards(items, layouts, rank)
        self._drain(self.max_pending - 1)
        t0 = time.perf_counter()
        offsets, total = file_layout(items)
        buf = self._snapshot(items, offsets, total)
        snap = time.perf_counter() - t0
        target = PartTarget(
            loc,
            step,
            rank,
            world,
            self.attempt if attempt is None else str(attempt),
            self._algo,
            self.block_size,
            self.fsync,
            meta,
        )
        fut = self._pool.submit(self._write, uri, target, items, offsets, total, buf, snap, progress)
        with self._lock:
            self._pending.append(fut)
        return fut

    def _snapshot(
        self, items: Sequence[tuple[ShardRecord, torch.Tensor]], offsets: Sequence[int], total: int
    ) -> torch.Tensor:
        """Copy the shards into a host buffer laid out like the data file."""
        buf = self._buffer(total, any(t.device.type == "cuda" for _, t in items))
        cuda = False
        for (rec, t), off in zip(items, offsets):
            if rec.nbytes == 0:
                continue
            view = buf[off : off + rec.nbytes].view(t.dtype).view(tuple(rec.box.sizes))
            view.copy_(t, non_blocking=t.device.type == "cuda")
            cuda = cuda or t.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        return buf

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

    def _write(
        self,
        uri: URI,
        target: PartTarget,
        items: Sequence[tuple[ShardRecord, torch.Tensor]],
        offsets: Sequence[int],
        total: int,
        buf: torch.Tensor,
        snap: float,
        progress: Progress | None = None,
    ) -> PartInfo:
        t0 = time.perf_counter()
        counter = ProgressCounter(progress, sum(r.nbytes for r, _ in items))

        def chunks_of(i: int) -> Iterator[np.ndarray]:
            a = offsets[i]
            b = a + items[i][0].nbytes
            for p in range(a, b, WRITE_CHUNK):
                yield flat[p : min(b, p + WRITE_CHUNK)]
                counter.add(min(b, p + WRITE_CHUNK) - p)

        try:
            flat = buf.numpy()
            info = write_part_files(target, [r for r, _ in items], offsets, total, chunks_of)
        finally:
            with self._lock:
                self._free.append(buf)  # reused by a later save, whatever happened
        counter.finish()
        attempt = target.attempt
        committed = (
            try_commit(
                uri, target.step, target.world_size, attempt=attempt if attempt else None, fsync=self.fsync
            )
            if self.commit
            else None
        )
        return replace(info, uri=target.loc.uri, seconds=snap + time.perf_counter() - t0, committed=committed)

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

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

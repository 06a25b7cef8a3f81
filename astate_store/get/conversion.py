"""Dtype conversion on the consumer, through bounded staging.

A buffer of another float dtype than the published one, whose pieces no publisher converted,
is pulled in chunks of whole rows into one of two staging halves (together at most
``staging_cap_bytes``) and converted into the buffer in place; chunk k+1 is fetched while
chunk k is converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from astate_store.context import StoreContext, sync_device
from astate_store.errors import LayoutError
from astate_store.get.sources import SourceGroup, to_transport_ops
from astate_store.model.dtypes import itemsize, torch_dtype
from astate_store.model.layout import Box, ShardRecord, contiguous_strides
from astate_store.model.validation import Entry

__all__ = ["Conversion", "Converter"]

_DEFAULT_HALF = 32 << 20  # per staging half when no cap is set


@dataclass(frozen=True)
class Conversion:
    """A converted pull, ready to run: per chunk (transport ops into a staging half, the staging
    view in the source dtype, the destination view)."""

    name: str
    chunks: list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]


class Converter:
    """Plans and runs local conversions; owns the conversion staging and its fetch thread."""

    def __init__(self, ctx: StoreContext):
        self.ctx = ctx
        self._buf: torch.Tensor | None = None
        self._fetcher: ThreadPoolExecutor | None = None

    @property
    def staging_bytes(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())

    def _half(self) -> int:
        """Bytes per staging half: half the cap, or a default when none is set."""
        cap = self.ctx.options.staging_cap_bytes
        return max(1, cap // 2) if cap else _DEFAULT_HALF

    def _row_chunks(self, e: Entry, isz: int, half: int) -> list[Box]:
        sizes = e.box.sizes
        if not sizes:
            return [e.box]
        row = max(1, int(np.prod(sizes[1:], dtype=np.int64)) * isz)
        if row > half and len(sizes) > 1:
            raise LayoutError(
                f"tensor {e.name!r}: one row of {row} bytes exceeds half the staging cap "
                f"{self.ctx.options.staging_cap_bytes}; raise staging_cap_bytes"
            )
        per = max(1, half // row)
        return [
            Box((e.box.offsets[0] + i,) + e.box.offsets[1:], (min(per, sizes[0] - i),) + sizes[1:])
            for i in range(0, sizes[0], per)
        ]

    def chunk_records(self, g: SourceGroup, e: Entry) -> tuple[ShardRecord, ...]:
        """The chunks of whole rows one buffer's conversion reads, as records in the source dtype
        (each fits a staging half), for the caller to plan in one planning call.

        Raises:
            LayoutError: one row is larger than a staging half.
        """
        src_dtype = g.layouts[e.name].dtype
        boxes = self._row_chunks(e, itemsize(src_dtype), self._half())
        return tuple(
            ShardRecord(e.name, src_dtype, e.global_shape, c, contiguous_strides(c.sizes), -1, i, 0)
            for i, c in enumerate(boxes)
        )

    def plan(
        self,
        g: SourceGroup,
        base: Mapping[int, int],
        e: Entry,
        recs: tuple[ShardRecord, ...],
        reads: np.ndarray,
    ) -> Conversion:
        """One buffer's conversion, ready to run: ``recs`` from :meth:`chunk_records`, ``reads``
        the planner's reads of them from ``g`` (``dst_region``: the chunk's index)."""
        src_dtype = g.layouts[e.name].dtype
        isz = itemsize(src_dtype)
        boxes = [r.box for r in recs]
        staging = self._staging(2 * min(self._half(), e.box.numel * isz), e.tensor.device)
        halves = (staging[: staging.numel() // 2], staging[staging.numel() // 2 :])
        reads = reads[np.argsort(reads["dst_region"], kind="stable")]
        cuts = np.searchsorted(reads["dst_region"], np.arange(len(boxes) + 1))
        chunks = []
        for i, c in enumerate(boxes):
            buf = halves[i % 2]
            ops = to_transport_ops(
                g,
                self.ctx.transport.peer_index,
                base,
                reads[cuts[i] : cuts[i + 1]],
                np.full(len(boxes), buf.data_ptr(), dtype=np.int64),
            )
            src = buf[: c.numel * isz].view(torch_dtype(src_dtype)).view(c.sizes)
            local = tuple(slice(o - b, o - b + s) for o, b, s in zip(c.offsets, e.box.offsets, c.sizes))
            chunks.append((ops, src, e.tensor[local]))
        return Conversion(e.name, chunks)

    def run(self, conv: Conversion) -> None:
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="astate-fetch")
        timeout = self.ctx.options.read_timeout

        def fetch(ops: np.ndarray) -> None:
            if len(ops):
                self.ctx.transport.get(ops, timeout=timeout)

        pending = self._fetcher.submit(fetch, conv.chunks[0][0])
        for k, (_ops, src, dst) in enumerate(conv.chunks):
            pending.result()
            if k + 1 < len(conv.chunks):  # the other half: free since chunk k-1 was converted
                pending = self._fetcher.submit(fetch, conv.chunks[k + 1][0])
            with torch.no_grad():
                dst.copy_(src)
            sync_device(dst.device)  # the next fetch into this half must not overtake the copy

    def _staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self._buf = None  # free the old one before allocating the new one
            buf = self.ctx.alloc(max(nbytes, 1), device)
            self._buf = buf
        return buf

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
            self._fetcher = None
        self._buf = None

"""Registrations of caller memory with the transport, once per storage.

Tensors published in place (``put(copy=False)``) and buffers offered with ``serve`` are read
by peers straight from the caller's memory. Both need, per tensor, the registered region that
holds its storage and the byte offset of its first element there: :meth:`Registry.records`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .layout import Entry, ShardRecord
from .transport import Transport

__all__ = ["Registry", "storage_span"]


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor view spans (first to one past last element)."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), (last + 1) * t.element_size()


class Registry:
    """Regions registered for caller tensors, keyed by storage (address, size): registering is
    expensive (pinning, rkeys) and a training loop publishes the same storages every step."""

    def __init__(self, transport: Callable[[], Transport]):
        self._transport = transport
        self._regions: dict[tuple[int, int], int] = {}

    def region_of(self, t: torch.Tensor) -> tuple[int, int]:
        """(region, byte offset of the view's first element in it), registering on first use."""
        tr = self._transport()
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        region = self._regions.get(key)
        if region is None:
            region = tr.register_tensor(t)
            self._regions[key] = region
        info = tr.region(region)
        addr, nbytes = storage_span(t)
        # The storage key guarantees it; a mismatch would publish memory outside the region.
        assert info.base <= addr and addr + nbytes <= info.base + info.size
        return region, addr - info.base

    def records(self, entries: Sequence[Entry], rank: int) -> list[ShardRecord]:
        """The entries as shards of ``rank`` read in place from their registered storages."""
        out = []
        for e in entries:
            region, offset = self.region_of(e.tensor)
            out.append(e.record(rank, region, offset))
        return out

"""Registered staging memory: the snapshot pool a publisher copies into, reused every step.

One allocation of ``depth`` slots, registered with the transport once. Every slot holds the
same shard layout at the same offsets, so a step only changes the piece's ``base_offset``
(slot index x slot size): the layout record, rkeys and every consumer's plan stay cached.
With ``depth >= 2`` a step never overwrites the version consumers are most likely reading
(the previous one); the slot it does overwrite is retired first.

Step words: the pool's last ``WORDS_BYTES`` hold one 64-bit word per slot, never data. Slot k's
word is a token unique to its last fill while the slot holds that fill's bytes, and 0 from before
any byte of the slot changes (see :meth:`SnapshotPool.fill`). A reader that finds the token its
piece record names *after* its copy knows no byte it read changed during the copy (a seqlock
whose check needs no etcd round trip; see ``docs/protocol.md``, "Step words").
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from astate_store.errors import LayoutError
from astate_store.model.dtypes import itemsize, torch_dtype
from astate_store.model.layout import Box, ShardRecord, contiguous_strides

if TYPE_CHECKING:
    from astate_store.transport import Transport

__all__ = ["SlotEntry", "SnapshotPool", "StagingCapExceeded", "ALIGN"]

log = logging.getLogger("astate_store.put.staging")

# Cache-line aligned shards: copies and remote reads never straddle a shared line.
ALIGN = 256
# The step words at the end of the buffer: one 8-byte word per slot, up to 64 slots; the area stays
# at the same place for the buffer's life, so no layout's data ever lands on it.
WORDS_BYTES = 512
_MAX_WORDS = WORDS_BYTES // 8
# Tokens: unique per fill in this process, never 0, and from a random start so that no other
# process's (or earlier run's) memory holds them by chance; below 2^53 (exact in any JSON reader).
_tokens = iter(range(random.randrange(1 << 40, 1 << 51), 1 << 53))


class ChangeMaps(Protocol):
    """What a pool with delta versions asks of its change maps (``put/delta.py``'s ``DeltaStager``)."""

    def area_bytes(self, entries: Sequence[SlotEntry]) -> int:
        """Bytes a slot needs after its snapshot (index rows and room for changes)."""
        ...

    def stage(
        self, pool: SnapshotPool, k: int, tensors: Sequence[torch.Tensor], step: int, key: object = None
    ) -> None:
        """Copy the shards into slot k, recording their changes since the previous fill."""
        ...


class StagingCapExceeded(LayoutError):
    """One snapshot slot alone would be larger than the staging cap."""


@dataclass(frozen=True)
class SlotEntry:
    name: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    offset: int  # byte offset of the shard inside a slot
    source: int = -1  # pre-packed copy: index of the entry it is cut from (-1: a shard itself)

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dtype)

    def record(self, rank: int, region: int, byte_offset: int) -> ShardRecord:
        """This entry as a contiguous shard of ``rank`` at ``byte_offset`` in ``region``."""
        return ShardRecord(
            self.name,
            self.dtype,
            self.global_shape,
            self.box,
            contiguous_strides(self.box.sizes),
            rank,
            region,
            byte_offset,
        )


class SnapshotPool:
    """Args:
        depth: slots (versions that can be live at once); >= 1.
        cap_bytes: the most memory the pool may use; depth shrinks to fit, down to 1.
        alloc: ``alloc(nbytes) -> uint8 tensor`` (NUMA-local allocation by default: plain).
        transport: registers the slots (``register_tensor`` / ``unregister``), prepares fresh
            memory (``prepare_staging``) and runs the copies into it (``copy_rows``).
        delta: with delta versions (docs/delta.md), the change maps' stager: each slot then ends
            with its delta area, and the shards go through its compare-and-copy.

    Raises:
        LayoutError: one slot alone is larger than ``cap_bytes``.
    """

    def __init__(
        self,
        depth: int,
        cap_bytes: int | None,
        alloc: Callable[[int], torch.Tensor],
        transport: Transport,
        delta: ChangeMaps | None = None,
    ):
        if depth < 1:
            raise ValueError(f"staging depth must be >= 1, got {depth}")
        self.want_depth, self.cap_bytes = depth, cap_bytes
        self._alloc, self._transport, self.delta = alloc, transport, delta
        self.signature: tuple[object, ...] | None = None
        self.data_bytes = 0  # where a slot's snapshot ends (its delta area follows)
        self.entries: tuple[SlotEntry, ...] = ()
        self.slot_size = 0
        self.depth = 0
        self.buffer: torch.Tensor | None = None
        self.region: int | None = None
        self.slot_step: list[int | None] = []
        self.slot_token: list[int] = []  # slot -> the token its word holds (0: none)
        self._words: torch.Tensor | None = None  # the step words (int64 view), host buffers only
        self._next = 0
        self._views: dict[int, list[torch.Tensor]] = {}  # slot -> destination view per entry
        self._plans: dict[int, tuple[object, np.ndarray, list[int]]] = {}  # slot -> (key, rows, others)

    def configure(
        self,
        items: Sequence[tuple[str, str, tuple[int, ...], Box]],
        packs: Sequence[tuple[int, Box, str | None]] = (),
    ) -> bool:
        """Lay out the slots for these (name, dtype, global_shape, box) shards, plus contiguous
        copies ``packs`` = (shard index, box inside that shard, dtype to convert to or
        None); True if it changed."""
        sig = (tuple(items), tuple(packs))
        if sig == self.signature:
            return False
        entries, off = [], 0
        for name, dtype, gshape, box in items:
            entries.append(SlotEntry(name, dtype, gshape, box, off))
            off += -(-box.numel * itemsize(dtype) // ALIGN) * ALIGN
        for idx, box, to in packs:
            name, dtype, gshape, _ = items[idx]
            dtype = to or dtype
            entries.append(SlotEntry(name, dtype, gshape, box, off, idx))
            off += -(-box.numel * itemsize(dtype) // ALIGN) * ALIGN
        data_bytes = max(off, ALIGN)
        slot = data_bytes + (self.delta.area_bytes(entries) if self.delta is not None else 0)
        depth = self.want_depth
        if self.cap_bytes is not None:
            if slot + WORDS_BYTES > self.cap_bytes:
                raise StagingCapExceeded(
                    f"snapshot of this rank's {len(entries)} tensors needs {slot + WORDS_BYTES} bytes of "
                    f"staging, above the cap of {self.cap_bytes} bytes"
                )
            depth = max(1, min(depth, (self.cap_bytes - WORDS_BYTES) // slot))
            if depth < self.want_depth:
                log.warning(
                    "staging cap %d bytes allows %d of %d snapshot slots; puts will wait for readers",
                    self.cap_bytes,
                    depth,
                    self.want_depth,
                )
        need = slot * depth
        # Every slot was retired (the caller's job): no word may name a fill any more, whatever
        # lands where from now on.
        self.clear_words()
        if (
            self.buffer is None
            or self.buffer.numel() < need + WORDS_BYTES
            or self.buffer.numel() > 2 * need + WORDS_BYTES
        ):
            if self.region is not None:
                self._transport.unregister(self.region)
            self.buffer = self._alloc(need + WORDS_BYTES)
            # Write every slot now: the first write of fresh memory is the slow one (a page fault
            # per 4 KiB page), so the first put pays it for all slots instead of the second put
            # paying it again for the second slot. Memfd pages are allocated in bulk first
            # (``prepare_staging``): the writes then only map them.
            self._transport.prepare_staging(self.buffer)
            self.buffer.zero_()
            self.region = self._transport.register_tensor(self.buffer)
            words = self.buffer[self.buffer.numel() - WORDS_BYTES :]
            self._words = words.view(torch.int64) if words.device.type == "cpu" else None
        self.signature, self.entries, self.slot_size, self.depth = sig, tuple(entries), slot, depth
        self.data_bytes = data_bytes
        self.slot_step = [None] * depth
        self.slot_token = [0] * depth
        self._views = {}
        self._plans = {}
        self._next = 0
        return True

    def word_offset(self, k: int) -> int | None:
        """Byte offset of slot k's step word in the pool's region; None without words (a device
        pool, or more slots than words)."""
        if self._words is None or k >= _MAX_WORDS or self.buffer is None:
            return None
        return self.buffer.numel() - WORDS_BYTES + 8 * k

    def step_word(self, k: int) -> tuple[int, int, int] | None:
        """Slot k's step word for its piece record: (region, offset, token); None without one."""
        at = self.word_offset(k)
        return None if at is None or self.region is None else (self.region, at, self.slot_token[k])

    def clear_words(self) -> None:
        """Zero every slot's word: before the slots are laid out anew or the memory is freed."""
        if self._words is not None:
            self._words.zero_()
        self.slot_token = [0] * len(self.slot_token)

    def next_slot(self) -> tuple[int, int | None]:
        """The slot the next step goes to, and the step it held (to retire first)."""
        k = self._next
        return k, self.slot_step[k]

    def _slot_views(self, k: int) -> list[torch.Tensor]:
        """Slot k's destination views, made once per layout: with 10^5 tensors, making three
        views per tensor per put cost more than the copies."""
        views = self._views.get(k)
        if views is None:
            assert self.buffer is not None
            base = k * self.slot_size
            views = [
                self.buffer[base + e.offset : base + e.offset + e.nbytes]
                .view(torch_dtype(e.dtype))
                .view(e.box.sizes)
                for e in self.entries
            ]
            self._views[k] = views
        return views

    def _copy_plan(
        self, k: int, tensors: Sequence[torch.Tensor], key: object
    ) -> tuple[np.ndarray, list[int]]:
        """Rows (src, dst, nbytes) for the native copy of slot k's shards from contiguous CPU
        tensors of the slot's dtype, and the indices of the others (copied by torch). Cached
        per (slot, ``key``): a validated entry list whose tensors sit at the same addresses."""
        hit = self._plans.get(k)
        if key is not None and hit is not None and hit[0] is key:
            return hit[1], hit[2]
        views = self._slot_views(k)
        rows, rest = [], []
        for i, (t, v) in enumerate(zip(tensors, views)):
            if (
                t.device.type == "cpu"
                and v.device.type == "cpu"
                and t.dtype == v.dtype
                and t.is_contiguous()
                and t.shape == v.shape
            ):
                if t.numel():
                    rows.append((t.data_ptr(), v.data_ptr(), t.numel() * t.element_size()))
            else:
                rest.append(i)
        plan = np.array(rows, dtype=np.uint64).reshape(-1, 3)
        if key is not None:
            self._plans[k] = (key, plan, rest)
        return plan, rest

    def fill(self, k: int, tensors: Sequence[torch.Tensor], step: int, *, key: object = None) -> None:
        """Copy the step's tensors into slot k (shard entries first, in the order of tensors),
        then cut the pre-packed copies from them.

        ``key``: an object that stays the same exactly while ``tensors`` are the same tensors
        at the same addresses (the publisher's validated entry list): the copy plan is reused.
        CPU shards go through the native copy (threads without spin-waits: torch's intra-op threads
        spin while they wait, so two ranks copying at once on a small host take each other's
        cores)."""
        views = self._slot_views(k)
        n = len(tensors)
        plan, rest = self._copy_plan(k, tensors[:n], key) if self.delta is None else (None, [])
        words = self._words if k < _MAX_WORDS else None
        if words is not None:
            # Zeroed before any byte of the slot changes: the native copy releases the GIL (locked
            # instructions, a full barrier on x86) before its first (non-temporal) store.
            words[k] = 0
            self.slot_token[k] = 0
        with torch.no_grad():
            if self.delta is not None:  # the compare-and-copy: the shards and their change map
                self.delta.stage(self, k, tensors, step, key)
            elif len(plan):
                self._transport.copy_rows(plan)
            if rest:
                torch._foreach_copy_([views[i] for i in rest], [tensors[i] for i in rest])
            for e, dst in zip(self.entries[n:], views[n:]):
                src = self.entries[e.source]
                cut = tuple(
                    slice(o - so, o - so + s) for o, so, s in zip(e.box.offsets, src.box.offsets, e.box.sizes)
                )
                dst.copy_(tensors[e.source][cut])
        if words is not None:
            # After the copy: its threads ended with a store fence and were joined.
            token = next(_tokens)
            words[k] = token
            self.slot_token[k] = token
        self.slot_step[k] = step
        self._next = (k + 1) % self.depth

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else int(self.buffer.numel())

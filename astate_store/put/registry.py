"""Registrations of caller memory with the transport: only what is published, counted.

Tensors published in place (``put(copy=False)``) and buffers offered with ``serve`` are read
by peers straight from the caller's memory. Both need, per tensor, the registered region that
holds it and the byte offset of its first element there: :meth:`Registry.acquire`.

Least exposure: a registration covers the byte span of the published views (rounded out to
pages, as ``ucp_mem_map`` registers pages, and clamped to the storage), never the rest of a
storage; views of one storage whose rounded spans overlap or touch share one registration.

Hygiene: every registration is reference-counted by its holders (``"put"``, ``"serve"``). A
holder releases what it acquired when the memory may no longer be read (the publisher after
``retire``, serving at ``unserve``); a registration nobody holds becomes idle, and
:meth:`Registry.sweep` unregisters idle ones. The publisher sweeps at its next put, after that
put re-acquired what it still publishes, so a steady training loop never re-registers.
"""

from __future__ import annotations

import mmap
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from astate_store.model.layout import ShardRecord
from astate_store.model.validation import Entry
from astate_store.transport import Transport

__all__ = ["Registry", "TransportHolder", "storage_span", "PAGE"]

PAGE = mmap.PAGESIZE


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor view spans (first to one past last element)."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), (last + 1) * t.element_size()


class TransportHolder(Protocol):
    """What holds the transport a registry registers with: ``context.StoreContext``, which
    creates it lazily, near the first tensors it moves."""

    @property
    def transport(self) -> Transport: ...


@dataclass
class _Registration:
    region: int
    storage: tuple[int, int]  # (storage address, storage bytes)
    lo: int  # registered [lo, hi)
    hi: int
    refs: int = 0


class Registry:
    """Regions registered for caller tensors, by storage; reference-counted per holder.

    Not thread-safe: the store calls it from the thread that puts / serves.
    """

    def __init__(self, holder: TransportHolder):
        self._holder = holder  # the transport is read at each use: the context creates it lazily
        self._regs: dict[int, _Registration] = {}  # region -> registration
        self._by_storage: dict[tuple[int, int], list[_Registration]] = {}
        self._idle: set[int] = set()  # registered, refs == 0
        self._holds: dict[Hashable, list[Counter[int]]] = {}  # holder -> one Counter per acquire
        # Steady state: the same validated entries list again -> the same records.
        self._memo: tuple[object, int, list[ShardRecord], tuple[int, ...]] | None = None

    # ---- counts ---------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """Registrations held by this registry now (idle ones included until swept)."""
        return len(self._regs)

    @property
    def idle(self) -> int:
        return len(self._idle)

    # ---- acquire / release ----------------------------------------------------------------

    def acquire(self, holder: Hashable, entries: Sequence[Entry], rank: int) -> list[ShardRecord]:
        """The entries as shards of ``rank`` read in place, registering what is not yet
        registered; ``holder`` holds one reference to every registration used until it
        releases it."""
        memo = self._memo
        if (
            memo is not None
            and memo[0] is entries
            and memo[1] == rank
            and all(r in self._regs for r in memo[3])
        ):
            records, regions = memo[2], memo[3]
        else:
            records, regions = self._records(entries, rank)
            self._memo = (entries, rank, records, regions)
        held: Counter[int] = Counter()
        for r in regions:
            reg = self._regs[r]
            reg.refs += 1
            self._idle.discard(r)
            held[r] += 1
        holds = self._holds.setdefault(holder, [])
        holds.append(held)
        if len(holds) > 4:  # a holder that never releases: fold its older holds into one
            merged: Counter[int] = Counter()
            for h in holds[:-1]:
                merged.update(h)
            holds[:] = [merged, held]
        return records

    def release(self, holder: Hashable, *, keep_last: int = 0) -> list[int]:
        """Drop ``holder``'s references except those of its newest ``keep_last`` acquires;
        returns the regions that became idle (nobody holds them)."""
        holds = self._holds.get(holder)
        if not holds:
            return []
        cut = max(0, len(holds) - keep_last)
        drop, self._holds[holder] = holds[:cut], holds[cut:]
        return self._drop(drop)

    def release_newest(self, holder: Hashable) -> list[int]:
        """Undo ``holder``'s newest acquire (what it was for failed: nothing was published);
        returns the regions that became idle."""
        holds = self._holds.get(holder)
        return self._drop([holds.pop()]) if holds else []

    def _drop(self, drop: Sequence[Counter[int]]) -> list[int]:
        now_idle = []
        for held in drop:
            for r, n in held.items():
                reg = self._regs.get(r)
                if reg is None:
                    continue
                reg.refs -= n
                if reg.refs <= 0:
                    reg.refs = 0
                    self._idle.add(r)
                    now_idle.append(r)
        return now_idle

    def sweep(self, regions: Iterable[int] | None = None) -> int:
        """Unregister idle registrations (all, or those of ``regions`` still idle); returns
        how many were released."""
        todo = list(self._idle) if regions is None else [r for r in regions if r in self._idle]
        if not todo:
            return 0
        tr = self._holder.transport
        for r in todo:
            self._idle.discard(r)
            reg = self._regs.pop(r)
            regs = self._by_storage.get(reg.storage, [])
            if reg in regs:
                regs.remove(reg)
            if not regs:
                self._by_storage.pop(reg.storage, None)
            try:
                tr.unregister(r)
            except Exception:  # a closed transport already released everything
                pass
        self._memo = None
        return len(todo)

    # ---- spans ----------------------------------------------------------------------------

    def _records(self, entries: Sequence[Entry], rank: int) -> tuple[list[ShardRecord], tuple[int, ...]]:
        """Records for the entries, and the distinct regions they use (registering runs of
        overlapping page-rounded spans per storage that no registration covers yet)."""
        spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # storage -> (lo, hi, entry)
        where: list[tuple[int, int]] = []  # per entry: (address, bytes)
        for i, e in enumerate(entries):
            t = e.tensor
            st = t.untyped_storage()
            key = (int(st.data_ptr()), int(st.nbytes()))
            addr, n = storage_span(t)
            s0, s1 = key[0], key[0] + key[1]
            if n:  # pages holding the view, clamped to the storage
                lo, hi = max(s0, addr - addr % PAGE), min(s1, -(-(addr + n) // PAGE) * PAGE)
            else:  # an empty view: a point (joins a run it touches, else an empty region)
                lo = hi = addr = min(max(addr, s0), s1)
            spans.setdefault(key, []).append((lo, hi, i))
            where.append((addr, n))
        region_of = [0] * len(entries)
        base_of: dict[int, int] = {}
        for key, items in spans.items():
            items.sort()
            run_lo, run_hi, members = items[0][0], items[0][1], [items[0][2]]
            runs = []
            for lo, hi, i in items[1:]:
                if lo <= run_hi:  # overlaps or touches the run: one registration
                    run_hi = max(run_hi, hi)
                    members.append(i)
                else:
                    runs.append((run_lo, run_hi, members))
                    run_lo, run_hi, members = lo, hi, [i]
            runs.append((run_lo, run_hi, members))
            for lo, hi, members in runs:
                reg = self._covering(key, lo, hi) or self._register(key, entries[members[0]].tensor, lo, hi)
                base_of[reg.region] = reg.lo
                for i in members:
                    region_of[i] = reg.region
        out = []
        for i, e in enumerate(entries):
            r = region_of[i]
            addr, n = where[i]
            base = base_of[r]
            reg = self._regs[r]
            # The run covers the view; a mismatch would publish memory outside the region.
            assert reg.lo <= addr and addr + n <= reg.hi, (reg, addr, n)
            out.append(e.record(rank, r, addr - base))
        return out, tuple(sorted(set(region_of)))

    def _covering(self, key: tuple[int, int], lo: int, hi: int) -> _Registration | None:
        best = None
        for reg in self._by_storage.get(key, ()):
            if reg.lo <= lo and hi <= reg.hi and (best is None or reg.hi - reg.lo < best.hi - best.lo):
                best = reg
        return best

    def _register(self, key: tuple[int, int], t: torch.Tensor, lo: int, hi: int) -> _Registration:
        tr = self._holder.transport
        region = tr.register_range(t, lo, hi - lo)
        reg = self._regs.get(region)
        if reg is None:  # the transport may return an existing slot for the same range
            reg = _Registration(region, key, lo, hi)
            self._regs[region] = reg
            self._by_storage.setdefault(key, []).append(reg)
            self._idle.add(region)  # refs 0 until acquired
        return reg

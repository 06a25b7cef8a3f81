"""This process's registered memory: the regions it publishes, and where reads land.

A region serves twice: peers read it (its ``RegionInfo`` goes into the descriptor), and
local reads whose destination lies inside one pass its memory handle to UCX (so UCX
need not register the destination itself) and, when it is not host memory, stay off
the ``process_vm_readv`` path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from astate_store.errors import TransportError
from astate_store.transport import memfd, stream
from astate_store.transport.base import RegionInfo
from astate_store.transport.binding import native, typed_error

__all__ = ["LocalRegion", "LocalSnapshot", "LocalRegions"]

_MEMORY_TYPES = ("host", "cuda", "unknown")
# A freed slot is handed out again only once this many newer slots were freed after it: the
# table (and every descriptor, which lists all slots) stays bounded under register/unregister
# churn, while a consumer holding an old descriptor still finds the slot freed for a long time.
_REUSE_AFTER = 64


@dataclass
class LocalRegion:
    """One registration slot; a freed slot keeps its index with ``memh is None``."""

    info: RegionInfo
    memh: Any = None  # _ucx.MemHandle or None (freed / empty)
    keepalive: Any = None  # torch storage kept alive while registered
    memory_type: str = "host"


@dataclass(frozen=True)
class LocalSnapshot:
    """The live local regions sorted by base, for vectorized lookups during ``get``."""

    base: np.ndarray  # uint64, sorted
    end: np.ndarray  # uint64
    memhs: list[Any]
    device: np.ndarray  # bool: not host memory (never a process_vm_readv destination)

    def containing(self, local: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row: index of the registered local region holding [local, +length), and whether one does."""
        j = np.searchsorted(self.base, local, side="right").astype(np.int64) - 1
        jj = np.maximum(j, 0)
        return jj, (j >= 0) & (local + length <= self.end[jj])

    def host_only(self, mask: np.ndarray, local: np.ndarray, length: np.ndarray) -> np.ndarray:
        """``mask`` without the rows landing in registered non-host memory (only UCX, with
        cuda_copy, writes those; unregistered destinations count as host memory)."""
        if not self.device.any():
            return mask
        j, inside = self.containing(local, length)
        return mask & ~(inside & self.device[j])


class LocalRegions:
    """The registration table: indices are stable; a freed index is reused only after
    ``_REUSE_AFTER`` newer frees (so the table is bounded by live slots + that many).

    Not locked itself: ``UcxTransport`` calls every method under its own lock.
    """

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._slots: list[LocalRegion] = []
        self._by_range: dict[tuple[int, int], int] = {}  # live (base, nbytes) -> index
        self._by_key: dict[bytes, int] = {}  # stream key of a live slot -> index
        self._snapshot: LocalSnapshot | None = None  # cached until the table changes
        self._free: deque[int] = deque()  # freed indices, oldest first
        self._live = 0  # slots with a UCX registration

    @staticmethod
    def memory_type_code(address: int, nbytes: int, memory_type: str) -> int:
        """Check a registration request (before any lock); the extension's memory type constant."""
        if address < 0 or nbytes < 0:
            raise TransportError(f"bad region address=0x{address:x} nbytes={nbytes}")
        nat = native()
        codes = dict(
            zip(_MEMORY_TYPES, (nat.MEMORY_TYPE_HOST, nat.MEMORY_TYPE_CUDA, nat.MEMORY_TYPE_UNKNOWN))
        )
        mt = codes.get(memory_type)
        if mt is None:
            raise ValueError(f"memory_type must be 'host', 'cuda' or 'unknown', got {memory_type!r}")
        return mt

    def add(self, address: int, nbytes: int, mt: int, memory_type: str, keepalive: Any) -> int:
        """Register ``[address, +nbytes)`` (idempotent per range); its region index."""
        key = (address, nbytes)
        idx = self._by_range.get(key)
        if idx is not None:
            reg = self._slots[idx]
            if keepalive is not None and reg.keepalive is None:
                reg.keepalive = keepalive
            return idx
        memh = None
        rkey = b""
        if nbytes > 0:  # an empty region gets a slot but no UCX registration
            if address == 0:
                raise TransportError(f"cannot register {nbytes} bytes at address 0")
            try:
                memh = self._worker.mem_map(address, nbytes, mt)
            except native().UcxError as exc:
                raise typed_error(
                    exc, f"registering {nbytes} bytes at 0x{address:x} ({memory_type})"
                ) from exc
            rkey = memh.rkey()
        fd = memfd.fd_of(address, nbytes) if memory_type == "host" else -1
        # Streamed (tcp) reads serve only host memory whose storage they can hold during a send.
        skey = stream.new_key() if memory_type == "host" and keepalive is not None and nbytes > 0 else b""
        reg = LocalRegion(
            RegionInfo(address, nbytes, rkey, memory_type, fd, skey), memh, keepalive, memory_type
        )
        if len(self._free) > _REUSE_AFTER:
            idx = self._free.popleft()
            self._slots[idx] = reg
        else:
            idx = len(self._slots)
            self._slots.append(reg)
        self._by_range[key] = idx
        if skey:
            self._by_key[skey] = idx
        self._live += memh is not None
        self._snapshot = None
        return idx

    def remove(self, region: int) -> None:
        """Free a slot: unmap it, drop the keepalive, keep the index (size 0, empty rkey)."""
        if not 0 <= region < len(self._slots):
            raise TransportError(f"no region {region} (have {len(self._slots)})")
        reg = self._slots[region]
        if reg.memh is None and reg.info.size == 0 and reg.keepalive is None:
            return  # already free
        key = (reg.info.base, reg.info.size)
        if self._by_range.get(key) == region:
            del self._by_range[key]
        if reg.memh is not None:
            reg.memh.unmap()
            self._live -= 1
        self._by_key.pop(reg.info.stream_key, None)
        self._slots[region] = LocalRegion(RegionInfo(reg.info.base, 0, b""))
        self._free.append(region)
        self._snapshot = None

    def served(self, key: bytes) -> stream.Served | None:
        """What a streamed read naming stream key ``key`` may take: the live host region holding
        that key, or None. By key, not index: a descriptor that lists some of the slots (a
        session hub's namespace) numbers them its own way; the key is the capability."""
        idx = self._by_key.get(key)
        if idx is None:
            return None
        r = self._slots[idx]
        if r.memh is None or r.keepalive is None:  # (a freed slot's key left _by_key with it)
            return None
        return stream.Served(r.info.base, r.info.size, r.info.stream_key, r.keepalive)

    def info(self, region: int) -> RegionInfo:
        """Slot ``region`` (IndexError if there is none)."""
        return self._slots[region].info

    def infos(self) -> tuple[RegionInfo, ...]:
        """Every slot in index order, freed ones included: the descriptor's ``regions``."""
        return tuple(r.info for r in self._slots)

    def __len__(self) -> int:
        """Slots in the table, freed ones included (the descriptor's ``regions``)."""
        return len(self._slots)

    @property
    def live(self) -> int:
        """Slots holding a UCX registration now."""
        return self._live

    def snapshot(self) -> LocalSnapshot:
        """The live regions for ``get`` (cached; rebuilt after a change)."""
        s = self._snapshot
        if s is not None:
            return s
        live = sorted(
            ((r.info.base, r.info.size, r.memh, r.memory_type) for r in self._slots if r.memh is not None),
            key=lambda x: x[0],
        )
        s = LocalSnapshot(
            np.array([x[0] for x in live], dtype=np.uint64),
            np.array([x[0] + x[1] for x in live], dtype=np.uint64),
            [x[2] for x in live],
            np.array([x[3] != "host" for x in live], dtype=bool),
        )
        self._snapshot = s
        return s

    def clear(self) -> None:
        """Unmap everything (at transport close)."""
        for r in self._slots:
            if r.memh is not None:
                r.memh.unmap()
        self._slots = []
        self._by_range.clear()
        self._by_key.clear()
        self._free.clear()
        self._live = 0
        self._snapshot = None

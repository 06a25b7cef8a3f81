"""The transport interface: register memory, describe it, connect, run a read plan.

A *publisher* registers the memory it wants others to read and publishes
``descriptor()`` (a plain msgpack-able dict) through the catalog. A *consumer* calls
``connect(peer, descriptor)`` once per source (cached; cheap to repeat) and then runs
whole read plans with ``get(ops)``: one call for any number of reads, no Python work
per read.

Plan rows (``ops``): an integer array of shape ``(n, 5)``, columns ``OP_PEER,
OP_REGION, OP_OFFSET, OP_LOCAL, OP_LENGTH``::

    (peer_index, region_index, remote_offset_within_region, local_address, length)

``peer_index`` is ``transport.peer_index(peer)``; ``region_index`` indexes the
``regions`` list of the descriptor that peer was connected with; ``local_address`` is
a raw pointer into memory of this process (host or, with a CUDA-capable UCX, device).
Every row is bounds-checked against its region before any byte moves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

import numpy as np

from ..errors import TransportError

__all__ = [
    "OP_PEER",
    "OP_REGION",
    "OP_OFFSET",
    "OP_LOCAL",
    "OP_LENGTH",
    "OP_COLUMNS",
    "RegionInfo",
    "PeerDescriptor",
    "Transport",
    "make_ops",
]

OP_PEER, OP_REGION, OP_OFFSET, OP_LOCAL, OP_LENGTH = range(5)
OP_COLUMNS = 5


@dataclass(frozen=True)
class RegionInfo:
    """What a consumer needs to read one registered region.

    A freed (unregistered) slot keeps its index with ``size == 0`` and ``rkey == b""``.
    ``memory_type`` is ``"host"``, ``"cuda"`` or ``"unknown"``; the dict form carries the
    key ``memory_type`` only when it is not ``"host"``. Only host regions may be read
    with the same-host fast path (``process_vm_readv``).
    """

    base: int
    size: int
    rkey: bytes
    memory_type: str = "host"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"base": self.base, "size": self.size, "rkey": self.rkey}
        if self.memory_type != "host":
            d["memory_type"] = self.memory_type
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RegionInfo":
        try:
            base, size, rkey = int(d["base"]), int(d["size"]), bytes(d["rkey"])
            mtype = str(d.get("memory_type", "host"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TransportError(f"malformed region entry {d!r}: {exc}") from exc
        if base < 0 or size < 0 or base + size > 2**64:
            raise TransportError(f"region entry out of range: base={base} size={size}")
        return cls(base, size, rkey, mtype)


@dataclass(frozen=True)
class PeerDescriptor:
    """Parsed form of ``Transport.descriptor()``.

    The dict form has the keys ``kind`` ("ucx"), ``worker_address`` (bytes), ``host``
    (hostname), ``node`` (an id equal for processes that can share memory: boot id and
    pid/ipc/mount namespaces), ``pid`` (int), ``shm`` (bool: the publisher's UCX
    context has shared-memory/CMA transports) and ``regions`` (list of
    ``{"base", "size", "rkey"[, "memory_type"]}``).
    """

    kind: str
    worker_address: bytes
    regions: tuple[RegionInfo, ...]
    host: str = ""
    node: str = ""
    pid: int = 0
    shm: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            kind=self.kind,
            worker_address=self.worker_address,
            host=self.host,
            node=self.node,
            pid=self.pid,
            shm=self.shm,
            regions=[r.to_dict() for r in self.regions],
        )
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "PeerDescriptor") -> "PeerDescriptor":
        if isinstance(d, PeerDescriptor):
            return d
        if not isinstance(d, Mapping):
            raise TransportError(f"transport descriptor must be a dict, got {type(d).__name__}")
        try:
            kind = str(d["kind"])
            addr = bytes(d["worker_address"])
            regions = tuple(RegionInfo.from_dict(r) for r in d["regions"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed transport descriptor: missing/invalid {exc}") from exc
        known = {"kind", "worker_address", "regions", "host", "node", "pid", "shm"}
        return cls(
            kind=kind,
            worker_address=addr,
            regions=regions,
            host=str(d.get("host", "")),
            node=str(d.get("node", "")),
            pid=int(d.get("pid", 0) or 0),
            shm=bool(d.get("shm", False)),
            extra={k: v for k, v in d.items() if k not in known},
        )


def make_ops(n: int) -> np.ndarray:
    """An uninitialized ``(n, 5)`` uint64 plan to fill column-wise."""
    return np.empty((n, OP_COLUMNS), dtype=np.uint64)


class Transport(ABC):
    """One process's data-path endpoint (publisher and consumer at once).

    The contract the store is typed against: everything it calls on a transport is
    declared here. Backends add their own extras (e.g. ``UcxTransport.peer_info``).
    """

    kind: str = "abstract"

    # -- publishing ---------------------------------------------------------------------------
    @abstractmethod
    def register(self, address: int, nbytes: int) -> int:
        """Register existing host memory; return its region index in ``descriptor()``.

        Idempotent per ``(address, nbytes)``. The memory must stay valid until
        ``unregister``/``close``.
        """

    @abstractmethod
    def register_tensor(self, tensor: Any) -> int:
        """Register the whole untyped storage of a torch tensor (CPU or CUDA).

        Keeps a reference to the storage until unregistered. Reads then address the
        region with byte offsets from ``tensor.untyped_storage().data_ptr()``.
        """

    @abstractmethod
    def unregister(self, region: int) -> None:
        """Release a region. Its index stays (size 0, empty rkey); indices are never reused."""

    @abstractmethod
    def region(self, region: int) -> RegionInfo:
        """This process's region ``region``."""

    @abstractmethod
    def descriptor(self) -> dict[str, Any]:
        """Plain msgpack-able dict describing this process's worker and regions."""

    # -- consuming ----------------------------------------------------------------------------
    @abstractmethod
    def connect(self, peer: Hashable, descriptor: Mapping[str, Any]) -> int:
        """Connect to (or refresh) a peer from its descriptor; return its peer index.

        Cached: reconnects only when the worker address changes (or the endpoint has
        failed), re-unpacks only regions whose (base, size, rkey) changed.
        """

    @abstractmethod
    def disconnect(self, peer: Hashable) -> None:
        """Drop the peer's endpoint and keys. Its index is not reused."""

    @abstractmethod
    def peer_index(self, peer: Hashable) -> int:
        """Index of a connected peer for plan column ``OP_PEER`` (KeyError if unknown)."""

    @property
    @abstractmethod
    def peers(self) -> list[Hashable]:
        """Keys of the connected peers (a copy)."""

    @abstractmethod
    def get(self, ops: np.ndarray, *, timeout: float | None = None) -> None:
        """Run a whole read plan (see module docstring). Returns when every byte landed.

        Raises TransportError (bad rows, before any byte moves; UCX failures) or
        PeerUnreachable (peer dead/unreachable, or ``timeout`` seconds passed).
        """

    @abstractmethod
    def close(self) -> None:
        """Release everything. Idempotent."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astate_store.errors import TransportError
from astate_store.transport.stream import KEY_BYTES as STREAM_KEY_BYTES
from astate_store.transport.stream import parse_address

__all__ = [
    "MAX_REGIONS",
    "MAX_RKEY_BYTES",
    "MAX_WORKER_ADDRESS_BYTES",
    "PROOF_TAG",
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

# Descriptors come from etcd, i.e. from anyone who can write there: every field is checked
# (type, sign, range, length) before any of it reaches the extension.
MAX_WORKER_ADDRESS_BYTES = 16 << 10  # UCX worker addresses are ~100 B per transport/device
MAX_RKEY_BYTES = 4096  # a packed rkey is ~10-100 B per memory domain
MAX_REGIONS = 1 << 20  # regions (registrations) one descriptor may list
MAX_NAME_CHARS = 4096  # host / node strings
_PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT
_MEMORY_TYPES = ("host", "cuda", "unknown")
# The ``rkey`` of a descriptor's proof entry starts with this tag (see PeerDescriptor); UCX's
# packed rkeys start with a 64-bit memory-domain map, which is never all ones.
PROOF_TAG = b"\xff\xff\xff\xff\xff\xff\xff\xffastate-proof\x00"


def _int_field(d: Mapping[str, Any], key: str, what: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TransportError(f"malformed {what}: {key!r} must be an integer, got {type(v).__name__}")
    return v


def _bytes_field(d: Mapping[str, Any], key: str, what: str, limit: int) -> bytes:
    v = d[key]
    if not isinstance(v, (bytes, bytearray, memoryview)):  # bytes(int) would allocate that many zeros
        raise TransportError(f"malformed {what}: {key!r} must be bytes, got {type(v).__name__}")
    b = bytes(v)
    if len(b) > limit:
        raise TransportError(f"malformed {what}: {key!r} of {len(b)} bytes (at most {limit})")
    return b


def _str_field(d: Mapping[str, Any], key: str, what: str) -> str:
    v = d.get(key, "")
    if not isinstance(v, str) or len(v) > MAX_NAME_CHARS:
        raise TransportError(
            f"malformed {what}: {key!r} must be a string of at most {MAX_NAME_CHARS} characters"
        )
    return v


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
    memfd: int = -1  # fd number of the memfd mapped over the region in its process (memfd.py); -1: none
    stream_key: bytes = b""  # the key a streamed read of this region must name (stream/); b"": not streamed

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"base": self.base, "size": self.size, "rkey": self.rkey}
        if self.memory_type != "host":
            d["memory_type"] = self.memory_type
        if self.memfd >= 0:
            d["memfd"] = self.memfd
        if self.stream_key:
            d["stream_key"] = self.stream_key
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RegionInfo:
        """Parse and check one region entry (from another process: nothing is trusted).

        Raises:
            TransportError: a missing field, a wrong type, a negative or overflowing range,
                a non-null size at address 0, an rkey over ``MAX_RKEY_BYTES``, an unknown
                memory type.
        """
        what = "region entry"
        if not isinstance(d, Mapping):
            raise TransportError(f"malformed {what}: expected a dict, got {type(d).__name__}")
        try:
            base, size = _int_field(d, "base", what), _int_field(d, "size", what)
            rkey = _bytes_field(d, "rkey", what, MAX_RKEY_BYTES)
        except KeyError as exc:
            raise TransportError(f"malformed {what}: missing {exc}") from None
        mtype = d.get("memory_type", "host")
        if mtype not in _MEMORY_TYPES:
            raise TransportError(f"malformed {what}: memory_type {mtype!r} is not one of {_MEMORY_TYPES}")
        if base < 0 or size < 0 or base + size > 2**64:
            raise TransportError(f"region entry out of range: base={base} size={size}")
        if size > 0 and base == 0:
            raise TransportError(f"region entry out of range: {size} bytes at address 0")
        memfd = _int_field(d, "memfd", what) if "memfd" in d else -1
        if not -1 <= memfd < 2**31:
            raise TransportError(f"malformed {what}: memfd {memfd} is not a file descriptor number")
        skey = _bytes_field(d, "stream_key", what, STREAM_KEY_BYTES) if "stream_key" in d else b""
        if skey and len(skey) != STREAM_KEY_BYTES:
            raise TransportError(
                f"malformed {what}: stream_key of {len(skey)} bytes (want {STREAM_KEY_BYTES})"
            )
        return cls(base, size, rkey, str(mtype), memfd, skey)


@dataclass(frozen=True)
class PeerDescriptor:
    """Parsed form of ``Transport.descriptor()``.

    The dict form has the keys ``kind`` ("ucx"), ``worker_address`` (bytes), ``host``
    (hostname), ``node`` (an id equal for processes that can share memory: boot id and
    pid/ipc/mount namespaces), ``pid`` (int), ``shm`` (bool: the publisher's UCX
    context has shared-memory/CMA transports) and ``regions`` (list of
    ``{"base", "size", "rkey"[, "memory_type", "memfd", "stream_key"]}``); ``stream``
    (optional): ``"ip:port"`` of its streamed-read server (``stream/``).

    ``proof``: the publisher's proof region (a small registered buffer holding a random
    nonce, see ``same_host``). On the wire it is the *last* entry of ``regions``, its
    ``rkey`` prefixed with :data:`PROOF_TAG` (the descriptor schema has no field of its
    own for it); parsed, ``regions`` holds the data regions only, so region indices are
    unchanged.

    Every field is checked by :meth:`from_dict` (types, ranges, lengths within
    ``MAX_*``): a bad descriptor raises :class:`TransportError`, never reaches UCX.
    """

    kind: str
    worker_address: bytes
    regions: tuple[RegionInfo, ...]
    host: str = ""
    node: str = ""
    pid: int = 0
    shm: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    proof: RegionInfo | None = None
    stream: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        regions = [r.to_dict() for r in self.regions]
        if self.proof is not None:
            p = self.proof.to_dict()
            p["rkey"] = PROOF_TAG + p["rkey"]
            regions.append(p)
        d.update(
            kind=self.kind,
            worker_address=self.worker_address,
            host=self.host,
            node=self.node,
            pid=self.pid,
            shm=self.shm,
            regions=regions,
        )
        if self.stream:
            d["stream"] = self.stream
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | PeerDescriptor) -> PeerDescriptor:
        if isinstance(d, PeerDescriptor):
            return d
        if not isinstance(d, Mapping):
            raise TransportError(f"transport descriptor must be a dict, got {type(d).__name__}")
        what = "transport descriptor"
        try:
            kind = d["kind"]
            addr = _bytes_field(d, "worker_address", what, MAX_WORKER_ADDRESS_BYTES)
            raw = d["regions"]
        except KeyError as exc:
            raise TransportError(f"malformed {what}: missing/invalid {exc}") from None
        if not isinstance(kind, str):
            raise TransportError(f"malformed {what}: 'kind' must be a string")
        if not addr:
            raise TransportError(f"malformed {what}: empty worker address")
        if not isinstance(raw, (list, tuple)):
            raise TransportError(f"malformed {what}: 'regions' must be a list, got {type(raw).__name__}")
        if len(raw) > MAX_REGIONS + 1:
            raise TransportError(f"malformed {what}: {len(raw)} regions (at most {MAX_REGIONS})")
        proof = None
        if (
            raw
            and isinstance(raw[-1], Mapping)
            and isinstance(raw[-1].get("rkey"), (bytes, bytearray))
            and bytes(raw[-1]["rkey"][: len(PROOF_TAG)]) == PROOF_TAG
        ):
            last = dict(raw[-1])
            last["rkey"] = bytes(last["rkey"])[len(PROOF_TAG) :]
            proof = RegionInfo.from_dict(last)
            raw = raw[:-1]
        elif len(raw) > MAX_REGIONS:
            raise TransportError(f"malformed {what}: {len(raw)} regions (at most {MAX_REGIONS})")
        regions = tuple(RegionInfo.from_dict(r) for r in raw)
        pid = d.get("pid", 0)
        pid = 0 if pid is None else pid
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid <= _PID_MAX:
            raise TransportError(f"malformed {what}: pid {pid!r} is not a process id")
        shm = d.get("shm", False)
        if not isinstance(shm, bool):
            raise TransportError(f"malformed {what}: 'shm' must be a bool")
        stream = d.get("stream", "")
        if stream != "":
            parse_address(stream)
        known = {"kind", "worker_address", "regions", "host", "node", "pid", "shm", "stream"}
        return cls(
            kind=kind,
            worker_address=addr,
            regions=regions,
            host=_str_field(d, "host", what),
            node=_str_field(d, "node", what),
            pid=pid,
            shm=shm,
            extra={k: v for k, v in d.items() if k not in known},
            proof=proof,
            stream=stream,
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

    def register_range(self, tensor: Any, address: int, nbytes: int) -> int:
        """Register ``[address, +nbytes)``, a part of ``tensor``'s storage (least exposure:
        only what is published becomes readable). Keeps a reference to the storage until
        unregistered; idempotent per ``(address, nbytes)``.

        The default registers the whole storage (backends that cannot do better).
        """
        return self.register_tensor(tensor)

    @abstractmethod
    def unregister(self, region: int) -> None:
        """Release a region. Its index stays (size 0, empty rkey) and is not handed out again
        before many newer slots were freed after it (a bounded table; see the backend)."""

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

    def exited(self, descriptor: Mapping[str, Any]) -> bool:
        """Whether the descriptor's process is known to have exited (a process of this node that
        is gone), so a reader does not plan a pull from it at all. False when not known: a remote
        peer, a live pid (which may be another process by now: the connect then fails), or a
        transport that cannot tell."""
        return False

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

    def prefault(self, peer: Hashable, spans: Sequence[tuple[int, int, int]]) -> None:
        """A hint, before planning: a coming ``get`` reads within these ``(region, lo, hi)``
        byte ranges of a connected ``peer``. A transport that reads mapped memory starts mapping
        their pages in the background; the default does nothing. Never raises for a peer or a
        region it does not know."""

    # -- this process's own memory ------------------------------------------------------------
    def copy_rows(self, rows: np.ndarray) -> None:
        """Copy ``(src, dst, nbytes)`` uint64 rows within this process (a put into its snapshot
        slot) with the transport's copy loop: native threads without spin-waits, since two ranks
        copying at once on a small host ran at half speed with torch's intra-op threads."""
        from astate_store.transport.binding import copy_rows

        copy_rows(rows)

    def prepare_staging(self, buffer: Any) -> None:
        """``buffer`` (a uint8 tensor from this transport's allocation) is about to be written
        whole: allocate its pages in bulk where the memory is memfd-backed, so the writes only
        map them (the first write of fresh memory is the slow one). Never raises."""
        from astate_store.transport.memfd import preallocate

        preallocate(buffer.data_ptr(), buffer.numel())

    @abstractmethod
    def close(self) -> None:
        """Release everything. Idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""What the publisher, consumer, serving and recovery roles of one store share.

One ``StoreContext`` per ``Store``: the namespace's catalog, the options, this process's
consumer identity, the figures behind ``Store.stats`` and ``/metrics`` (``metrics.StoreMetrics``),
and the transport — created lazily, near the device of the first tensors it will move (NUMA
node, NICs, progress-thread CPUs).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from astate_store.catalog import Catalog
from astate_store.metrics import StoreMetrics
from astate_store.transport import Transport, UcxTransport
from astate_store.transport.topology import (
    AffinityChoice,
    AffinityConfig,
    affinity_for,
    alloc_on_node,
    apply_env,
    pinned,
)

__all__ = ["StoreOptions", "StoreContext", "sync_device"]

log = logging.getLogger("astate_store")

# StoreOptions.delta_choice: how a delta consumer chooses between the changes and a whole pull
DELTA_CHOICES = ("bytes", "time")


@dataclass(frozen=True)
class StoreOptions:
    """The tunables of a store, one frozen record (``connect(ns, **fields)`` / ``Store(ns, **fields)``
    build it; ``Store(ns, options=StoreOptions(...))`` passes it whole)."""

    # the data path: "auto" (shared memory + cma on one host), "shm", or "tcp" (several hosts)
    transport: str = "auto"
    # committed versions whose metadata etcd keeps
    retention: int = 4
    # seconds after which a silent process counts as dead
    lease_ttl: float = 10.0
    # snapshot slots (versions live at once) of the publisher's pool
    staging_depth: int = 2
    # the most staging memory (snapshots, and dtype conversion on pull, pipelined through it); a
    # snapshot larger than the cap is streamed from the tensors themselves, and put then returns
    # once the live consumers have pulled it. None: a default from the device's memory.
    staging_cap_bytes: int | None = None
    # seconds one batched pull may take before PeerUnreachable
    read_timeout: float = 120.0
    # seconds a publisher waits for readers before reusing memory
    retire_timeout: float = 30.0
    # outstanding UCX requests per pull
    window: int = 256
    # NUMA/NIC affinity (AffinityConfig); None reads ASTATE_AFFINITY / ASTATE_NUMA_NODE; False: off
    affinity: AffinityConfig | bool | None = None
    # consumers ask publishers for contiguous copies of pieces they would read as many small runs
    # (the planner's cost model decides); publishers build them in their snapshot slots
    prepack: bool = True
    # serve this process's Prometheus /metrics on this port (0: any free one); None: no server
    metrics_port: int | None = None
    # the address the metrics server binds (loopback unless told otherwise)
    metrics_addr: str = "127.0.0.1"
    # replica servers (docs/replicas.md) that must hold a version before put returns (0: none)
    replicas: int = 0
    # seconds a put waits for `replicas` servers before ReplicationTimeout (the step stays committed)
    replica_timeout: float = 60.0
    # delta versions (docs/delta.md): a put also records which elements changed since this rank's
    # previous put; a pull into the buffers of the last pull moves only what changed since
    delta: bool = False
    # the changes' room per staging slot, as a fraction of the slot's snapshot bytes (delta=True);
    # tiles that do not fit are read whole
    delta_budget: float = 0.25
    # after each pull, check the tiles' XXH3 digests the publishers recorded (delta=True
    # publishers) against the buffers; a mismatch raises DeltaMismatch naming the tensor
    verify: bool = False
    # delta=True consumers: "bytes" pulls through the changes whenever they are fewer bytes than the
    # buffers; "time" only when this consumer measured that faster than a whole pull (on one host a
    # whole pull is a memory copy: get/delta_choice.py)
    delta_choice: str = "bytes"  # one of DELTA_CHOICES

    def __post_init__(self) -> None:
        """ValueError for a ``replicas`` that is not an int >= 0, a ``replica_timeout`` that is
        not a number of seconds > 0, a ``delta_budget`` outside [0, 4] or a ``delta_choice`` other
        than "bytes" or "time" (before anything is created)."""
        r, t = self.replicas, self.replica_timeout
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"replicas must be an int >= 0 (replica servers to wait for), got {r!r}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"replica_timeout must be a number of seconds > 0, got {t!r}")
        object.__setattr__(self, "replica_timeout", float(t))
        b = self.delta_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 4:
            raise ValueError(f"delta_budget must be a fraction of the snapshot bytes in [0, 4], got {b!r}")
        if self.delta_choice not in DELTA_CHOICES:
            raise ValueError(f"delta_choice must be one of {DELTA_CHOICES}, got {self.delta_choice!r}")

    @classmethod
    def of(cls, fields: dict[str, object]) -> StoreOptions:
        """From keyword arguments; an unknown name is a TypeError that lists the known ones."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"unknown store option(s) {unknown}; the options are {sorted(known)}")
        return cls(**fields)  # type: ignore[arg-type]

    def affinity_config(self) -> AffinityConfig:
        if self.affinity is False:
            return AffinityConfig(enabled=False)
        return self.affinity if isinstance(self.affinity, AffinityConfig) else AffinityConfig.from_env()


TransportFactory = Callable[[str, int], Transport]


def _ucx(mode: str, window: int) -> Transport:
    return UcxTransport(mode=mode, window=window)  # type: ignore[arg-type]


class StoreContext:
    """The state every role of one store reads: catalog, options, identity, stats, transport."""

    def __init__(
        self,
        namespace: str,
        catalog: Catalog,
        options: StoreOptions,
        *,
        rank: int,
        world_size: int,
        session_id: str | None,
        affinity: AffinityConfig,
        transport_factory: TransportFactory = _ucx,
    ):
        self.namespace, self.catalog, self.options = namespace, catalog, options
        self.rank, self.world_size, self.session_id = rank, world_size, session_id
        self.reader_id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
        # Consumers spread over replicas and groups without talking to each other.
        self.rotation = zlib.crc32(self.reader_id.encode()) & 0xFFFF
        # The figures behind Store.stats and /metrics (``metrics``); ``registrations`` is kept
        # current by the publisher and serving; the figures other objects own (catalog, staging)
        # are read through ``stats.live``, which the store gives those objects once they exist.
        self.stats = StoreMetrics(namespace, rank)
        self.affinity: AffinityChoice | None = None
        self._affinity_cfg = affinity
        self._factory = transport_factory
        self._transport: Transport | None = None

    @property
    def transport(self) -> Transport:
        return self.ensure_transport(None)

    def ensure_transport(self, device: torch.device | None) -> Transport:
        """Create the transport near the buffers' device: NIC choice via UCX_NET_DEVICES (unless
        the user set it) and the progress thread pinned to the local NUMA node (threads inherit
        the creating thread's CPU mask)."""
        if self._transport is None:
            self.affinity = affinity_for(device, self._affinity_cfg)
            apply_env(self.affinity)
            with pinned(self.affinity.cpus):
                self._transport = self._factory(self.options.transport, self.options.window)
            ucx = (
                self._transport
                if isinstance(self._transport, UcxTransport)
                else getattr(self._transport, "shared", None)
            )  # a session hub's namespace view of its worker
            if isinstance(ucx, UcxTransport) and not ucx.stream_host and not ucx.stream_address:
                ucx.stream_host = self._stream_host()
        return self._transport

    def _stream_host(self) -> str | None:
        """The address this process reaches etcd from: the interface consumers on other hosts
        reach it by too (the stream server binds and publishes it; loopback when etcd is local)."""
        try:
            host, _, port = self.catalog.client.config.endpoints[0].rpartition(":")
            host = host.strip("[]")
            info = socket.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)[0]
            with socket.socket(info[0], socket.SOCK_DGRAM) as s:
                s.connect(info[4])  # UDP: picks the route's source address, sends nothing
                return str(s.getsockname()[0])
        except (OSError, ValueError, IndexError, AttributeError) as exc:
            log.info("no stream address from the etcd endpoint (%s): the transport's default is used", exc)
            return None

    def alloc(self, nbytes: int, device: torch.device, *, shared: bool = False) -> torch.Tensor:
        """Staging memory: on the GPU for CUDA tensors, else on this store's NUMA node
        (``shared``: memory this process publishes, memfd-backed so same-host readers map it)."""
        if device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        node = self.affinity.numa_node if self.affinity is not None else None
        return alloc_on_node(nbytes, node, shared=shared)

    def ensure_session(self) -> None:
        """Open (rank 0) or join (rank > 0) the publisher session on first use."""
        if self.catalog.session is None:
            self.catalog.sessions.open(rank=self.rank, world_size=self.world_size, session_id=self.session_id)

    def close_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued kernels: a CUDA copy is asynchronous, and its bytes must be
    in place before a commit publishes them or a transfer reuses the memory."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()

"""Connected peers: endpoints, unpacked remote keys, and the flat tables ``get`` reads.

``get`` must not take the transport lock per row, nor walk Python objects per row, so
it works on a :class:`PeerSnapshot`: every connected peer's endpoint, regions and keys
flattened into numpy arrays, built once after a change and reused by every plan until
the next ``connect``/``disconnect`` (or a peer leaving the same-host path) drops it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astate_store.transport.base import PeerDescriptor, RegionInfo
from astate_store.transport.binding import native, typed_error
from astate_store.transport.stream import KEY_DT

__all__ = ["Peer", "PeerInfo", "PeerSnapshot", "PeerTable", "open_endpoint"]

# A disconnected peer's index is handed out again only once this many newer peers were
# disconnected after it: the per-index tables stay bounded under peer churn, and a plan
# built against a departed peer keeps failing ("not connected") for a long while instead of
# reading from whoever took its index.
_REUSE_AFTER = 64


@dataclass(frozen=True)
class PeerInfo:
    """A read-only account of one connected peer, from ``UcxTransport.peer_info``.

    ``index``: its plan index (``peer_index``). ``endpoint_id``: identifies the UCX
    endpoint in use; it changes exactly when ``connect`` creates a new endpoint (new
    worker address, or the old one failed/closed), so equal ids mean "reused".
    ``peer_error_handling``: the endpoint's error mode (True: PEER, i.e. tcp; False:
    NONE, i.e. shared memory). ``direct``: whether reads of this peer's host regions
    use ``process_vm_readv``: True only once the claimed pid was proven to be the
    process behind the endpoint (``same_host``); None is not produced any more (kept
    for callers that test for it). ``direct_regions``: per region of its descriptor,
    whether rows may take that path. ``mapped_regions``: per region, whether its memfd is
    mapped here (rows are then plain copies; ``memfd.py``). ``streamed``: rows of its host
    regions are streamed over tcp (``stream/``) instead of read with UCX. ``lanes``: UCX's
    description of the lanes and transports the endpoint uses.
    """

    index: int
    endpoint_id: int
    peer_error_handling: bool
    direct: bool | None
    direct_regions: tuple[bool, ...]
    mapped_regions: tuple[bool, ...] = ()
    streamed: bool = False
    lanes: str = ""


@dataclass
class Peer:
    """The mutable state of one connected peer (owned by the :class:`PeerTable`)."""

    key: Hashable
    index: int
    desc: PeerDescriptor
    ep: Any
    endpoint_id: int
    rkeys: list[Any] = field(default_factory=list)  # per region: RemoteKey or None
    direct: bool | None = None  # process_vm_readv path: None = not probed yet, False = UCX only
    pidfd: int = -1  # pidfd of desc.pid while direct
    proof_rkey: Any = None  # RemoteKey of desc.proof (the same-host identity check)
    maps: list[Any] = field(
        default_factory=list
    )  # per region: its memfd mapped here (memfd.PeerMapping) or None

    def needs_new_endpoint(self, d: PeerDescriptor) -> bool:
        """Whether ``d`` cannot be served by the current endpoint."""
        return self.desc.worker_address != d.worker_address or self.ep.failed or self.ep.closed

    def streams(self) -> bool:
        """Rows of this peer may be streamed: it has a stream server and UCX reaches it over tcp
        (same-host peers keep shared memory, which is faster)."""
        return bool(self.desc.stream) and not self.direct and bool(self.ep.peer_error_handling)

    def region_direct(self, r: RegionInfo) -> bool:
        """Rows of region ``r`` may use process_vm_readv (only host memory can)."""
        return bool(self.direct) and r.memory_type == "host"

    def adopt(self, d: PeerDescriptor, prev_regions: tuple[RegionInfo, ...]) -> None:
        """Take descriptor ``d``: (re)unpack only the rkeys of regions that changed.

        Regions equal to ``prev_regions`` keep their key; on a UCX failure the keys
        unpacked so far are destroyed and the peer keeps its old keys.
        """
        nat = native()
        new_rkeys: list[Any] = []
        proof_rkey = self.proof_rkey
        try:
            for i, r in enumerate(d.regions):
                if i < len(prev_regions) and prev_regions[i] == r and i < len(self.rkeys):
                    new_rkeys.append(self.rkeys[i])
                    continue
                new_rkeys.append(self.ep.unpack_rkey(r.rkey) if r.size > 0 and r.rkey else None)
            if d.proof != self.desc.proof or (proof_rkey is None and d.proof is not None):
                p = d.proof
                proof_rkey = self.ep.unpack_rkey(p.rkey) if p is not None and p.size > 0 and p.rkey else None
        except nat.UcxError as exc:
            for rk in new_rkeys:
                if rk is not None and rk not in self.rkeys:
                    rk.destroy()
            if proof_rkey is not None and proof_rkey is not self.proof_rkey:
                proof_rkey.destroy()
            raise typed_error(exc, f"unpacking rkeys of peer {self.key!r}") from exc
        kept = {id(rk) for rk in new_rkeys if rk is not None}
        for rk in self.rkeys:
            if rk is not None and id(rk) not in kept:
                rk.destroy()
        if self.proof_rkey is not None and self.proof_rkey is not proof_rkey:
            self.proof_rkey.destroy()
        self.rkeys = new_rkeys
        self.proof_rkey = proof_rkey
        self.desc = d

    def info(self) -> PeerInfo:
        return PeerInfo(
            index=self.index,
            endpoint_id=self.endpoint_id,
            peer_error_handling=bool(self.ep.peer_error_handling),
            direct=self.direct,
            direct_regions=tuple(self.region_direct(r) for r, _ in zip(self.desc.regions, self.rkeys)),
            mapped_regions=tuple(
                bool(self.direct) and i < len(self.maps) and self.maps[i] is not None
                for i in range(len(self.desc.regions))
            ),
            streamed=self.streams(),
        )


@dataclass(frozen=True)
class PeerSnapshot:
    """Snapshot of the connected peers, flattened for vectorized plan translation.

    Arrays "per peer index" are indexed by plan column ``OP_PEER``; "per flat region"
    by ``reg_off[peer] + region``.
    """

    ep_pos: np.ndarray  # int64 per peer index: position in `eps`, -1 if disconnected
    reg_off: np.ndarray  # uint64 per peer index: first flat region
    reg_n: np.ndarray  # uint64 per peer index: number of regions
    base: np.ndarray  # uint64 per flat region
    size: np.ndarray  # uint64 per flat region
    rkey_pos: np.ndarray  # int64 per flat region: position in `rkeys`, -1 if none
    eps: list[Any]
    rkeys: list[Any]
    keys: list[Hashable]  # peer key per peer index (None if disconnected)
    pid: np.ndarray  # uint64 per peer index: pid for the direct path, 0 = UCX only
    direct: np.ndarray  # bool per flat region: rows may use process_vm_readv
    n_direct: int  # peers on the direct path
    mapped: np.ndarray  # uint64 per flat region: address of its memfd mapped here (memcpy path), 0 = none
    maps: dict[int, Any] = field(
        default_factory=dict
    )  # flat region -> its PeerMapping (alive with this snapshot)
    # bool per flat region: rows may be streamed (stream/: a tcp peer with a stream server and a key for it)
    stream: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # peer index -> (peer key, stream address, stream.KEY_DT keys of its streamable regions)
    streams: dict[int, tuple[Hashable, str, np.ndarray]] = field(default_factory=dict)


def open_endpoint(worker: Any, d: PeerDescriptor, *, peer_mode: bool, timeout: float, where: str) -> Any:
    """A UCX endpoint to ``d``'s worker, flushed (so it is known to be up) within ``timeout``.

    Any failure counts as the peer's (PeerUnreachable): the address came from it.
    """
    nat = native()
    try:
        ep = worker.connect(d.worker_address, peer_error_handling=peer_mode)
    except nat.UcxError as exc:
        raise typed_error(exc, f"connecting to {where}", peer_gone=True) from exc
    try:
        ep.flush(timeout)
    except nat.UcxError as exc:
        ep.close()
        raise typed_error(exc, f"connecting to {where}", peer_gone=True) from exc
    return ep


class PeerTable:
    """Peers by key. A reconnect of the same key keeps its index; a disconnected peer's
    index is reused only after ``_REUSE_AFTER`` newer disconnects (bounded tables).

    Not locked itself: ``UcxTransport`` calls every method under its own lock (``get``
    only takes the lock to fetch the snapshot).
    """

    def __init__(self) -> None:
        self._peers: dict[Hashable, Peer] = {}
        self._next_index = 0
        self._next_endpoint_id = 0
        self._snapshot: PeerSnapshot | None = None
        self._free: deque[int] = deque()  # indices of disconnected peers, oldest first

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, key: Hashable) -> Peer | None:
        return self._peers.get(key)

    def require(self, key: Hashable) -> Peer:
        """The peer, or KeyError naming it."""
        try:
            return self._peers[key]
        except KeyError:
            raise KeyError(f"peer {key!r} is not connected") from None

    def keys(self) -> list[Hashable]:
        return list(self._peers)

    def values(self) -> list[Peer]:
        return list(self._peers.values())

    def add(self, key: Hashable, d: PeerDescriptor, ep: Any, index: int | None) -> Peer:
        """Record a new endpoint for ``key``: at ``index`` (a reconnect) or a fresh index.

        Leaves the snapshot alone: the caller invalidates it once the peer's keys are in.
        """
        if index is None:
            if len(self._free) > _REUSE_AFTER:
                index = self._free.popleft()
            else:
                index = self._next_index
                self._next_index += 1
        p = Peer(key, index, d, ep, self._next_endpoint_id)
        self._next_endpoint_id += 1
        self._peers[key] = p
        return p

    def remove(self, p: Peer, *, recycle: bool = True) -> None:
        """Destroy the peer's keys (before its endpoint, as UCX wants) and close its endpoint.

        ``recycle``: its index may be handed out again later (False for a reconnect,
        which keeps the index for the same key).
        """
        for rk in p.rkeys:
            if rk is not None:
                rk.destroy()
        p.rkeys = []
        p.maps = []  # unmapped once no snapshot holds them
        if p.proof_rkey is not None:
            p.proof_rkey.destroy()
            p.proof_rkey = None
        p.ep.close()
        if self._peers.get(p.key) is p:
            del self._peers[p.key]
            if recycle:
                self._free.append(p.index)
        self._snapshot = None

    def invalidate(self) -> None:
        """Drop the snapshot: the next ``snapshot()`` rebuilds it."""
        self._snapshot = None

    def snapshot(self) -> PeerSnapshot:
        """The flat tables for ``get`` (cached until ``invalidate``)."""
        s = self._snapshot
        if s is not None:
            return s
        n = self._next_index
        ep_pos = np.full(n, -1, dtype=np.int64)
        reg_off = np.zeros(n, dtype=np.uint64)
        reg_n = np.zeros(n, dtype=np.uint64)
        keys: list[Hashable] = [None] * n
        eps: list[Any] = []
        rkeys: list[Any] = []
        base: list[int] = []
        size: list[int] = []
        rkey_pos: list[int] = []
        pid = np.zeros(n, dtype=np.uint64)
        direct: list[bool] = []
        mapped: list[int] = []
        maps: dict[int, Any] = {}
        stream: list[bool] = []
        streams: dict[int, tuple[Hashable, str, np.ndarray]] = {}
        n_direct = 0
        for p in self._peers.values():
            if p.direct:
                pid[p.index] = p.desc.pid
                n_direct += 1
            ep_pos[p.index] = len(eps)
            eps.append(p.ep)
            keys[p.index] = p.key
            reg_off[p.index] = len(base)
            reg_n[p.index] = len(p.desc.regions)
            streamed = p.streams()
            keys_of: list[tuple[int, bytes]] = []
            for i, (r, rk) in enumerate(zip(p.desc.regions, p.rkeys)):
                s_ok = streamed and rk is not None and r.memory_type == "host" and bool(r.stream_key)
                stream.append(s_ok)
                if s_ok:
                    keys_of.append((i, r.stream_key))
                base.append(r.base)
                size.append(r.size if rk is not None else 0)  # unregistered: every read is out of bounds
                direct.append(p.region_direct(r))
                m = p.maps[i] if direct[-1] and i < len(p.maps) else None
                mapped.append(0 if m is None else m.address)
                if m is not None:
                    maps[len(base) - 1] = m
                if rk is None:
                    rkey_pos.append(-1)
                else:
                    rkey_pos.append(len(rkeys))
                    rkeys.append(rk)
            if keys_of:
                streams[p.index] = (p.key, p.desc.stream, np.array(keys_of, dtype=KEY_DT))
        s = PeerSnapshot(
            ep_pos,
            reg_off,
            reg_n,
            np.array(base, dtype=np.uint64),
            np.array(size, dtype=np.uint64),
            np.array(rkey_pos, dtype=np.int64),
            eps,
            rkeys,
            keys,
            pid,
            np.array(direct, dtype=bool),
            n_direct,
            np.array(mapped, dtype=np.uint64),
            maps,
            np.array(stream, dtype=bool),
            streams,
        )
        self._snapshot = s
        return s

"""UCX backend of :class:`~astate_store.transport.base.Transport` (one-sided ``ucp_get_nbx``).

Modes (what ``UcxTransport(mode=...)`` sets; an explicit ``UCX_TLS`` in the environment
always wins over the mode's transport list, and ``config=`` wins over everything):

``"shm"``
    ``UCX_TLS=sm,self``: sysv/posix for active messages, CMA (``process_vm_readv``)
    for the reads. Endpoints use error-handling mode NONE (PEER mode makes UCX drop
    shared memory). Same machine only. ``cma,self`` alone cannot connect ("Destination
    is unreachable").
``"tcp"``
    ``UCX_TLS=tcp,self`` plus ``UCX_TCP_TX_SEG_SIZE=1M UCX_TCP_RX_SEG_SIZE=1M`` (each
    unless already set in the environment; larger segments: fewer fragments, and fewer
    emulated round trips, per byte read). RMA is emulated, so the publisher's worker must be
    progressed: the progress thread is on. Host rows are streamed instead (below). Endpoints use
    PEER error handling: a dead peer gives an error, not a hang.
``"auto"`` (default)
    ``UCX_TLS=sm,tcp,self`` + the tcp segment sizes; per peer: same node (equal
    ``node`` ids, both sides with shared memory) -> mode NONE, which selects CMA;
    otherwise PEER, which selects tcp.

Where torch sees a CUDA device, the mode's list also gets ``cuda_copy,cuda_ipc``
(``cuda_copy`` only for tcp) so CUDA tensors (registered with
``UCS_MEMORY_TYPE_CUDA``) can be read and written; this path is untested here (no GPU).

``UCX_NET_DEVICES`` and every other ``UCX_*`` variable are read by UCX itself.

Same-host fast path (``direct=True``, the default; ``ASTATE_SHM_DIRECT=0`` or
``direct=False`` turns it off): for a peer on this node whose endpoint uses mode NONE
(shared memory), ``get`` reads that peer's rows of host regions itself with batched
``process_vm_readv`` (up to 1024 rows per syscall, GIL released, ``copy_threads``
threads for plans over 64 MiB) instead of one ``ucp_get_nbx`` per row (UCX's CMA makes a
request and a syscall per row). A region backed by a sealed memfd (the publisher's snapshot
staging, ``memfd.py``) is mapped into this process once, after the checks there, and its
rows are plain ``memcpy`` spread over threads: memcpy speed, no syscall per row. Only a pid
proven to be the process behind the peer's UCX endpoint is read this way: ``connect`` reads the peer's proof
region (a random nonce every
transport registers and lists in its descriptor) once through UCX and once with
``process_vm_readv`` from the claimed pid, and enables the path only if both match (see
``same_host``); a peer without a proof, with a mismatch, or that refuses the read (EPERM:
ptrace restrictions such as ``/proc/sys/kernel/yama/ptrace_scope``, ENOSYS) stays on UCX,
logged. At ``get`` time EFAULT,
EPERM or ENOSYS send the whole plan through UCX instead; ESRCH (peer gone) raises
:class:`~astate_store.errors.PeerUnreachable`. A pidfd per peer, polled after the
reads, catches a peer that exited mid-plan (so a reused pid cannot supply the bytes).
Rows of CUDA / unknown-memory regions, or into registered non-host local memory, use UCX.
``timeout`` applies to the UCX and streamed parts.

Streamed path (``stream=True``, the default in modes ``tcp`` and ``auto``; ``ASTATE_STREAM=0``
turns it off): rows of host regions of a peer UCX reaches over tcp go as one request per peer
to its stream server, which sends their bytes back in plan order (``stream/``: why, the wire
format, what the server checks). A peer whose stream server cannot be connected to is read
with UCX.

The progress thread (default on in every mode) sleeps on the worker's event fd and
progresses the worker when something arrives; during ``get`` the calling thread
progresses instead.

Descriptors are untrusted input (they come from etcd): ``connect`` checks every field
(``PeerDescriptor.from_dict``: types, ranges, worker address and rkey lengths, region
count) and the extension checks each packed rkey's layout before UCX parses it, so a bad
descriptor raises :class:`~astate_store.errors.TransportError` at ``connect``.

Least exposure and hygiene: ``register_range`` registers only part of a storage (what
is published); ``unregister`` unmaps at once, and freed region slots and disconnected
peers' indices are reused after 64 newer ones, so the tables stay bounded. ``disconnect``
destroys the peer's rkeys, closes its endpoint and its pidfd. A ``get`` that times out
cancels or force-closes every outstanding request and waits for their completion before it
raises, so no late read lands in the destination afterwards.

Errors: UCX failures raise :class:`~astate_store.errors.TransportError` whose message
carries UCX's status text (``exc.status`` / ``exc.status_text`` hold the raw status);
a dead, unreachable or timed-out peer raises
:class:`~astate_store.errors.PeerUnreachable`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from astate_store.errors import PeerUnreachable, TransportError
from astate_store.transport.base import PeerDescriptor, RegionInfo, Transport
from astate_store.transport.binding import native, typed_error
from astate_store.transport.config import MODES, Mode, direct_from_env, effective_config, tls_has_shm
from astate_store.transport.peers import Peer, PeerInfo, PeerSnapshot, PeerTable, open_endpoint
from astate_store.transport.regions import LocalRegions, LocalSnapshot
from astate_store.transport.rows import Rows, check_ops, resolve_rows
from astate_store.transport.same_host import ProcessIdentity, Proof, SameHostReader, pid_alive
from astate_store.transport.stream import Served, StreamReader, StreamServer, jobs_for
from astate_store.transport.stream import enabled as stream_enabled
from astate_store.transport.ucx_get import UcxReader

__all__ = ["UcxTransport", "PeerInfo", "native", "MODES", "Mode"]

log = logging.getLogger(__name__)


def _mtype(tensor: Any) -> str:
    dev = tensor.device.type
    return "cuda" if dev == "cuda" else ("host" if dev == "cpu" else "unknown")


def _stream_rows(
    reader: StreamReader, t: PeerSnapshot, lt: LocalSnapshot, rows: Rows, timeout: float | None
) -> Rows | None:
    """Stream (through ``reader``) the rows of tcp peers' host regions into host memory; the rows
    left for UCX."""
    mask = lt.host_only(t.stream[rows.flat], rows.local, rows.length)
    if not mask.any():
        return rows
    sel = np.flatnonzero(mask)
    flat, pidx = rows.flat[sel], rows.pidx[sel]
    jobs = jobs_for(
        t.streams,
        pidx,
        flat - t.reg_off[pidx],
        rows.remote[sel] - t.base[flat],
        rows.length[sel],
        rows.local[sel],
    )
    left = reader.read(jobs, timeout)
    keep = np.ones(len(rows), dtype=bool)
    keep[sel] = False
    for j in left:  # not reachable over the stream: UCX reads them
        keep[sel[j.rows_index]] = True
    return rows.take(keep) if keep.any() else None


class UcxTransport(Transport):
    """UCX one-sided transport (modes: module docstring): a coordinator over its roles (``regions``,
    ``peers``, ``rows``, ``same_host``, ``ucx_get``) that owns the worker and their one lock.

    Args:
        mode: ``"shm"``, ``"tcp"`` or ``"auto"``.
        progress_thread: run a background progress thread (default: on).
        config: extra UCX settings (``{"TLS": ..., "NET_DEVICES": ...}``, ``UCX_`` prefix optional),
            applied last, over the environment and the mode defaults.
        window: most outstanding reads per ``get``.
        connect_timeout: seconds ``connect`` waits for a new endpoint to come up (flush).
        direct: same-host ``process_vm_readv`` fast path (default on; ``ASTATE_SHM_DIRECT=0``: off).
        copy_threads: fast-path threads (None: up to 8 for mapped memfd regions, one for
            ``process_vm_readv``; a number: that many for both, cma only for plans over 64 MiB).
        stream: streamed reads for peers over tcp (``stream/``; ``ASTATE_STREAM=0``: off): host
            regions served on a TCP port (modes ``tcp``, ``auto``), such peers' rows read that way.
        stream_host: the IP address the stream server binds and publishes (default
            ``ASTATE_STREAM_HOST``, else 127.0.0.1; a store sets the address it reaches etcd from).
    """

    kind = "ucx"

    def __init__(
        self,
        mode: Mode = "auto",
        *,
        progress_thread: bool | None = None,
        config: Mapping[str, str] | None = None,
        window: int = 256,
        connect_timeout: float = 10.0,
        direct: bool | None = None,
        copy_threads: int | None = None,
        stream: bool | None = None,
        stream_host: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        nat = native()
        self.mode = mode
        self.window = int(window)
        self.connect_timeout = float(connect_timeout)
        self.direct = direct_from_env() if direct is None else bool(direct)
        self.copy_threads = None if copy_threads is None else max(1, int(copy_threads))
        self.config = effective_config(mode, config)
        self.tls = self.config.get("TLS") or os.environ.get("UCX_TLS", "")
        self.shm = tls_has_shm(self.tls)
        # Settings are checked (ASTATE_STREAM_LANES) before anything is created that would need closing.
        self._stream_reader = StreamReader()
        # One lock for all mutable state (regions, peers, pidfds' owners); `get` holds
        # it only to take the snapshots, never while bytes move.
        self._lock = threading.RLock()
        self._me = ProcessIdentity.current()
        try:
            self._worker = nat.Worker(
                self.config, progress_thread=True if progress_thread is None else bool(progress_thread)
            )
        except nat.UcxError as exc:
            raise typed_error(exc, f"UCX init failed (mode={mode}, UCX_TLS={self.tls!r})") from exc
        self._regions = LocalRegions(self._worker)
        self._peers = PeerTable()
        try:
            self._proof = Proof(self._worker)
        except BaseException:
            self._worker.close()
            raise
        self._same_host = SameHostReader(
            self._peers, self._lock, self._me.host, self._worker, self.connect_timeout
        )
        self._ucx_reader = UcxReader(self._worker, self._peers, self._lock, self._me)
        self.stream = (stream_enabled() if stream is None else bool(stream)) and mode in ("tcp", "auto")
        self.stream_host = stream_host or os.environ.get("ASTATE_STREAM_HOST") or None
        self._stream_server: StreamServer | None = None
        self._stream_failed = False
        self._closed = False

    @staticmethod
    def effective_config(mode: str, config: Mapping[str, str] | None = None) -> dict[str, str]:
        """The UCX settings a transport in ``mode`` would use now (see ``config.effective_config``)."""
        return effective_config(mode, config)

    # ------------------------------------------------------------------ properties
    @property
    def progress_thread(self) -> bool:
        return bool(self._worker.progress_thread)

    @property
    def worker_address(self) -> bytes:
        return self._worker.address

    @property
    def closed(self) -> bool:
        return self._closed

    def info(self) -> str:
        """UCX's description of the context and worker (transports, devices)."""
        return self._worker.info()

    def peer_info(self, peer: Hashable) -> PeerInfo:
        """What this transport decided for a connected peer (KeyError if unknown).

        A read-only copy: which endpoint is in use (``endpoint_id`` changes exactly when
        ``connect`` makes a new one), its error mode, its lanes, and whether the same-host
        ``process_vm_readv`` path serves it, per region too. See :class:`PeerInfo`.
        """
        with self._lock:
            p = self._peers.require(peer)
            info = p.info()
        # UCX prints the lanes under its worker's lock: asked outside this transport's lock
        return dataclasses.replace(info, streamed=info.streamed and self.stream, lanes=p.ep.info())

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    # ------------------------------------------------------------------ publishing
    def register(self, address: int, nbytes: int, *, memory_type: str = "host") -> int:
        return self._register(int(address), int(nbytes), memory_type, None)

    def register_tensor(self, tensor: Any) -> int:
        storage = tensor.untyped_storage()
        return self._register(int(storage.data_ptr()), int(storage.nbytes()), _mtype(tensor), storage)

    def register_range(self, tensor: Any, address: int, nbytes: int) -> int:
        storage = tensor.untyped_storage()
        lo, n = int(storage.data_ptr()), int(storage.nbytes())
        address, nbytes = int(address), int(nbytes)
        if nbytes < 0 or address < lo or address + nbytes > lo + n:
            raise TransportError(
                f"range [0x{address:x}, +{nbytes}) is not inside the tensor's storage [0x{lo:x}, +{n})"
            )
        return self._register(address, nbytes, _mtype(tensor), storage)

    def _register(self, address: int, nbytes: int, memory_type: str, keepalive: Any) -> int:
        mt = LocalRegions.memory_type_code(address, nbytes, memory_type)
        with self._lock:
            self._check_open()
            return self._regions.add(address, nbytes, mt, memory_type, keepalive)

    def unregister(self, region: int) -> None:
        with self._lock:
            self._check_open()
            self._regions.remove(region)

    def region(self, region: int) -> RegionInfo:
        with self._lock:
            return self._regions.info(region)

    @property
    def num_regions(self) -> int:
        """Regions registered now (freed slots not counted): goes down with ``unregister``."""
        with self._lock:
            return self._regions.live

    @property
    def streamed_bytes(self) -> int:
        """Bytes this transport has read over the stream path (``stream/``) so far."""
        return self._stream_reader.bytes

    @property
    def stream_address(self) -> str:
        """``ip:port`` of this transport's stream server ("" until the first descriptor, or off)."""
        return self._stream_server.address if self._stream_server is not None else ""

    def _ensure_stream_server(self) -> str:
        if self.stream and self._stream_server is None and not self._stream_failed:
            host = self.stream_host or "127.0.0.1"
            try:
                self._stream_server = StreamServer(host, self._served)
            except (OSError, ValueError) as exc:
                log.warning(
                    "stream server on %s could not start (%s): peers read this process through UCX", host, exc
                )
                self._stream_failed = True
        return self.stream_address

    def _served(self, key: bytes) -> Served | None:
        with self._lock:
            return None if self._closed else self._regions.served(key)

    def descriptor(self, regions: Sequence[RegionInfo] | None = None) -> dict[str, Any]:
        """``regions``: publish these instead of every registration (a view that shares this
        worker with other namespaces publishes only its own; hub.py)."""
        with self._lock:
            self._check_open()
            stream = self._ensure_stream_server()
            return PeerDescriptor(
                kind=self.kind,
                worker_address=self._worker.address,
                regions=self._regions.infos() if regions is None else tuple(regions),
                host=self._me.host,
                node=self._me.node,
                pid=self._me.pid,
                shm=self.shm,
                proof=self._proof.info,
                stream=stream,
            ).to_dict()

    # ------------------------------------------------------------------ consuming
    def peer_index(self, peer: Hashable) -> int:
        with self._lock:
            return self._peers.require(peer).index

    @property
    def peers(self) -> list[Hashable]:
        with self._lock:
            return self._peers.keys()

    def connect(self, peer: Hashable, descriptor: Mapping[str, Any]) -> int:
        d = PeerDescriptor.from_dict(descriptor)
        if d.kind != self.kind:
            raise TransportError(
                f"peer {peer!r}: descriptor kind {d.kind!r}, this transport is {self.kind!r}"
            )
        with self._lock:
            self._check_open()
            cur = self._peers.get(peer)
            index: int | None = None  # None: a new peer, a fresh index
            if cur is not None and cur.needs_new_endpoint(d):
                self._drop_peer(cur, recycle=False)  # a reconnect keeps the peer's index
                index, cur = cur.index, None
            fresh = cur is None
            if cur is None:
                cur = self._peers.add(peer, d, self._open_endpoint(peer, d), index)
                prev: PeerDescriptor | None = None
                prev_regions: tuple[RegionInfo, ...] = ()
            else:
                prev, prev_regions = cur.desc, cur.desc.regions
            try:
                cur.adopt(d, prev_regions)
            except BaseException:
                if fresh:  # a bad descriptor leaves nothing behind (no endpoint, no index)
                    self._drop_peer(cur)
                raise
            if (
                prev is not None
                and cur.direct is not None
                and (d.pid, d.proof, d.node, d.host) != (prev.pid, prev.proof, prev.node, prev.host)
            ):
                # Same endpoint, another claimed process: the old proof says nothing about it.
                self._same_host.forget(cur)
                cur.direct = None
            if cur.direct is None:
                self._same_host.probe(cur, enabled=self.direct, same_node=self._me.same_node(d))
                prev_regions = ()  # newly proven: map every region
            if cur.direct:
                self._same_host.map_regions(cur, prev_regions)
            self._peers.invalidate()
            return cur.index

    def exited(self, descriptor: Mapping[str, Any]) -> bool:
        return self._me.exited(descriptor)

    def _open_endpoint(self, peer: Hashable, d: PeerDescriptor) -> Any:
        # Error mode NONE only where shared memory can serve: PEER mode makes UCX drop
        # shared memory, NONE would hang on a dead tcp peer instead of failing.
        same_node = self._me.same_node(d)
        peer_mode = not (self.shm and d.shm and same_node)
        where = f"peer {peer!r} (host {d.host!r}, pid {d.pid}, {'tcp/PEER' if peer_mode else 'shm/NONE'})"
        if same_node and d.pid > 0 and not pid_alive(d.pid):
            # A process of this node (same pid namespace) that has exited is not dialled: UCX would
            # wait for its endpoint timeout, under this transport's lock, before saying so.
            raise PeerUnreachable(f"connecting to {where}: the process has exited")
        return open_endpoint(self._worker, d, peer_mode=peer_mode, timeout=self.connect_timeout, where=where)

    def _drop_peer(self, p: Peer, *, recycle: bool = True) -> None:
        self._same_host.forget(p)
        if p.desc.stream:
            self._stream_reader.forget(p.desc.stream)
        self._peers.remove(p, recycle=recycle)

    def disconnect(self, peer: Hashable) -> None:
        with self._lock:
            p = self._peers.get(peer)
            if p is not None:
                self._drop_peer(p)

    def prefault(self, peer: Hashable, spans: Sequence[tuple[int, int, int]]) -> None:
        with self._lock:
            p = None if self._closed else self._peers.get(peer)
            if p is not None and os.getpid() == self._me.pid:
                self._same_host.prefault(p, spans)

    def get(self, ops: np.ndarray, *, timeout: float | None = None) -> None:
        with self._lock:
            self._check_open()
            t = self._peers.snapshot()
            lt = self._regions.snapshot()
        # A forked child cannot use its parent's worker: it gets UCX's error, not a half-working plan.
        direct = bool(t.n_direct) and os.getpid() == self._me.pid
        if direct and self._same_host.replay(ops, t, lt):  # a steady pull's plan, checked before
            return
        o = check_ops(ops)
        if o is None:
            return
        rows = resolve_rows(t, o)
        if rows is None:
            return
        if direct:
            rows = self._same_host.serve(t, lt, rows, threads=self.copy_threads, ops=ops)
            if rows is None:
                return
        if self.stream and t.streams and os.getpid() == self._me.pid:
            deadline = None if timeout is None else time.monotonic() + timeout
            rows = _stream_rows(self._stream_reader, t, lt, rows, timeout)
            if rows is None:
                return
            if deadline is not None:  # one timeout for the whole get
                timeout = max(0.0, deadline - time.monotonic())
        self._ucx_reader.read(t, lt, rows, timeout=timeout, window=self.window)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in self._peers.values():
                self._drop_peer(p)
            self._regions.clear()
            self._proof.close()
            self._peers.invalidate()
            if self._stream_server is not None:
                self._stream_server.close()
            self._stream_reader.close()
            self._worker.close()

    def __del__(self) -> None:  # best effort; the native objects also clean up on their own
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

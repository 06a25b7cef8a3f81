"""UCX backend of :class:`~astate_store.transport.base.Transport` (one-sided ``ucp_get_nbx``).

Modes (what ``UcxTransport(mode=...)`` sets; an explicit ``UCX_TLS`` in the environment
always wins over the mode's transport list, and ``config=`` wins over everything):

``"shm"``
    ``UCX_TLS=sm,self``: sysv/posix for active messages, CMA (``process_vm_readv``)
    for the reads, ~17 GB/s here. Endpoints use error-handling mode NONE (PEER mode
    makes UCX drop shared memory). Same machine only. ``cma,self`` alone cannot
    connect ("Destination is unreachable").
``"tcp"``
    ``UCX_TLS=tcp,self`` plus ``UCX_TCP_TX_SEG_SIZE=1M UCX_TCP_RX_SEG_SIZE=1M`` (each
    unless already set in the environment; ~4-5x the default segment size's
    throughput here). RMA is emulated, so the publisher's worker must be progressed:
    the progress thread is on. Endpoints use PEER error handling: a dead peer gives an
    error, not a hang.
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
threads for plans over 64 MiB) instead of one ``ucp_get_nbx`` per row; UCX's CMA pays
~3.7 us per row, this ~1 us. ``connect`` probes it with a 1-byte read of the first host
region; a peer that refuses it (EPERM: ptrace restrictions such as
``/proc/sys/kernel/yama/ptrace_scope``, ENOSYS) stays on UCX. At ``get`` time EFAULT,
EPERM or ENOSYS send the whole plan through UCX instead; ESRCH (peer gone) raises
:class:`~astate_store.errors.PeerUnreachable`. A pidfd per peer, polled after the
reads, catches a peer that exited mid-plan (so a reused pid cannot supply the bytes).
Rows of CUDA / unknown-memory regions, or into registered non-host local memory, and
all rows of tcp / remote peers use UCX. ``timeout`` applies to the UCX part only.

The progress thread (default on in every mode) sleeps on the worker's event fd and
progresses the worker when something arrives; during ``get`` the calling thread
progresses instead.

Errors: UCX failures raise :class:`~astate_store.errors.TransportError` whose message
carries UCX's status text (``exc.status`` / ``exc.status_text`` hold the raw status);
a dead, unreachable or timed-out peer raises
:class:`~astate_store.errors.PeerUnreachable`.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Hashable, Literal, Mapping

import numpy as np

from ..errors import PeerUnreachable, TransportError
from ..process import pid_alive
from .base import OP_COLUMNS, PeerDescriptor, RegionInfo, Transport

__all__ = ["UcxTransport", "native", "MODES"]

Mode = Literal["shm", "tcp", "auto"]
MODES: tuple[str, ...] = ("shm", "tcp", "auto")

_MODE_TLS = {"shm": "sm,self", "tcp": "tcp,self", "auto": "sm,tcp,self"}
_MODE_TLS_CUDA = {"shm": ",cuda_copy,cuda_ipc", "tcp": ",cuda_copy", "auto": ",cuda_copy,cuda_ipc"}
_TCP_TUNING = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}
_NO_MEMH = np.uint64(2**64 - 1)
_SPLIT_BYTES = 64 << 20  # direct path: plans above this use copy_threads threads
_DIRECT_FALLBACK = (errno.EFAULT, errno.EPERM, errno.ENOSYS)  # -> run the plan through UCX

_native_mod: Any = None
_native_lock = threading.Lock()


def native() -> Any:
    """The ``astate_store._ucx`` extension, loaded after ``libucx.load_library()``.

    ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` makes the loader prefer a system UCX.
    """
    global _native_mod
    if _native_mod is None:
        with _native_lock:
            if _native_mod is None:
                try:
                    import libucx

                    libucx.load_library()
                except ImportError:  # a system UCX found through the rpath / ld.so
                    pass
                try:
                    from .. import _ucx
                except ImportError as exc:
                    raise TransportError(
                        f"the UCX extension astate_store._ucx is not built or cannot load: {exc} "
                        "(build it with `pip install --no-build-isolation -e .`)"
                    ) from exc
                _native_mod = _ucx
    return _native_mod


# --------------------------------------------------------------------------- helpers


def _node_id() -> str:
    """Equal for processes that can share memory (same kernel boot, pid/ipc/mnt namespaces)."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append(socket.gethostname())
    for ns in ("pid", "ipc", "mnt"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("?")
    return "/".join(parts)


def _cuda_present() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing or broken CUDA setup
        return False


def _tls_has_shm(tls: str) -> bool:
    toks = [t.strip().lower().lstrip("\\") for t in tls.split(",") if t.strip()]
    if not toks:
        return False
    if toks[0].startswith("^"):
        toks[0] = toks[0][1:]
        return not ({"sm", "shm", "cma"} & set(toks))
    return bool({"sm", "shm", "cma", "all"} & set(toks))


def _is_peer_status(nat: Any, status: int) -> bool:
    if status in (
        nat.ERR_UNREACHABLE,
        nat.ERR_CONNECTION_RESET,
        nat.ERR_TIMED_OUT,
        nat.ERR_REJECTED,
        nat.ERR_NOT_CONNECTED,
        nat.ERR_CANCELED,
        nat.ERR_ENDPOINT_TIMEOUT,
    ):
        return True
    return (nat.ERR_LAST_ENDPOINT_FAILURE <= status <= nat.ERR_FIRST_ENDPOINT_FAILURE) or (
        nat.ERR_LAST_LINK_FAILURE <= status <= nat.ERR_FIRST_LINK_FAILURE
    )


def _typed(exc: BaseException, message: str, *, peer_gone: bool = False) -> TransportError:
    nat = native()
    status = int(getattr(exc, "status", 0) or 0)
    cls = PeerUnreachable if (peer_gone or (status and _is_peer_status(nat, status))) else TransportError
    err = cls(f"{message}: {exc}")
    err.status = status  # type: ignore[attr-defined]
    err.status_text = getattr(exc, "status_text", None)  # type: ignore[attr-defined]
    return err


def _cut_rows(cp: np.ndarray, cap: int) -> np.ndarray:
    """Direct-path rows (pid, remote, local, length) with every row over ``cap`` bytes cut into pieces."""
    length = cp[:, 3]
    pieces = (length + np.uint64(cap - 1)) // np.uint64(cap)
    out = np.repeat(cp, pieces.astype(np.int64), axis=0)
    start = np.cumsum(pieces) - pieces  # first piece of each row in `out`
    k = np.arange(out.shape[0], dtype=np.uint64) - np.repeat(start, pieces.astype(np.int64))
    shift = k * np.uint64(cap)
    out[:, 1] += shift
    out[:, 2] += shift
    out[:, 3] = np.minimum(out[:, 3] - shift, np.uint64(cap))
    return out


# --------------------------------------------------------------------------- state records


@dataclass
class _LocalRegion:
    info: RegionInfo
    memh: Any = None  # _ucx.MemHandle or None (freed / empty)
    keepalive: Any = None  # torch storage kept alive while registered
    memory_type: str = "host"


@dataclass
class _Peer:
    key: Hashable
    index: int
    desc: PeerDescriptor
    ep: Any
    rkeys: list[Any] = field(default_factory=list)  # per region: RemoteKey or None
    direct: bool | None = None  # process_vm_readv path: None = not probed yet, False = UCX only
    pidfd: int = -1  # pidfd of desc.pid while direct


@dataclass(frozen=True)
class _Tables:
    """Snapshot of the connected peers, flattened for vectorized plan translation."""

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


@dataclass(frozen=True)
class _LocalTables:
    base: np.ndarray  # uint64, sorted
    end: np.ndarray  # uint64
    memhs: list[Any]
    device: np.ndarray  # bool: not host memory (never a process_vm_readv destination)


# --------------------------------------------------------------------------- transport


class UcxTransport(Transport):
    """UCX one-sided transport. See the module docstring for what each mode sets.

    Parameters
    ----------
    mode: ``"shm"``, ``"tcp"`` or ``"auto"``.
    progress_thread: run a background progress thread (default: on).
    config: extra UCX settings (``{"TLS": ..., "NET_DEVICES": ...}``, with or without
        the ``UCX_`` prefix); applied last, over the environment and the mode defaults.
    window: most outstanding reads per ``get``.
    connect_timeout: seconds ``connect`` waits for a new endpoint to come up (flush).
    direct: same-host ``process_vm_readv`` fast path (default: on unless the environment
        has ``ASTATE_SHM_DIRECT=0``).
    copy_threads: threads of the fast path for plans over 64 MiB.
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
        copy_threads: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        nat = native()
        self.mode = mode
        self.window = int(window)
        self.connect_timeout = float(connect_timeout)
        if direct is None:
            direct = os.environ.get("ASTATE_SHM_DIRECT", "1").strip().lower() not in ("0", "false", "no", "off")
        self.direct = bool(direct)
        self.copy_threads = max(1, int(copy_threads))
        self._pidpoll = select.poll()  # pidfds of direct peers (readable once exited)
        self._pidfd_keys: dict[int, Hashable] = {}
        self._poll_lock = threading.Lock()  # one poll() at a time (select.poll's rule)
        self.config = self._effective_config(mode, config)
        tls = self.config.get("TLS") or os.environ.get("UCX_TLS", "")
        self.tls = tls
        self.shm = _tls_has_shm(tls)
        self._lock = threading.RLock()
        self._host = socket.gethostname()
        self._node = _node_id()
        self._pid = os.getpid()
        try:
            self._worker = nat.Worker(
                self.config, progress_thread=True if progress_thread is None else bool(progress_thread)
            )
        except nat.UcxError as exc:
            raise _typed(exc, f"UCX init failed (mode={mode}, UCX_TLS={tls!r})") from exc
        self._regions: list[_LocalRegion] = []
        self._by_range: dict[tuple[int, int], int] = {}
        self._peers: dict[Hashable, _Peer] = {}
        self._next_peer = 0
        self._tables: _Tables | None = None
        self._local: _LocalTables | None = None
        self._closed = False

    @staticmethod
    def _effective_config(mode: str, config: Mapping[str, str] | None) -> dict[str, str]:
        cfg: dict[str, str] = {}
        if not os.environ.get("UCX_TLS"):
            cfg["TLS"] = _MODE_TLS[mode] + (_MODE_TLS_CUDA[mode] if _cuda_present() else "")
        tls = cfg.get("TLS") or os.environ.get("UCX_TLS", "")
        if mode in ("tcp", "auto") or "tcp" in tls:
            for k, v in _TCP_TUNING.items():
                if f"UCX_{k}" not in os.environ:
                    cfg[k] = v
        for k, v in (config or {}).items():
            k = str(k)
            cfg[k[4:] if k.startswith("UCX_") else k] = str(v)
        return cfg

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

    def endpoint_info(self, peer: Hashable) -> str:
        """UCX's description of the lanes the endpoint to ``peer`` uses."""
        with self._lock:
            p = self._peer(peer)
        return p.ep.info()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    # ------------------------------------------------------------------ publishing
    def register(self, address: int, nbytes: int, *, memory_type: str = "host") -> int:
        return self._register(int(address), int(nbytes), memory_type, None)

    def register_tensor(self, tensor: Any) -> int:
        storage = tensor.untyped_storage()
        dev = tensor.device.type
        mtype = "cuda" if dev == "cuda" else ("host" if dev == "cpu" else "unknown")
        return self._register(int(storage.data_ptr()), int(storage.nbytes()), mtype, storage)

    def _register(self, address: int, nbytes: int, memory_type: str, keepalive: Any) -> int:
        if address < 0 or nbytes < 0:
            raise TransportError(f"bad region address=0x{address:x} nbytes={nbytes}")
        nat = native()
        mt = {
            "host": nat.MEMORY_TYPE_HOST,
            "cuda": nat.MEMORY_TYPE_CUDA,
            "unknown": nat.MEMORY_TYPE_UNKNOWN,
        }.get(memory_type)
        if mt is None:
            raise ValueError(f"memory_type must be 'host', 'cuda' or 'unknown', got {memory_type!r}")
        with self._lock:
            self._check_open()
            key = (address, nbytes)
            idx = self._by_range.get(key)
            if idx is not None:
                reg = self._regions[idx]
                if keepalive is not None and reg.keepalive is None:
                    reg.keepalive = keepalive
                return idx
            memh = None
            rkey = b""
            if nbytes > 0:
                if address == 0:
                    raise TransportError(f"cannot register {nbytes} bytes at address 0")
                try:
                    memh = self._worker.mem_map(address, nbytes, mt)
                except nat.UcxError as exc:
                    raise _typed(exc, f"registering {nbytes} bytes at 0x{address:x} ({memory_type})") from exc
                rkey = memh.rkey()
            idx = len(self._regions)
            info = RegionInfo(address, nbytes, rkey, memory_type)
            self._regions.append(_LocalRegion(info, memh, keepalive, memory_type))
            self._by_range[key] = idx
            self._local = None
            return idx

    def unregister(self, region: int) -> None:
        with self._lock:
            self._check_open()
            if not 0 <= region < len(self._regions):
                raise TransportError(f"no region {region} (have {len(self._regions)})")
            reg = self._regions[region]
            if reg.memh is None and reg.info.size == 0 and reg.keepalive is None:
                return
            key = (reg.info.base, reg.info.size)
            if self._by_range.get(key) == region:
                del self._by_range[key]
            if reg.memh is not None:
                reg.memh.unmap()
            self._regions[region] = _LocalRegion(RegionInfo(reg.info.base, 0, b""))
            self._local = None

    def region(self, region: int) -> RegionInfo:
        with self._lock:
            return self._regions[region].info

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    def descriptor(self) -> dict[str, Any]:
        with self._lock:
            self._check_open()
            return PeerDescriptor(
                kind=self.kind,
                worker_address=self._worker.address,
                regions=tuple(r.info for r in self._regions),
                host=self._host,
                node=self._node,
                pid=self._pid,
                shm=self.shm,
            ).to_dict()

    # ------------------------------------------------------------------ consuming
    def _peer(self, peer: Hashable) -> _Peer:
        try:
            return self._peers[peer]
        except KeyError:
            raise KeyError(f"peer {peer!r} is not connected") from None

    def peer_index(self, peer: Hashable) -> int:
        with self._lock:
            return self._peer(peer).index

    @property
    def peers(self) -> list[Hashable]:
        with self._lock:
            return list(self._peers)

    def _same_node(self, d: PeerDescriptor) -> bool:
        if d.node and self._node:
            return d.node == self._node
        return bool(d.host) and d.host == self._host

    def connect(self, peer: Hashable, descriptor: Mapping[str, Any]) -> int:
        d = PeerDescriptor.from_dict(descriptor)
        if d.kind != self.kind:
            raise TransportError(f"peer {peer!r}: descriptor kind {d.kind!r}, this transport is {self.kind!r}")
        nat = native()
        with self._lock:
            self._check_open()
            old = self._peers.get(peer)
            if old is not None and (old.desc.worker_address != d.worker_address or old.ep.failed or old.ep.closed):
                self._drop_peer(old)
                index = old.index
                old = None
            else:
                index = old.index if old is not None else self._next_peer
            if old is None:
                use_peer_mode = not (self.shm and d.shm and self._same_node(d))
                where = f"peer {peer!r} (host {d.host!r}, pid {d.pid}, {'tcp/PEER' if use_peer_mode else 'shm/NONE'})"
                try:
                    ep = self._worker.connect(d.worker_address, peer_error_handling=use_peer_mode)
                except nat.UcxError as exc:
                    raise _typed(exc, f"connecting to {where}", peer_gone=True) from exc
                try:
                    ep.flush(self.connect_timeout)
                except nat.UcxError as exc:
                    ep.close()
                    raise _typed(exc, f"connecting to {where}", peer_gone=True) from exc
                cur = _Peer(peer, index, d, ep)
                if index == self._next_peer:
                    self._next_peer += 1
                self._peers[peer] = cur
                prev_regions: tuple[RegionInfo, ...] = ()
            else:
                cur = old
                prev_regions = old.desc.regions
            # (re)unpack regions whose (base, size, rkey) changed
            new_rkeys: list[Any] = []
            try:
                for i, r in enumerate(d.regions):
                    if i < len(prev_regions) and prev_regions[i] == r and i < len(cur.rkeys):
                        new_rkeys.append(cur.rkeys[i])
                        continue
                    new_rkeys.append(cur.ep.unpack_rkey(r.rkey) if r.size > 0 and r.rkey else None)
            except nat.UcxError as exc:
                for rk in new_rkeys:
                    if rk is not None and rk not in cur.rkeys:
                        rk.destroy()
                raise _typed(exc, f"unpacking rkeys of peer {peer!r}") from exc
            kept = {id(rk) for rk in new_rkeys if rk is not None}
            for rk in cur.rkeys:
                if rk is not None and id(rk) not in kept:
                    rk.destroy()
            cur.rkeys = new_rkeys
            cur.desc = d
            if cur.direct is None:
                self._probe_direct(cur)
            self._tables = None
            return cur.index

    def _probe_direct(self, p: _Peer) -> None:
        """Decide the process_vm_readv path for ``p``: one 1-byte read of its first host region."""
        d = p.desc
        if not (self.direct and d.pid > 0 and not p.ep.peer_error_handling and self._same_node(d)):
            p.direct = False
            return
        r = next((r for r in d.regions if r.size > 0 and r.memory_type == "host"), None)
        if r is None:
            return  # nothing to probe yet: decided on a later connect
        byte = np.zeros(1, dtype=np.uint8)
        try:
            native().cma_read(np.array([[d.pid, r.base, byte.ctypes.data, 1]], dtype=np.uint64))
            fd = os.pidfd_open(d.pid)
        except (OSError, AttributeError):  # EPERM (ptrace rules), ENOSYS, ESRCH, no pidfd_open
            p.direct = False
            return
        p.direct, p.pidfd = True, fd
        with self._poll_lock:
            self._pidfd_keys[fd] = p.key
            self._pidpoll.register(fd, select.POLLIN)

    def _direct_off(self, p: _Peer) -> None:
        p.direct = False
        if p.pidfd >= 0:
            with self._poll_lock:
                self._pidpoll.unregister(p.pidfd)
                self._pidfd_keys.pop(p.pidfd, None)
                os.close(p.pidfd)
            p.pidfd = -1
        self._tables = None

    def _drop_peer(self, p: _Peer) -> None:
        for rk in p.rkeys:
            if rk is not None:
                rk.destroy()
        p.rkeys = []
        self._direct_off(p)
        p.ep.close()
        self._peers.pop(p.key, None)
        self._tables = None

    def disconnect(self, peer: Hashable) -> None:
        with self._lock:
            p = self._peers.get(peer)
            if p is not None:
                self._drop_peer(p)

    def _snapshot(self) -> _Tables:
        t = self._tables
        if t is not None:
            return t
        n = self._next_peer
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
            for r, rk in zip(p.desc.regions, p.rkeys):
                base.append(r.base)
                size.append(r.size if rk is not None else 0)
                direct.append(bool(p.direct) and r.memory_type == "host")
                if rk is None:
                    rkey_pos.append(-1)
                else:
                    rkey_pos.append(len(rkeys))
                    rkeys.append(rk)
        t = _Tables(
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
        )
        self._tables = t
        return t

    def _local_snapshot(self) -> _LocalTables:
        t = self._local
        if t is not None:
            return t
        live = sorted(
            ((r.info.base, r.info.size, r.memh, r.memory_type) for r in self._regions if r.memh is not None),
            key=lambda x: x[0],
        )
        t = _LocalTables(
            np.array([x[0] for x in live], dtype=np.uint64),
            np.array([x[0] + x[1] for x in live], dtype=np.uint64),
            [x[2] for x in live],
            np.array([x[3] != "host" for x in live], dtype=bool),
        )
        self._local = t
        return t

    def get(self, ops: np.ndarray, *, timeout: float | None = None) -> None:
        ops = np.asarray(ops)
        if ops.ndim != 2 or ops.shape[1] != OP_COLUMNS or ops.dtype.kind not in "iu":
            raise TransportError(
                f"ops must be an integer array of shape (n, {OP_COLUMNS}), got {ops.dtype} {ops.shape}"
            )
        if ops.shape[0] == 0:
            return
        if ops.dtype.kind == "i" and (ops < 0).any():
            row = int(np.argmax((ops < 0).any(axis=1)))
            raise TransportError(f"op {row}: negative value in {ops[row].tolist()}")
        o = ops.astype(np.uint64, copy=False)
        with self._lock:
            self._check_open()
            t = self._snapshot()
            lt = self._local_snapshot()
        length = o[:, 4]
        if not length.all():  # zero-length rows move nothing: drop them
            o = o[length != 0]
            if o.shape[0] == 0:
                return
            length = o[:, 4]
        pidx = o[:, 0]
        npeer = np.uint64(len(t.ep_pos))
        bad = pidx >= npeer
        if not bad.any():
            ep_pos = t.ep_pos[pidx]
            bad = ep_pos < 0
        if bad.any():
            i = int(np.argmax(bad))
            raise TransportError(f"op {i}: peer index {int(pidx[i])} is not connected")
        ridx = o[:, 1]
        bad = ridx >= t.reg_n[pidx]
        if bad.any():
            i = int(np.argmax(bad))
            p = int(pidx[i])
            raise TransportError(
                f"op {i}: peer {t.keys[p]!r} has no region {int(ridx[i])} ({int(t.reg_n[p])} regions)"
            )
        flat = t.reg_off[pidx] + ridx
        size = t.size[flat]
        off = o[:, 2]
        with np.errstate(over="ignore"):
            bad = (off > size) | (length > size - off)
        if bad.any():
            i = int(np.argmax(bad))
            p, r = int(pidx[i]), int(ridx[i])
            raise TransportError(
                f"op {i}: read [{int(off[i])}, +{int(length[i])}) is out of bounds of peer {t.keys[p]!r} "
                f"region {r} (size {int(size[i])}{', unregistered' if t.rkey_pos[flat[i]] < 0 else ''})"
            )
        local = o[:, 3]
        if (local == 0).any():
            i = int(np.argmax(local == 0))
            raise TransportError(f"op {i}: null local address")
        remote = t.base[flat] + off
        if t.n_direct and os.getpid() == self._pid:  # (a forked child gets UCX's error)
            dmask = t.direct[flat]
            if lt.device.any():  # into registered non-host local memory: UCX
                j, inside = self._local_region(lt, local, length)
                dmask &= ~(inside & lt.device[j])
            nd = int(np.count_nonzero(dmask))
            if nd == o.shape[0]:
                if self._get_direct(t, pidx, remote, local, length):
                    return
            elif nd:
                if self._get_direct(t, pidx[dmask], remote[dmask], local[dmask], length[dmask]):
                    keep = ~dmask
                    ep_pos, flat, remote, local, length = ep_pos[keep], flat[keep], remote[keep], local[keep], length[keep]
        self._get_ucx(t, lt, ep_pos, t.rkey_pos[flat], remote, local, length, timeout)

    @staticmethod
    def _local_region(lt: _LocalTables, local: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row: index of the registered local region holding [local, +length), and whether one does."""
        j = np.searchsorted(lt.base, local, side="right").astype(np.int64) - 1
        jj = np.maximum(j, 0)
        return jj, (j >= 0) & (local + length <= lt.end[jj])

    def _get_direct(
        self, t: _Tables, pidx: np.ndarray, remote: np.ndarray, local: np.ndarray, length: np.ndarray
    ) -> bool:
        """Rows of direct peers via process_vm_readv. False: fall back to UCX for the whole plan."""
        nat = native()
        cp = np.empty((pidx.shape[0], 4), dtype=np.uint64)
        cp[:, 0] = t.pid[pidx]
        cp[:, 1] = remote
        cp[:, 2] = local
        cp[:, 3] = length
        if t.n_direct > 1 and (cp[:, 0] != cp[0, 0]).any():  # group by peer: full batches
            cp = cp[np.argsort(cp[:, 0], kind="stable")]
        if self.copy_threads > 1:  # threads split at row boundaries: cut rows too big to balance
            total = int(length.sum())
            cap = max(total // (4 * self.copy_threads), 1 << 20)
            if total > _SPLIT_BYTES and int(length.max()) > cap:
                cp = _cut_rows(cp, cap)
        try:
            nat.cma_read(cp, threads=self.copy_threads, split_bytes=_SPLIT_BYTES)
        except OSError as exc:
            pid = int(getattr(exc, "pid", 0))
            key = t.keys[int(np.argmax(t.pid == np.uint64(pid)))] if pid else None
            if exc.errno in _DIRECT_FALLBACK:
                if exc.errno != errno.EFAULT:  # refused for good: this peer stays on UCX
                    with self._lock:
                        p = self._peers.get(key)
                        if p is not None and p.desc.pid == pid:
                            self._direct_off(p)
                return False
            raise self._direct_error(exc, key, pid, exc.strerror or str(exc), gone=exc.errno == errno.ESRCH) from exc
        with self._poll_lock:  # a peer that exited meanwhile: its pid may be reused, bytes suspect
            exited = [self._pidfd_keys.get(fd) for fd, _ in self._pidpoll.poll(0)]
        for key in exited:
            with self._lock:
                p = self._peers.get(key) if key is not None else None
            if p is not None and (cp[:, 0] == np.uint64(p.desc.pid)).any():
                raise self._direct_error(None, key, p.desc.pid, "process exited during the read", gone=True)
        return True

    def _direct_error(self, exc: OSError | None, key: Hashable, pid: int, text: str, *, gone: bool) -> TransportError:
        err = (PeerUnreachable if gone else TransportError)(
            f"reading from peer {key!r} (pid {pid} on {self._host}) with process_vm_readv: {text}"
        )
        err.status = 0  # type: ignore[attr-defined]
        err.status_text = text  # type: ignore[attr-defined]
        err.errno = exc.errno if exc is not None else errno.ESRCH  # type: ignore[attr-defined]
        return err

    def _get_ucx(
        self,
        t: _Tables,
        lt: _LocalTables,
        ep_pos: np.ndarray,
        rkey_pos: np.ndarray,
        remote: np.ndarray,
        local: np.ndarray,
        length: np.ndarray,
        timeout: float | None,
    ) -> None:
        nat = native()
        ncol = 6 if len(lt.memhs) else 5
        plan = np.empty((ep_pos.shape[0], ncol), dtype=np.uint64)
        plan[:, 0] = ep_pos
        plan[:, 1] = rkey_pos
        plan[:, 2] = remote
        plan[:, 3] = local
        plan[:, 4] = length
        if ncol == 6:
            jj, inside = self._local_region(lt, local, length)
            plan[:, 5] = np.where(inside, jj.astype(np.uint64), _NO_MEMH)
        try:
            self._worker.get(
                plan,
                t.eps,
                t.rkeys,
                lt.memhs if ncol == 6 else None,
                -1.0 if timeout is None else max(0.0, float(timeout)),
                self.window,
            )
        except nat.UcxError as exc:
            raise self._get_error(exc, t, plan) from exc

    def _get_error(self, exc: BaseException, t: _Tables, plan: np.ndarray) -> TransportError:
        ep_i = getattr(exc, "endpoint", None)
        status = int(getattr(exc, "status", 0) or 0)
        if ep_i is None and status == native().ERR_TIMED_OUT:
            return _typed(exc, f"reading {plan.shape[0]} ops", peer_gone=True)
        if ep_i is None:
            return _typed(exc, f"reading {plan.shape[0]} ops")
        ep = t.eps[int(ep_i)]
        pi = int(np.argmax(t.ep_pos == int(ep_i)))
        key = t.keys[pi]
        with self._lock:
            p = self._peers.get(key)
        gone = bool(ep.failed)
        if p is not None and p.desc.pid and self._same_node(p.desc) and not pid_alive(p.desc.pid):
            gone = True
        who = f"peer {key!r}" + (f" (pid {p.desc.pid} on {p.desc.host})" if p is not None else "")
        if ep.failed and ep.error and ep.error not in str(exc):
            return _typed(exc, f"reading from {who} [endpoint failed: {ep.error}]", peer_gone=gone)
        return _typed(exc, f"reading from {who}", peer_gone=gone)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in list(self._peers.values()):
                self._drop_peer(p)
            for r in self._regions:
                if r.memh is not None:
                    r.memh.unmap()
            self._regions = []
            self._by_range.clear()
            self._tables = None
            self._local = None
            self._worker.close()

    def __del__(self) -> None:  # best effort; the native objects also clean up on their own
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

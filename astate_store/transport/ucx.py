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

The progress thread (default on in every mode) sleeps on the worker's event fd and
progresses the worker when something arrives; during ``get`` the calling thread
progresses instead.

Errors: UCX failures raise :class:`~astate_store.errors.TransportError` whose message
carries UCX's status text (``exc.status`` / ``exc.status_text`` hold the raw status);
a dead, unreachable or timed-out peer raises
:class:`~astate_store.errors.PeerUnreachable`.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Hashable, Literal, Mapping

import numpy as np

from ..errors import PeerUnreachable, TransportError
from .base import OP_COLUMNS, PeerDescriptor, RegionInfo, Transport

__all__ = ["UcxTransport", "native", "MODES"]

Mode = Literal["shm", "tcp", "auto"]
MODES: tuple[str, ...] = ("shm", "tcp", "auto")

_MODE_TLS = {"shm": "sm,self", "tcp": "tcp,self", "auto": "sm,tcp,self"}
_MODE_TLS_CUDA = {"shm": ",cuda_copy,cuda_ipc", "tcp": ",cuda_copy", "auto": ",cuda_copy,cuda_ipc"}
_TCP_TUNING = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}
_NO_MEMH = np.uint64(2**64 - 1)

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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _typed(exc: BaseException, message: str, *, peer_gone: bool = False) -> TransportError:
    nat = native()
    status = int(getattr(exc, "status", 0) or 0)
    cls = PeerUnreachable if (peer_gone or (status and _is_peer_status(nat, status))) else TransportError
    err = cls(f"{message}: {exc}")
    err.status = status  # type: ignore[attr-defined]
    err.status_text = getattr(exc, "status_text", None)  # type: ignore[attr-defined]
    return err


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


@dataclass(frozen=True)
class _LocalTables:
    base: np.ndarray  # uint64, sorted
    end: np.ndarray  # uint64
    memhs: list[Any]


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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        nat = native()
        self.mode = mode
        self.window = int(window)
        self.connect_timeout = float(connect_timeout)
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
            self._regions.append(_LocalRegion(RegionInfo(address, nbytes, rkey), memh, keepalive, memory_type))
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
            self._tables = None
            return cur.index

    def _drop_peer(self, p: _Peer) -> None:
        for rk in p.rkeys:
            if rk is not None:
                rk.destroy()
        p.rkeys = []
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
        for p in self._peers.values():
            ep_pos[p.index] = len(eps)
            eps.append(p.ep)
            keys[p.index] = p.key
            reg_off[p.index] = len(base)
            reg_n[p.index] = len(p.desc.regions)
            for r, rk in zip(p.desc.regions, p.rkeys):
                base.append(r.base)
                size.append(r.size if rk is not None else 0)
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
        )
        self._tables = t
        return t

    def _local_snapshot(self) -> _LocalTables:
        t = self._local
        if t is not None:
            return t
        live = sorted(
            ((r.info.base, r.info.size, r.memh) for r in self._regions if r.memh is not None),
            key=lambda x: x[0],
        )
        t = _LocalTables(
            np.array([b for b, _, _ in live], dtype=np.uint64),
            np.array([b + s for b, s, _ in live], dtype=np.uint64),
            [m for _, _, m in live],
        )
        self._local = t
        return t

    def get(self, ops: np.ndarray, *, timeout: float | None = None) -> None:
        nat = native()
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
        ncol = 6 if len(lt.memhs) else 5
        plan = np.empty((o.shape[0], ncol), dtype=np.uint64)
        plan[:, 0] = ep_pos
        plan[:, 1] = t.rkey_pos[flat]
        plan[:, 2] = t.base[flat] + off
        plan[:, 3] = local
        plan[:, 4] = length
        if ncol == 6:
            j = np.searchsorted(lt.base, local, side="right").astype(np.int64) - 1
            jj = np.maximum(j, 0)
            inside = (j >= 0) & (local + length <= lt.end[jj])
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
        if p is not None and p.desc.pid and self._same_node(p.desc) and not _pid_alive(p.desc.pid):
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

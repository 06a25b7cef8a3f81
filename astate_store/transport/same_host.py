"""The same-host fast paths: a peer's host regions read with batched ``process_vm_readv``,
or copied with ``memcpy`` from the peer's memfd mapped here.

UCX's CMA transport pays a request and a syscall per row (one ``ucp_get_nbx`` each); the
extension's ``cma_read`` batches up to 1024 rows per syscall with the GIL released.
A region backed by a sealed memfd (a publisher's snapshot staging) is mapped once the
peer is proven and ``memfd.map_peer_region``'s checks pass; its rows are then the
extension's ``copy_rows`` (GIL released; threads take chunks in turn; streaming stores
for large copies): no syscall per row.

Rules (the module docstring of ``ucx.py`` has the user-facing summary):

* Who: a peer on this node (:meth:`ProcessIdentity.same_node`) whose endpoint uses
  error mode NONE (shared memory), when the path is enabled, and only once the pid its
  descriptor claims is *proven* to be the process behind its UCX endpoint: descriptors
  come from etcd, and whoever can write there could otherwise point this process's
  ``process_vm_readv`` at any process it may ptrace. The proof (:class:`Proof`): every
  transport registers a small buffer holding a random nonce and lists it in its
  descriptor; ``connect`` reads it once through UCX (the endpoint reaches the worker at
  the descriptor's address, and that worker's registered memory) and once with
  ``process_vm_readv`` from the claimed pid at the same address, with a pidfd of the
  pid opened before both reads and checked after them. Only equal, nonce-like bytes, in
  private anonymous memory of that pid (``/proc/<pid>/maps``: not constant data anyone
  could predict), enable the path; anything else (no proof, a mismatch, a refusal such
  as EPERM from ptrace rules, ENOSYS, no ``pidfd_open``) keeps the peer on UCX for good,
  logged. What this proves: the pid holds, at the proof's address, the bytes the UCX
  endpoint's worker serves there, i.e. it is that worker's process (or a fork of it).
* What: rows of host regions, into local memory that is not registered non-host
  memory. Everything else goes through UCX.
* Failures at ``get`` time: EFAULT, EPERM or ENOSYS send the whole plan through UCX
  (EPERM/ENOSYS also take the peer off this path); ESRCH raises PeerUnreachable.
* A pid can be reused: a pidfd per peer, polled after the reads, catches a peer that
  exited mid-plan (its bytes could have come from another process).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import select
import socket
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from astate_store.errors import PeerUnreachable, TransportError
from astate_store.model.spans import span_runs
from astate_store.transport import memfd
from astate_store.transport.base import PeerDescriptor, RegionInfo
from astate_store.transport.binding import copy_rows, native, typed_error
from astate_store.transport.peers import Peer, PeerSnapshot, PeerTable
from astate_store.transport.regions import LocalSnapshot
from astate_store.transport.replays import Replay, Replays
from astate_store.transport.rows import Rows
from astate_store.transport.vmas import MapsReader

__all__ = ["Proof", "ProcessIdentity", "SameHostReader", "node_id"]

log = logging.getLogger("astate_store")

NONCE_BYTES = 32
_MIN_DISTINCT = 12  # 32 random bytes have ~30 distinct values; < 12 happens with odds ~1e-20

_SPLIT_BYTES = 64 << 20  # plans above this use the copy threads
_FALLBACK = (errno.EFAULT, errno.EPERM, errno.ENOSYS)  # -> run the plan through UCX
_REFUSED = (errno.EPERM, errno.ENOSYS)  # -> and keep this peer on UCX from now on


def node_id() -> str:
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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace still runs (an exited one, zombie or
    gone, does not; one we may not signal does)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split(None, 1)[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
    return state not in (b"Z", b"X", b"x")


@dataclass(frozen=True)
class ProcessIdentity:
    """Where this process runs, as a descriptor names it (``host``, ``node``, ``pid``)."""

    host: str
    node: str
    pid: int

    @classmethod
    def current(cls) -> ProcessIdentity:
        return cls(socket.gethostname(), node_id(), os.getpid())

    def same_node(self, d: PeerDescriptor) -> bool:
        """Whether ``d``'s process can share memory with this one (node ids, else host names)."""
        if d.node and self.node:
            return d.node == self.node
        return bool(d.host) and d.host == self.host

    def exited(self, descriptor: Mapping[str, Any]) -> bool:
        """Whether a descriptor's process runs on this node and has exited (``Transport.exited``).
        Only the fields that say where it runs are read: a bad descriptor is connect's to report."""
        pid, host, node = descriptor.get("pid"), descriptor.get("host"), descriptor.get("node")
        if type(pid) is not int or pid <= 0 or not isinstance(host, str) or not isinstance(node, str):
            return False
        where = PeerDescriptor(kind="", worker_address=b"", regions=(), host=host, node=node, pid=pid)
        return self.same_node(where) and not pid_alive(pid)


class Proof:
    """This transport's proof region: a page of its own holding a random nonce, registered
    with the worker (only this region: the page holds nothing else, so its registration
    exposes nothing). Its ``info`` goes into the descriptor (``PeerDescriptor.proof``)."""

    def __init__(self, worker: Any) -> None:
        self._page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned
        self._page.write(os.urandom(NONCE_BYTES))
        self._view = np.frombuffer(self._page, dtype=np.uint8)
        address = int(self._view.ctypes.data)
        nat = native()
        try:
            self._memh = worker.mem_map(address, NONCE_BYTES, nat.MEMORY_TYPE_HOST)
        except nat.UcxError as exc:
            raise typed_error(exc, "registering the proof region") from exc
        self.info = RegionInfo(address, NONCE_BYTES, self._memh.rkey())

    def close(self) -> None:
        """Unmap the registration (the page itself goes with this object)."""
        self._memh.unmap()


def _nonce_like(b: np.ndarray) -> bool:
    # bincount, not np.unique: the first np.unique imports numpy submodules lazily (paid in
    # every consumer's first step)
    return b.size >= 16 and int(np.count_nonzero(np.bincount(b, minlength=256))) >= min(
        _MIN_DISTINCT, b.size // 2
    )


def _anonymous_at(pid: int, address: int) -> bool:
    """Whether ``address`` lies in a private anonymous mapping of ``pid`` (as a proof page
    does). Rules out bytes anyone could predict at a known address of another process,
    such as a shared library's constant data when address randomization is off."""
    try:
        with MapsReader(pid) as maps:
            v = maps.at(address)
    except (OSError, ValueError, IndexError):
        return False
    return v is not None and v.readable and v.writable and v.private and v.inode == 0 and not v.name


def _cut_rows(cp: np.ndarray, cap: int) -> np.ndarray:
    """Rows (pid, remote, local, length) with every row over ``cap`` bytes cut into pieces.

    The copy threads split a batch at row boundaries; one huge row would leave the
    other threads idle.
    """
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


class SameHostReader:
    """Decides and runs the ``process_vm_readv`` path; owns the peers' pidfds.

    ``lock`` is the transport's lock, taken around every change to a :class:`Peer`
    (``probe``/``forget`` are called with it held, ``serve`` takes it itself: the
    reads run without it).
    """

    def __init__(
        self, peers: PeerTable, lock: threading.RLock, host: str, worker: Any = None, timeout: float = 10.0
    ) -> None:
        self._peers = peers
        self._lock = lock
        self._host = host
        self._worker = worker  # reads the proof through UCX
        self._timeout = timeout
        self._pidpoll = select.poll()  # pidfds of direct peers (readable once exited)
        self._pidfd_keys: dict[int, Hashable] = {}
        # the last peer proven per (worker address, pid, node, proof region): see _proven_again
        self._proven: dict[tuple, Peer] = {}
        self._poll_lock = threading.Lock()  # one poll() at a time (select.poll's rule)
        self._replays = Replays()  # steady gets' checked copy plans (replays.py)

    @property
    def pidfds(self) -> int:
        """Open pidfds (one per peer on this path)."""
        return len(self._pidfd_keys)

    def probe(self, p: Peer, *, enabled: bool, same_node: bool) -> None:
        """Decide the path for ``p``: the pid its descriptor claims must prove to be the
        process behind its endpoint (the module docstring); else UCX only."""
        d = p.desc
        if not (enabled and d.pid > 0 and not p.ep.peer_error_handling and same_node):
            p.direct = False
            return
        proof = d.proof
        if (
            proof is None
            or p.proof_rkey is None
            or proof.size < 16
            or proof.size > 4096
            or proof.memory_type != "host"
            or self._worker is None
        ):
            log.warning(
                "peer %r (pid %d): its descriptor carries no usable proof region; reads stay on UCX",
                p.key,
                d.pid,
            )
            p.direct = False
            return
        if self._proven_again(p):
            return
        n = proof.size
        via_ucx = np.zeros(n, dtype=np.uint8)
        via_pid = np.ones(n, dtype=np.uint8)
        nat = native()
        fd = -1
        try:
            fd = os.pidfd_open(d.pid)  # first: the pid cannot be reused under the reads below
            self._worker.get(
                np.array([[0, 0, proof.base, via_ucx.ctypes.data, n]], dtype=np.uint64),
                [p.ep],
                [p.proof_rkey],
                None,
                self._timeout,
                1,
            )
            nat.cma_read(np.array([[d.pid, proof.base, via_pid.ctypes.data, n]], dtype=np.uint64))
            anonymous = _anonymous_at(d.pid, proof.base)
            alive = not _readable(fd)
        except (OSError, AttributeError, nat.UcxError) as exc:  # EPERM, ENOSYS, ESRCH, EFAULT, UCX failures
            if fd >= 0:
                os.close(fd)
            log.info(
                "peer %r (pid %d): same-host read refused or failed (%s); reads stay on UCX",
                p.key,
                d.pid,
                exc,
            )
            p.direct = False
            return
        if not (alive and anonymous and np.array_equal(via_ucx, via_pid) and _nonce_like(via_ucx)):
            os.close(fd)
            why = (
                "it exited"
                if not alive
                else "its proof bytes differ"
                if not np.array_equal(via_ucx, via_pid)
                else "its proof is not in private anonymous memory"
                if not anonymous
                else "its proof is not a nonce"
            )
            log.warning(
                "peer %r: pid %d is not proven to be the process behind its UCX endpoint (%s); "
                "its reads stay on UCX",
                p.key,
                d.pid,
                why,
            )
            p.direct = False
            return
        self._adopt(p, fd)
        self._proven[self._proof_key(d)] = p

    @staticmethod
    def _proof_key(d: PeerDescriptor) -> tuple:
        assert d.proof is not None
        return (d.worker_address, d.pid, d.node, d.proof.base, d.proof.size)

    def _proven_again(self, p: Peer) -> bool:
        """Whether ``p``'s process was proven already behind the same worker, through another peer
        that is still direct and whose pidfd says the process still runs (then the pid has not
        been reused): a session hub's namespaces each connect to one publisher or replica server
        as a peer of their own, and each full proof reads the peer's whole memory map."""
        d = p.desc
        q = self._proven.get(self._proof_key(d))
        if q is None or q is p or not q.direct or q.pidfd < 0 or _readable(q.pidfd):
            return False
        try:
            fd = os.pidfd_open(d.pid)
        except OSError:
            return False
        if _readable(q.pidfd):  # exited in between: the new pidfd may name a reused pid
            os.close(fd)
            return False
        self._adopt(p, fd)
        return True

    def _adopt(self, p: Peer, fd: int) -> None:
        p.direct, p.pidfd = True, fd
        with self._poll_lock:
            self._pidfd_keys[fd] = p.key
            self._pidpoll.register(fd, select.POLLIN)

    def forget(self, p: Peer) -> None:
        """Take ``p`` off this path for good and close its pidfd."""
        if p.desc.proof is not None and self._proven.get(self._proof_key(p.desc)) is p:
            del self._proven[self._proof_key(p.desc)]
        p.direct = False
        p.maps = []  # unmapped once no snapshot holds them (nor a replay: dropped here)
        self._replays.clear()
        if p.pidfd >= 0:
            with self._poll_lock:
                self._pidpoll.unregister(p.pidfd)
                self._pidfd_keys.pop(p.pidfd, None)
                os.close(p.pidfd)
            p.pidfd = -1
        self._peers.invalidate()

    def map_regions(self, p: Peer, prev_regions: tuple[RegionInfo, ...]) -> None:
        """Map the memfd behind each host region of direct peer ``p`` (``memfd.py``); regions
        equal to ``prev_regions`` keep their mapping (or their refusal: tried once)."""
        old = p.maps
        self._replays.clear()  # they hold the snapshots that hold the mappings replaced here
        maps: list[Any] = []
        for i, r in enumerate(p.desc.regions):
            if i < len(prev_regions) and prev_regions[i] == r and i < len(old):
                maps.append(old[i])
                continue
            m = None
            if r.memfd >= 0 and r.size > 0 and r.memory_type == "host" and p.pidfd >= 0:
                got = memfd.map_peer_region(p.pidfd, p.desc.pid, r.memfd, r.base, r.size)
                if isinstance(got, str):
                    log.info(
                        "peer %r (pid %d) region %d: not mapped (%s); it is read with process_vm_readv",
                        p.key,
                        p.desc.pid,
                        i,
                        got,
                    )
                else:
                    m = got
            maps.append(m)
        p.maps = maps

    @staticmethod
    def prefault(p: Peer, spans: Sequence[tuple[int, int, int]]) -> None:
        """Start prefaulting the mapped regions' byte ranges ``(region, lo, hi)`` in the
        background (``memfd.PeerMapping.prefault_later``), clipped to each region; ranges of
        unmapped or unknown regions are left alone (the hint comes from etcd)."""
        if not p.direct:
            return
        regions = p.desc.regions
        per: dict[int, list[tuple[int, int]]] = {}
        for region, lo, hi in spans:
            if not 0 <= region < len(p.maps) or p.maps[region] is None:
                continue
            lo, hi = max(lo, 0), min(hi, regions[region].size)
            if lo < hi:
                per.setdefault(region, []).append((lo, hi))
        for region, got in per.items():
            p.maps[region].prefault_later(got)

    def replay(self, ops: object, t: PeerSnapshot, lt: LocalSnapshot) -> bool:
        """Copy ``ops`` again as an earlier get under these snapshots checked them and sent them
        whole through mapped regions (``replays.py``): the same copy plan, the same exit check
        after it. False when no such get is kept (the caller checks and reads as usual)."""
        r = self._replays.find(ops, t, lt) if isinstance(ops, np.ndarray) else None
        if r is None:
            return False
        copy_rows(r.plan, r.threads)
        self._check_exited(r.pids)
        return True

    def serve(
        self, t: PeerSnapshot, lt: LocalSnapshot, rows: Rows, *, threads: int | None, ops: object = None
    ) -> Rows | None:
        """Read the rows this path may take; the rows left for UCX (None: none left).

        ``threads``: copy threads (None: as many as this process may use, for mapped
        regions; one for process_vm_readv). A fallback error leaves every row to UCX,
        the ones already read included. ``ops``: the plan ``rows`` were resolved from, as
        the caller gave it; when every row went through mapped regions, kept for
        :meth:`replay`.
        """
        dmask = lt.host_only(t.direct[rows.flat], rows.local, rows.length)
        nd = int(np.count_nonzero(dmask))
        if nd == 0:
            return rows
        whole = nd == len(rows)
        key = (ops, lt) if whole and isinstance(ops, np.ndarray) else None
        if not self._read(t, rows if whole else rows.take(dmask), threads, key):
            return rows
        return None if whole else rows.take(~dmask)

    def _read(
        self, t: PeerSnapshot, rows: Rows, threads: int | None, key: tuple[np.ndarray, LocalSnapshot] | None
    ) -> bool:
        """Rows of direct peers: memcpy from mapped regions, process_vm_readv for the rest.
        False: fall back to UCX for the whole plan. ``key``: (ops, local snapshot) of a
        plan to keep for :meth:`replay` if all of it is copied from mappings."""
        pids = t.pid[rows.pidx]
        on_map = t.mapped[rows.flat] != 0
        n_map = int(np.count_nonzero(on_map))
        left: Rows | None = rows
        if n_map:
            m = rows if n_map == len(rows) else rows.take(on_map)
            off = m.remote - t.base[m.flat]
            self._prepare(t, m.flat, off, off + m.length)
            plan = np.empty((len(m), 3), dtype=np.uint64)
            plan[:, 0] = t.mapped[m.flat] + off
            plan[:, 1] = m.local
            plan[:, 2] = m.length
            copy_rows(plan, threads)
            left = None if n_map == len(rows) else rows.take(~on_map)
        if left is not None and not self._cma(t, left, 1 if threads is None else threads):
            return False
        self._check_exited(pids)
        if key is not None and left is None:
            self._replays.add(Replay(np.array(key[0]), t, key[1], plan, pids, threads))
        return True

    @staticmethod
    def _prepare(t: PeerSnapshot, flat: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Prefault, per mapped region, the byte runs this plan reads (``memfd.PeerMapping.prepare``).
        A region whose window (first byte, end, rows) was prepared before costs a lookup: a
        steady step finds every region ready and sorts nothing. One pass over the rows whatever
        the number of regions (a mask per region would cost rows x regions every step)."""
        regions, inv = np.unique(flat, return_inverse=True)
        inv = inv.reshape(-1)
        span_lo = np.full(len(regions), np.iinfo(np.uint64).max, dtype=np.uint64)
        span_hi = np.zeros(len(regions), dtype=np.uint64)
        np.minimum.at(span_lo, inv, lo)
        np.maximum.at(span_hi, inv, hi)
        count = np.bincount(inv, minlength=len(regions))
        windows = {
            r: (a, b, n)
            for r, a, b, n in zip(regions.tolist(), span_lo.tolist(), span_hi.tolist(), count.tolist())
            if not t.maps[r].ready((a, b, n))
        }
        if not windows:
            return
        if len(windows) < len(regions):
            sel = np.isin(flat, np.fromiter(windows, dtype=np.uint64, count=len(windows)))
            flat, lo, hi = flat[sel], lo[sel], hi[sel]
        per: dict[int, list[tuple[int, int]]] = {}
        for r, a, b in span_runs(flat, lo, hi):
            per.setdefault(r, []).append((a, b))
        for r, runs in per.items():
            t.maps[r].prepare(runs, windows[r])

    def _cma(self, t: PeerSnapshot, rows: Rows, threads: int) -> bool:
        """Rows via process_vm_readv. False: fall back to UCX for the whole plan."""
        cp = np.empty((len(rows), 4), dtype=np.uint64)
        cp[:, 0] = t.pid[rows.pidx]
        cp[:, 1] = rows.remote
        cp[:, 2] = rows.local
        cp[:, 3] = rows.length
        if t.n_direct > 1 and (cp[:, 0] != cp[0, 0]).any():  # group by peer: full batches
            cp = cp[np.argsort(cp[:, 0], kind="stable")]
        if threads > 1:  # threads split at row boundaries: cut rows too big to balance
            total = int(rows.length.sum())
            cap = max(total // (4 * threads), 1 << 20)
            if total > _SPLIT_BYTES and int(rows.length.max()) > cap:
                cp = _cut_rows(cp, cap)
        try:
            native().cma_read(cp, threads=threads, split_bytes=_SPLIT_BYTES)
        except OSError as exc:
            return self._failed(t, exc)
        return True

    def _failed(self, t: PeerSnapshot, exc: OSError) -> bool:
        """A failed ``cma_read``: False to fall back to UCX, else raise the typed error."""
        pid = int(getattr(exc, "pid", 0))
        key = t.keys[int(np.argmax(t.pid == np.uint64(pid)))] if pid else None
        if exc.errno in _FALLBACK:
            if exc.errno in _REFUSED:  # refused for good: this peer stays on UCX
                with self._lock:
                    p = self._peers.get(key)
                    if p is not None and p.desc.pid == pid:
                        self.forget(p)
            return False
        raise self._error(exc, key, pid, exc.strerror or str(exc), gone=exc.errno == errno.ESRCH) from exc

    def _check_exited(self, pids: np.ndarray) -> None:
        """Raise if a peer read (``pids``: per row) exited meanwhile: its pid may be reused,
        bytes suspect (mapped reads too: the same rule whichever way the bytes came)."""
        with self._poll_lock:
            exited = [self._pidfd_keys.get(fd) for fd, _ in self._pidpoll.poll(0)]
        for key in exited:
            with self._lock:
                p = self._peers.get(key) if key is not None else None
            if p is not None and (pids == np.uint64(p.desc.pid)).any():
                raise self._error(None, key, p.desc.pid, "process exited during the read", gone=True)

    def _error(
        self, exc: OSError | None, key: Hashable, pid: int, text: str, *, gone: bool
    ) -> TransportError:
        err = (PeerUnreachable if gone else TransportError)(
            f"reading from peer {key!r} (pid {pid} on {self._host}) with process_vm_readv: {text}"
        )
        err.status = 0  # type: ignore[attr-defined]
        err.status_text = text  # type: ignore[attr-defined]
        err.errno = exc.errno if exc is not None else errno.ESRCH  # type: ignore[attr-defined]
        return err


def _readable(fd: int) -> bool:
    """Whether a pidfd is readable now (its process exited). poll, not select: select cannot
    take descriptors past 1023, which a process connected to ~1,000 peers reaches."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))

"""Streamed reads over plain TCP: the data plane of pulls from peers that only tcp reaches.

Why: UCX's tcp transport has no one-sided reads; it emulates each ``ucp_get_nbx`` with a
request the publisher's progress thread answers, so a plan of 25k rows is 25k request/reply
exchanges. Measured on one 2-core host (``benchmarks/peers.py --transport tcp``, 1 GiB,
25k rows): UCX 1.6 GB/s; one request per publisher whose bytes it streams back in plan
order: 2.7 GB/s, about what a gloo broadcast of one contiguous buffer gets (2.9). The bytes
move through the extension's socket loop (``move_rows``), not a Python loop over memoryviews,
which had cost as much CPU as the kernel's copies (TP=1, 2 GiB: 3.9 -> 5.9 GB/s, gloo 4.3).

Wire (little-endian), per connection; a consumer uses one or several (lanes) per publisher::

    request  = "<8sII" (REQUEST, n_keys, n_rows)
               + n_keys x KEY (region u32, stream key 16 bytes)
               + n_rows x ROW (region u32, offset u64, length u64)
               (LANE instead of REQUEST, no rows: the first request of an extra lane, refused
               while the server holds more than half of MAX_CONNECTIONS: the other half is
               kept for consumers' first connections)
    response = "<8sIQ" (RESPONSE, status, n)
               + status OK: n bytes, the rows' bytes in request order
               + status REFUSED: an n-byte UTF-8 message (nothing else is sent)

Trust. The server reads only its own memory, only inside regions it registered with a keep-
alive (a torch storage, held while the bytes go out, so an unregister during a send cannot
free them), and only for a request that names each region's random stream key. Those keys
travel in the descriptor next to the UCX rkeys, so a stream reader can read exactly what a UCX
reader of that descriptor could. Requests are checked whole (magic, counts, keys, bounds)
before a byte is sent; a bad one gets REFUSED and the connection stays usable. The consumer
writes only into the destinations of its own checked plan, and takes exactly the byte count
it asked for; a peer that sends less, closes, or stalls past the timeout raises
:class:`~astate_store.errors.PeerUnreachable`. A new connection first sends the job's keys with
no rows; a peer whose address cannot be connected to, or whose server there does not hold those
keys (a server bound to loopback seen from another host reaches some other process; a firewall),
is served by UCX instead, logged once. Regions are found by key, not by the request's region
numbers, which are the consumer's descriptor indices (a session hub's namespace numbers its
subset of the worker's regions its own way).
"""

from __future__ import annotations

import ctypes
import errno
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping

import numpy as np

from astate_store.errors import PeerUnreachable, TransportError
from astate_store.transport.binding import native
from astate_store.transport.config import env_on

__all__ = ["StreamServer", "StreamReader", "Served", "Job", "new_key", "enabled", "parse_address", "move_all", "jobs_for",
           "KEY_BYTES", "split_job", "lanes_wanted", "default_lanes", "REQUEST", "RESPONSE", "LANE", "KEY_DT", "ROW_DT", "OK",
           "REFUSED"]

log = logging.getLogger(__name__)

REQUEST, RESPONSE, LANE = b"ASTSRQ01", b"ASTSRS01", b"ASTSLN01"
OK, REFUSED = 0, 1
KEY_BYTES = 16
_REQ = struct.Struct("<8sII")
_RESP = struct.Struct("<8sIQ")
KEY_DT = np.dtype([("region", "<u4"), ("key", f"S{KEY_BYTES}")])
ROW_DT = np.dtype([("region", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_ROWS = 1 << 18  # rows per request (5 MiB of request); a longer plan sends several
MAX_KEYS = MAX_ROWS  # a request's rows name at most that many regions
MAX_CONNECTIONS = 256  # open connections one server serves at once (see _EVICT_IDLE_S for a new one past it)
_IOV = 1024  # buffers per sendmsg / recvmsg_into (Linux IOV_MAX)
# A receiver is woken once this much has arrived (SO_RCVLOWAT, capped at what is still expected):
# 256 KiB-1 MiB measured alike over loopback, 10-25% faster than a wake-up per segment.
_RCVLOWAT = 256 << 10
_IDLE_S = 600.0  # a server connection with no request for this long is closed
_POOL_IDLE_S = _IDLE_S / 2  # a client drops pooled connections idle this long (before the server does)
_STALL_S = 120.0  # no byte moving for this long: the peer is gone (also bounds get(timeout=None))
_DOWN_S = 30.0  # an address that refused a connection is retried after this long
_CONNECT_S = 5.0
# A pull aims for this many connections in all (``ASTATE_STREAM_LANES``; default: the cores, at most 8):
# publishers fewer than that are read over several connections ("lanes") each, every lane moving at
# least ``_LANE_MIN`` bytes. Why: each connection's receive copy runs on one core, and one flow is
# what clouds cap per connection. On 2 cores, 1 publisher -> 1 consumer over loopback, 1 GiB: one
# connection 3.1-3.8 GB/s, two 4.0-5.4 in four runs (benchmarks/stream_lanes.py); more lanes than cores
# gain nothing.
_LANE_MIN = 16 << 20
_MAX_LANES = 8  # the default's cap
_MAX_LANES_SET = 64  # the most ASTATE_STREAM_LANES may ask for (each lane is a socket at both ends)
# A full server (MAX_CONNECTIONS) closes its longest-idle connection, idle at least this long, to
# admit a new one: pooled lanes of one consumer never lock the next consumer out (the evicted
# one's owner reconnects on its next pull, as after the idle timeout). Between the requests of one
# job a connection is idle for microseconds, so a job in progress is not cut.
_EVICT_IDLE_S = 1.0


def default_lanes() -> int:
    """Connections a pull aims for when ``ASTATE_STREAM_LANES`` is not set: the cores, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(_MAX_LANES, cores))


def lanes_wanted() -> int:
    """Connections a pull aims for in all: ``ASTATE_STREAM_LANES``, else :func:`default_lanes`.

    Raises:
        ValueError: the variable is set to something other than an integer from 1 to 64.
    """
    raw = os.environ.get("ASTATE_STREAM_LANES", "").strip()
    if not raw:
        return default_lanes()
    if not raw.isdigit() or not 1 <= int(raw) <= _MAX_LANES_SET:
        raise ValueError(f"ASTATE_STREAM_LANES must be an integer from 1 to {_MAX_LANES_SET}, got {raw!r}")
    return int(raw)


def enabled() -> bool:
    """Streamed reads on (default) unless ``ASTATE_STREAM=0``."""
    return env_on("ASTATE_STREAM")


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def parse_address(addr: object) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) with an IP literal host, as a descriptor carries it.

    Raises:
        TransportError: anything else.
    """
    if not isinstance(addr, str) or len(addr) > 64:
        raise TransportError(f"malformed transport descriptor: stream address {addr!r} is not 'ip:port'")
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
        p = int(port)
    except ValueError:
        raise TransportError(f"malformed transport descriptor: stream address {addr!r} is not 'ip:port'") from None
    if not sep or not 0 < p < 65536 or ip.is_multicast or ip.is_unspecified:
        raise TransportError(f"malformed transport descriptor: stream address {addr!r} is not 'ip:port'")
    return str(ip), p


def _view(address: int, nbytes: int) -> memoryview:
    """A byte view of raw memory (no copy; only the parts sliced out are ever touched)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _segments(addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows merged where one ends where the next starts (the stream is one byte sequence)."""
    if len(addr) < 2:
        return addr, length
    starts = np.ones(len(addr), dtype=bool)
    starts[1:] = addr[1:] != addr[:-1] + length[:-1]
    idx = np.flatnonzero(starts)
    return addr[idx], np.add.reduceat(length, idx)


def _slices(a: np.ndarray, n: np.ndarray) -> list[memoryview]:
    """Views of rows (addresses ``a``, lengths ``n``): slices of one view over their whole span, or
    one view each where the span is beyond what a view may cover."""
    lo, hi = int(a.min()), int((a + n).max())
    if hi - lo >= 1 << 62:
        return [_view(o, k) for o, k in zip(a.tolist(), n.tolist())]
    view = _view(lo, hi - lo)
    return [view[o:o + k] for o, k in zip((a - np.uint64(lo)).tolist(), n.tolist())]


def move_all(call: Callable[[list[memoryview]], int], bufs: list[memoryview]) -> None:
    """Run ``call`` (sendmsg / recvmsg_into) over ``bufs`` until every byte moved, ``_IOV`` at a time."""
    for i in range(0, len(bufs), _IOV):
        batch = bufs[i:i + _IOV]
        while batch:
            n = call(batch)
            if n <= 0:
                raise ConnectionError("connection closed by the peer")
            while batch and n >= len(batch[0]):
                n -= len(batch[0])
                batch = batch[1:]
            if n:
                batch = [batch[0][n:], *batch[1:]]


def move_rows(sock: socket.socket, addr: np.ndarray, length: np.ndarray, send: bool,
              deadline: float | None = None) -> None:
    """Send from (``send``) or receive into the rows ``(addr, length)``, in order, until every byte
    moved: the native loop (GIL released, no Python per call), or, with ``ASTATE_STREAM_NATIVE=0``,
    ``move_all`` over views. Waits at most ``_STALL_S`` for a byte and never past ``deadline``
    (``time.monotonic()``). Raises TimeoutError, ConnectionError, OSError."""
    keep = length > 0  # an empty row moves nothing (and an all-empty batch would read as "closed")
    a, n = _segments(addr[keep], length[keep])
    if not len(a):
        return
    if not env_on("ASTATE_STREAM_NATIVE"):
        call = sock.sendmsg if send else (lambda b: sock.recvmsg_into(b)[0])

        def timed(b: list[memoryview]) -> int:
            _arm(sock, deadline)
            return call(b)

        move_all(timed, _slices(a, n))
        return
    left = _until(deadline)
    rows = np.empty((len(a), 2), dtype=np.uint64)
    rows[:, 0], rows[:, 1] = a, n
    native().sock_rows(sock.fileno(), rows, send, timeout=-1.0 if left is None else left, stall=_STALL_S,
                       lowat=_RCVLOWAT)


def _until(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (None: no deadline); TimeoutError once it passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _arm(sock: socket.socket, deadline: float | None) -> None:
    """The socket's timeout for its next call: the stall budget, never past ``deadline``."""
    left = _until(deadline)
    sock.settimeout(_STALL_S if left is None else min(_STALL_S, left))


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if n:
        move_all(lambda b: sock.recv_into(b[0]), [memoryview(buf)])
    return bytes(buf)


# ------------------------------------------------------------------------------------------ server


@dataclass(frozen=True)
class Served:
    """What the server may read for one region: where, how much, its key, and what keeps it alive."""

    address: int
    size: int
    key: bytes
    keepalive: Any


class _Refused(Exception):
    pass


class StreamServer:
    """Listens on ``host`` (an ephemeral port); one thread per connection.

    ``lookup(key)``: the transport's live region holding stream key ``key``, or None (unknown,
    freed, not streamable). A request's region numbers are the consumer's (its descriptor's
    indices): only labels tying its rows to its keys.
    """

    def __init__(self, host: str, lookup: Callable[[bytes], Served | None]) -> None:
        ip = ipaddress.ip_address(host)
        fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        self._ls = socket.create_server((str(ip), 0), family=fam, backlog=128)
        self._ls.settimeout(0.5)  # the accept loop notices close() this often
        port = self._ls.getsockname()[1]
        self.address = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
        self._lookup = lookup
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, float | None] = {}  # -> monotonic time it went idle; None: busy
        self.refused = 0  # requests refused (bad magic, key, bounds): a figure for tests and logs
        self.lanes_refused = 0  # extra lanes refused for room
        self.served_bytes = 0
        self._thread = threading.Thread(target=self._accept_loop, name="astate-stream-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._ls.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                return
            with self._lock:
                if self._closed.is_set() or (len(self._conns) >= MAX_CONNECTIONS and not self._evict_idle()):
                    conn.close()
                    continue
                self._conns[conn] = time.monotonic()
            threading.Thread(target=self._serve, args=(conn,), name="astate-stream", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._closed.is_set():
                self._mark(conn, idle=True)
                conn.settimeout(_IDLE_S)
                head = conn.recv(_REQ.size)
                if not head:
                    return  # the consumer closed (or the connection was evicted): done
                self._mark(conn, idle=False)
                conn.settimeout(_STALL_S)
                self._answer(conn, head + _exact(conn, _REQ.size - len(head)))
        except (OSError, ConnectionError) as exc:
            log.debug("stream connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, head: bytes) -> None:
        if len(head) != _REQ.size:
            raise ConnectionError("truncated request header")
        magic, n_keys, n_rows = _REQ.unpack(head)
        if magic not in (REQUEST, LANE) or n_keys > MAX_KEYS or n_rows > MAX_ROWS or (magic == LANE and n_rows):
            # out of step with the peer (not our protocol, or absurd counts): drop the connection
            self._count(refused=1)
            raise ConnectionError(f"bad request header (magic {magic!r}, {n_keys} keys, {n_rows} rows)")
        keys = np.frombuffer(_exact(conn, n_keys * KEY_DT.itemsize), dtype=KEY_DT)
        rows = np.frombuffer(_exact(conn, n_rows * ROW_DT.itemsize), dtype=ROW_DT)
        if magic == LANE and self._crowded():
            msg = b"no room for another lane"
            conn.sendall(_RESP.pack(RESPONSE, REFUSED, len(msg)) + msg)
            raise ConnectionError("an extra lane refused for room")  # and closed: it frees its slot
        try:
            bufs, total, keep = self._check(keys, rows)
        except _Refused as exc:
            self._count(refused=1)
            msg = str(exc).encode()[:4096]
            conn.sendall(_RESP.pack(RESPONSE, REFUSED, len(msg)) + msg)
            return
        conn.sendall(_RESP.pack(RESPONSE, OK, total))
        move_rows(conn, *bufs, send=True)
        self._count(served=total)
        del keep  # the regions' storages were held until every byte was out

    def _crowded(self) -> bool:
        """More than half the connection slots in use: no extra lanes (first connections only)."""
        with self._lock:
            crowded = len(self._conns) > MAX_CONNECTIONS // 2
            self.lanes_refused += crowded
            return crowded

    def _mark(self, conn: socket.socket, idle: bool) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns[conn] = time.monotonic() if idle else None

    def _evict_idle(self) -> bool:
        """(Lock held.) Close the longest-idle connection idle for ``_EVICT_IDLE_S``; False: none is."""
        now = time.monotonic()
        idle = [(since, c) for c, since in self._conns.items() if since is not None and now - since >= _EVICT_IDLE_S]
        if not idle:
            return False
        victim = min(idle, key=lambda x: x[0])[1]
        del self._conns[victim]
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its thread's recv returns: it closes the socket
        except OSError:
            pass
        return True

    def _count(self, refused: int = 0, served: int = 0) -> None:
        with self._lock:  # several connection threads
            self.refused += refused
            self.served_bytes += served

    def _check(self, keys: np.ndarray, rows: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], int, list[Any]]:
        """The send rows (addresses, lengths) of a whole request, or _Refused naming the first problem."""
        served: dict[int, Served] = {}
        for region, key in zip(keys["region"].tolist(), keys["key"].tolist()):
            key = key.ljust(KEY_BYTES, b"\0")  # numpy drops trailing NULs of an S16 value
            s = self._lookup(key)
            if s is None or not hmac.compare_digest(s.key, key):
                raise _Refused(f"region {region}: unknown, freed, or a wrong stream key")
            served[int(region)] = s
        if not len(rows):
            return (np.zeros(0, np.uint64), np.zeros(0, np.uint64)), 0, []
        region, off, length = rows["region"], rows["offset"], rows["length"]
        known = np.array(sorted(served), dtype=np.uint32)
        pos = np.searchsorted(known, region)
        bad = (pos >= len(known)) | (known[np.minimum(pos, len(known) - 1)] != region) if len(known) else \
            np.ones(len(rows), dtype=bool)
        if bad.any():
            raise _Refused(f"row {int(np.argmax(bad))}: region {int(region[np.argmax(bad)])} has no key in the request")
        size = np.array([served[int(r)].size for r in known], dtype=np.uint64)[pos]
        base = np.array([served[int(r)].address for r in known], dtype=np.uint64)[pos]
        with np.errstate(over="ignore"):
            bad = (length == 0) | (off > size) | (length > size - off)
        if bad.any():
            i = int(np.argmax(bad))
            raise _Refused(f"row {i}: [{int(off[i])}, +{int(length[i])}) is empty or outside region "
                           f"{int(region[i])} ({int(size[i])} bytes)")
        total = int(length.sum(dtype=np.uint64))
        return (base + off, length), total, [s.keepalive for s in served.values()]

    def close(self) -> None:
        self._closed.set()
        try:
            self._ls.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = list(self._conns), {}
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(2.0)


# ------------------------------------------------------------------------------------------ client


@dataclass(frozen=True)
class Job:
    """One publisher's part of a plan: its stream address, the keys of the regions used, and
    rows (region, offset, length) with their local destinations, in plan order."""

    peer: Hashable
    address: str
    keys: np.ndarray  # KEY_DT
    rows: np.ndarray  # ROW_DT
    local: np.ndarray  # uint64 destination addresses, one per row
    rows_index: np.ndarray  # positions of these rows in the caller's plan


class StreamReader:
    """Runs jobs over pooled connections, one thread per publisher; a publisher is read over
    several connections ("lanes") when the job has fewer publishers than ``lanes``."""

    def __init__(self, lanes: int | None = None) -> None:
        """``lanes``: connections a read aims for in all (None: :func:`lanes_wanted`)."""
        self.lanes = lanes_wanted() if lanes is None else max(1, int(lanes))
        self._lock = threading.Lock()
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # address -> (socket, last used)
        self._down: dict[str, float] = {}  # address -> monotonic time it could not be connected to
        self._pid = os.getpid()
        # "jobs": one thread per publisher; "lanes": the connections of one job (they never wait
        # on anything, so a job waiting on its lanes cannot starve them)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self.bytes = 0  # bytes received by completed streamed reads
        self._closed = False

    def read(self, jobs: list[Job], timeout: float | None) -> list[Job]:
        """Run ``jobs``, publishers in parallel; returns the ones to send another way (their
        stream server cannot be reached, or a destination is not host memory). Raises
        PeerUnreachable / TransportError."""
        self._after_fork()
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        lanes = max(1, self.lanes // max(1, len(jobs)))
        if len(jobs) == 1:
            return [] if self._job(jobs[0], deadline, lanes) else list(jobs)
        done = self._map("jobs", self._job, [(j, deadline, lanes) for j in jobs])
        return [j for j, ok in zip(jobs, done) if not ok]

    def _map(self, pool: str, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        """``fn(*args)`` for each of ``calls`` on the named pool; their results once every one
        ended (none writes after this returns or raises); the first error raised."""
        futs: list[Future[Any]] = []
        try:
            ex = self._executor(pool)
            for args in calls:
                futs.append(ex.submit(fn, *args))
        except RuntimeError:  # close() shut the pool down between two submits
            wait(futs)
            raise TransportError("transport is closed") from None
        except BaseException:
            wait(futs)
            raise
        return _results(futs)

    def _executor(self, name: str) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            if name not in self._pools:  # lanes: room for all at once (a queued lane's socket would idle)
                workers = _MAX_LANES_SET if name == "lanes" else 16
                self._pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"astate-stream-{name}")
            return self._pools[name]

    def _job(self, job: Job, deadline: float | None, lanes: int = 1) -> bool:
        """True: every byte of ``job`` landed; False: it goes another way (UCX redoes all of it).
        Over up to ``lanes`` connections, each at least ``_LANE_MIN`` bytes of the job."""
        nbytes = int(job.rows["length"].sum(dtype=np.uint64))
        conns = self._open_lanes(job, deadline, max(1, min(lanes, nbytes // _LANE_MIN)))
        if not conns:
            return False
        parts = split_job(job, len(conns))
        for sock, _ in conns[len(parts):]:
            self._give_back(job.address, sock)
        if len(parts) == 1:
            done = [self._part(parts[0], *conns[0], deadline)]
        else:
            calls = [(p, sock, pooled, deadline) for p, (sock, pooled) in zip(parts, conns)]
            done = self._map("lanes", self._part, calls)
        if False in done:
            return False
        for part, ok in zip(parts, done):
            if ok is None:  # its connection was gone and no fresh one came: once more, on any
                sock, pooled = self._take(part, deadline)
                if sock is None or self._part(part, sock, pooled, deadline) is not True:
                    return False
        with self._lock:
            self.bytes += nbytes
        return True

    def _open_lanes(self, job: Job, deadline: float | None, want: int) -> list[tuple[socket.socket, bool]]:
        """Up to ``want`` connections to the job's server (pooled ones first); [] when it cannot be
        reached. A lane past the first that cannot be opened (the server is full) is done without."""
        sock, pooled = self._take(job, deadline)
        if sock is None:
            return []
        conns = [(sock, pooled)]
        while len(conns) < want:
            sock, pooled = self._take(job, deadline, optional=True)
            if sock is None:
                break
            conns.append((sock, pooled))
        return conns

    def _part(self, job: Job, sock: socket.socket, pooled: bool, deadline: float | None) -> bool | None:
        """``job`` (a job or one lane of it) on ``sock``, which this then keeps or closes. True:
        landed; False: UCX must read it; None: ``sock`` was closed by the server (idle, evicted)
        before any byte and no fresh connection could be had now (the caller decides)."""
        try:
            try:
                self._requests(sock, job, pooled, deadline)
            except _Stale:  # the server had closed this pooled connection: once more on a fresh one
                sock.close()
                fresh = self._connect(job, deadline, optional=True)
                if fresh is None:
                    return None
                sock = fresh
                self._requests(sock, job, False, deadline)
        except _PeerRefused as exc:
            self._give_back(job.address, sock)
            raise _error(TransportError, f"peer {job.peer!r} ({job.address}) refused a streamed read", str(exc)) \
                from None
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EFAULT:
                raise self._unreachable(job, exc) from exc
            log.info("streamed read from %s: a destination is not host memory (EFAULT); UCX reads it", job.address)
            return False
        except (ValueError, OverflowError) as exc:  # a malformed response
            sock.close()
            raise self._unreachable(job, exc) from exc
        self._give_back(job.address, sock)
        return True

    @staticmethod
    def _unreachable(job: Job, exc: BaseException) -> TransportError:
        what = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else \
                (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
        return _error(PeerUnreachable, f"streamed read from peer {job.peer!r} ({job.address})", what)

    def _requests(self, sock: socket.socket, job: Job, pooled: bool, deadline: float | None) -> None:
        for lo in range(0, len(job.rows), MAX_ROWS):
            self._request(sock, job, lo, min(len(job.rows), lo + MAX_ROWS), pooled and lo == 0, deadline)

    def _request(self, sock: socket.socket, job: Job, lo: int, hi: int, may_be_stale: bool,
                 deadline: float | None) -> None:
        rows = job.rows[lo:hi]
        keys = job.keys[np.isin(job.keys["region"], np.unique(rows["region"]))]
        try:
            _arm(sock, deadline)
            sock.sendall(_REQ.pack(REQUEST, len(keys), len(rows)) + keys.tobytes() + rows.tobytes())
            magic, status, n = _RESP.unpack(_exact(sock, _RESP.size))
        except (ConnectionError, OSError) as exc:
            # Closed before any answer (no byte written here yet): an idle connection the server dropped.
            if may_be_stale and not isinstance(exc, (socket.timeout, TimeoutError)):
                raise _Stale() from exc
            raise
        if magic != RESPONSE:
            raise ConnectionError(f"not a stream response (magic {magic!r})")
        if status == REFUSED:
            if n > 4096:
                raise ConnectionError(f"refusal of {n} bytes (at most 4096)")
            raise _PeerRefused(_exact(sock, n).decode(errors="replace"))
        want = int(rows["length"].sum(dtype=np.uint64))
        if status != OK or n != want:
            raise ConnectionError(f"response status {status} with {n} bytes, {want} asked")
        move_rows(sock, job.local[lo:hi], rows["length"], send=False, deadline=deadline)

    def _take(self, job: Job, deadline: float | None, optional: bool = False) -> tuple[socket.socket | None, bool]:
        """A pooled connection (True) or a fresh one (False); None: not reachable now (``optional``:
        a fresh one that fails is not remembered as down)."""
        stale: list[socket.socket] = []
        found = None
        with self._lock:
            idle = self._idle.get(job.address, [])
            while idle and found is None:
                sock, used = idle.pop()
                if time.monotonic() - used < _POOL_IDLE_S:
                    found = sock
                else:
                    stale.append(sock)
        for sock in stale:
            sock.close()
        if found is not None:
            return found, True
        return self._connect(job, deadline, optional), False

    def _connect(self, job: Job, deadline: float | None, optional: bool = False) -> socket.socket | None:
        """A new connection to the job's server whose server accepted the job's keys in a request
        of no rows (so it is the server of this descriptor, with room for us; a loopback address
        seen from another host may reach some other process), or None, remembered for
        ``_DOWN_S``: those rows go another way. ``optional``: an extra lane (asked as LANE, which
        a crowded server refuses), not remembered as down."""
        address = job.address
        with self._lock:
            since = self._down.get(address)
            if since is not None and time.monotonic() - since < _DOWN_S:
                return None
        host, port = parse_address(address)
        t = _CONNECT_S if deadline is None else max(0.05, min(_CONNECT_S, deadline - time.monotonic()))
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=t)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keys = job.keys[:MAX_KEYS]
            sock.sendall(_REQ.pack(LANE if optional else REQUEST, len(keys), 0) + keys.tobytes())
            got = _RESP.unpack(_exact(sock, _RESP.size))
            if got != (RESPONSE, OK, 0):
                raise ConnectionError("not this descriptor's stream server" if got[:2] == (RESPONSE, REFUSED)
                                      else "not a stream server")
        except (OSError, ConnectionError, struct.error) as exc:
            if sock is not None:
                sock.close()
            if optional:  # a lane more (or a retry) to a server that answered: it is full, not down
                log.debug("no extra connection to %s: %s", address, exc)
                return None
            with self._lock:
                first = address not in self._down
                self._down[address] = time.monotonic()
            if first:
                log.warning("stream address %s cannot be used (%s): its rows go through UCX", address, exc)
            return None
        with self._lock:
            self._down.pop(address, None)
        return sock

    def _give_back(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            pool = None if self._closed else self._idle.setdefault(address, [])
            if pool is not None and len(pool) < max(4, self.lanes):
                pool.append((sock, time.monotonic()))
                return
        sock.close()

    def forget(self, address: str) -> None:
        """Close the idle connections to ``address`` (its peer disconnected)."""
        with self._lock:
            socks = self._idle.pop(address, [])
            self._down.pop(address, None)
        for sock, _ in socks:
            sock.close()

    def _after_fork(self) -> None:
        if os.getpid() != self._pid:  # a forked child must not share its parent's connections
            self._pid = os.getpid()
            self._idle, self._down, self._pools = {}, {}, {}
            self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [sock for pool in self._idle.values() for sock, _ in pool]
            self._idle.clear()
            pools, self._pools = list(self._pools.values()), {}
        for s in socks:
            s.close()
        for pool in pools:
            pool.shutdown(wait=False)


class _PeerRefused(Exception):
    pass


class _Stale(Exception):
    pass


def _results(futs: list[Future[bool]]) -> list[bool]:
    """Every future's result, once all are done (none writes after the caller returns); the first
    error raised."""
    try:
        errors = [f.exception() for f in futs]
    except BaseException:  # e.g. KeyboardInterrupt: still none may write once the caller returns
        wait(futs)
        raise
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futs]


def split_job(job: Job, k: int) -> list[Job]:
    """``job`` cut into ``k`` lanes of about equal bytes, each a run of its rows in plan order (a
    row crossing a cut is cut too, its pieces reading and landing at the matching offsets)."""
    length = job.rows["length"]
    ends = np.cumsum(length, dtype=np.uint64)
    total = int(ends[-1]) if len(ends) else 0
    k = min(k, total)  # no empty lane
    if k <= 1:
        return [job]
    starts = ends - length
    cuts = [total * i // k for i in range(k + 1)]
    parts = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        a = int(np.searchsorted(ends, lo, side="right"))  # the first row ending past lo
        b = int(np.searchsorted(starts, hi, side="left"))  # past the last row starting before hi
        rows, local = job.rows[a:b].copy(), job.local[a:b].copy()
        head, tail = lo - int(starts[a]), int(ends[b - 1]) - hi
        rows["offset"][0] += np.uint64(head)  # uint64 throughout (numpy 1.x would go through float)
        rows["length"][0] -= np.uint64(head)
        local[0] += np.uint64(head)
        rows["length"][-1] -= np.uint64(tail)
        parts.append(Job(job.peer, job.address, job.keys, rows, local, job.rows_index[a:b]))
    return parts


def _error(cls: type[TransportError], message: str, reason: str) -> TransportError:
    """``message: reason``, with ``status``/``status_text`` as UCX failures carry them (status 0:
    not a UCX status)."""
    err = cls(f"{message}: {reason}")
    err.status = 0  # type: ignore[attr-defined]
    err.status_text = reason  # type: ignore[attr-defined]
    return err


def jobs_for(streams: Mapping[int, tuple[Hashable, str, np.ndarray]], pidx: np.ndarray,
             region: np.ndarray, offset: np.ndarray, length: np.ndarray, local: np.ndarray) -> list[Job]:
    """Group plan rows by peer into jobs. ``streams[peer_index]`` = (peer key, stream address,
    KEY_DT keys of its regions); every peer of ``pidx`` must be in it."""
    jobs = []
    order = np.argsort(pidx, kind="stable")
    peers, starts = np.unique(pidx[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    for p, s, e in zip(peers.tolist(), starts.tolist(), ends.tolist()):
        idx = order[s:e]
        peer, address, keys = streams[int(p)]
        rows = np.empty(len(idx), dtype=ROW_DT)
        rows["region"], rows["offset"], rows["length"] = region[idx], offset[idx], length[idx]
        jobs.append(Job(peer, address, keys, rows, local[idx], idx))
    return jobs

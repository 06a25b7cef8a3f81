"""The reading side of streamed reads: jobs (one publisher's rows each) over pooled connections.

:class:`StreamReader` runs one thread per publisher; a publisher is read over several
connections ("lanes") when a pull has fewer publishers than :func:`lanes_wanted`. A job's
rows are cut into lanes of about equal bytes (:func:`split_job`), each a run of rows in plan
order. A connection is opened by sending the job's keys with no rows: a peer whose address
cannot be connected to, or whose server there does not hold those keys, is remembered as down
for ``_DOWN_S`` and its rows go through UCX, logged once. A pooled connection the server closed
meanwhile (idle, evicted) is replaced once by a fresh one.

The consumer writes only into the destinations of its own checked plan, and takes exactly the
byte count it asked for; a peer that sends less, closes, or stalls past the timeout raises
:class:`~astate_store.errors.PeerUnreachable`.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from astate_store.errors import PeerUnreachable, TransportError
from astate_store.transport.stream.wire import (
    IDLE_S,
    LANE,
    MAX_KEYS,
    MAX_ROWS,
    OK,
    REFUSED,
    REQUEST,
    REQUEST_HEAD,
    RESPONSE,
    RESPONSE_HEAD,
    ROW_DT,
    arm,
    move_rows,
    parse_address,
    recv_exact,
)

__all__ = ["Job", "StreamReader", "split_job", "jobs_for", "lanes_wanted", "default_lanes"]

log = logging.getLogger("astate_store.transport.stream")

_POOL_IDLE_S = IDLE_S / 2  # a client drops pooled connections idle this long (before the server does)
_DOWN_S = 30.0  # an address that refused a connection is retried after this long
_CONNECT_S = 5.0
# A pull aims for this many connections in all (``ASTATE_STREAM_LANES``; default: the cores, at most
# 8): publishers fewer than that are read over several connections ("lanes") each, every lane moving
# at least ``_LANE_MIN`` bytes. Why: each connection's receive copy runs on one core, and one flow
# is what clouds cap per connection. Two connections beat one even on 2 cores
# (benchmarks/stream_lanes.py; its figures in docs/performance.md); more lanes than cores gain
# nothing.
_LANE_MIN = 16 << 20
_MAX_LANES = 8  # the default's cap
_MAX_LANES_SET = 64  # the most ASTATE_STREAM_LANES may ask for (each lane is a socket at both ends)


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
        for sock, _ in conns[len(parts) :]:
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
            raise _error(
                TransportError, f"peer {job.peer!r} ({job.address}) refused a streamed read", str(exc)
            ) from None
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EFAULT:
                raise self._unreachable(job, exc) from exc
            log.info(
                "streamed read from %s: a destination is not host memory (EFAULT); UCX reads it", job.address
            )
            return False
        except (ValueError, OverflowError) as exc:  # a malformed response
            sock.close()
            raise self._unreachable(job, exc) from exc
        self._give_back(job.address, sock)
        return True

    @staticmethod
    def _unreachable(job: Job, exc: BaseException) -> TransportError:
        what = (
            "timed out"
            if isinstance(exc, (socket.timeout, TimeoutError))
            else (exc.strerror or str(exc))
            if isinstance(exc, OSError)
            else str(exc)
        )
        return _error(PeerUnreachable, f"streamed read from peer {job.peer!r} ({job.address})", what)

    def _requests(self, sock: socket.socket, job: Job, pooled: bool, deadline: float | None) -> None:
        for lo in range(0, len(job.rows), MAX_ROWS):
            self._request(sock, job, lo, min(len(job.rows), lo + MAX_ROWS), pooled and lo == 0, deadline)

    def _request(
        self, sock: socket.socket, job: Job, lo: int, hi: int, may_be_stale: bool, deadline: float | None
    ) -> None:
        rows = job.rows[lo:hi]
        keys = job.keys[np.isin(job.keys["region"], np.unique(rows["region"]))]
        try:
            arm(sock, deadline)
            sock.sendall(REQUEST_HEAD.pack(REQUEST, len(keys), len(rows)) + keys.tobytes() + rows.tobytes())
            magic, status, n = RESPONSE_HEAD.unpack(recv_exact(sock, RESPONSE_HEAD.size))
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
            raise _PeerRefused(recv_exact(sock, n).decode(errors="replace"))
        want = int(rows["length"].sum(dtype=np.uint64))
        if status != OK or n != want:
            raise ConnectionError(f"response status {status} with {n} bytes, {want} asked")
        move_rows(sock, job.local[lo:hi], rows["length"], send=False, deadline=deadline)

    def _take(
        self, job: Job, deadline: float | None, optional: bool = False
    ) -> tuple[socket.socket | None, bool]:
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
            sock.sendall(REQUEST_HEAD.pack(LANE if optional else REQUEST, len(keys), 0) + keys.tobytes())
            got = RESPONSE_HEAD.unpack(recv_exact(sock, RESPONSE_HEAD.size))
            if got != (RESPONSE, OK, 0):
                raise ConnectionError(
                    "not this descriptor's stream server"
                    if got[:2] == (RESPONSE, REFUSED)
                    else "not a stream server"
                )
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


def jobs_for(
    streams: Mapping[int, tuple[Hashable, str, np.ndarray]],
    pidx: np.ndarray,
    region: np.ndarray,
    offset: np.ndarray,
    length: np.ndarray,
    local: np.ndarray,
) -> list[Job]:
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

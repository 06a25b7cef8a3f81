"""The serving side of streamed reads: one listening socket, one thread per connection.

A request is checked whole before a byte is sent (:meth:`StreamServer._check`): magic and
counts, then every region's stream key (constant-time compare), then every row's bounds inside
its region. A bad request gets REFUSED and the connection stays usable; a header out of step
with the protocol drops the connection. The regions' keep-alives (their torch storages) are held
until every byte of the answer is out, so an unregister during a send cannot free them.

Room: at most :data:`MAX_CONNECTIONS` connections; a new one past that evicts the longest-idle
connection idle for at least :data:`_EVICT_IDLE_S`, and extra lanes (LANE requests) are refused
while more than half the slots are in use.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from astate_store.transport.stream.wire import (
    IDLE_S,
    KEY_BYTES,
    KEY_DT,
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
    STALL_S,
    move_rows,
    recv_exact,
)

__all__ = ["Served", "StreamServer", "MAX_CONNECTIONS"]

# One logger for the stream package (the name it had as one module).
log = logging.getLogger("astate_store.transport.stream")

MAX_CONNECTIONS = 256  # open connections one server serves at once (see _EVICT_IDLE_S for a new one past it)
# A full server (MAX_CONNECTIONS) closes its longest-idle connection, idle at least this long, to
# admit a new one: pooled lanes of one consumer never lock the next consumer out (the evicted
# one's owner reconnects on its next pull, as after the idle timeout). Between the requests of one
# job a connection is idle for microseconds, so a job in progress is not cut.
_EVICT_IDLE_S = 1.0


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
            except TimeoutError:
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
                conn.settimeout(IDLE_S)
                head = conn.recv(REQUEST_HEAD.size)
                if not head:
                    return  # the consumer closed (or the connection was evicted): done
                self._mark(conn, idle=False)
                conn.settimeout(STALL_S)
                self._answer(conn, head + recv_exact(conn, REQUEST_HEAD.size - len(head)))
        except (OSError, ConnectionError) as exc:
            log.debug("stream connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, head: bytes) -> None:
        if len(head) != REQUEST_HEAD.size:
            raise ConnectionError("truncated request header")
        magic, n_keys, n_rows = REQUEST_HEAD.unpack(head)
        if (
            magic not in (REQUEST, LANE)
            or n_keys > MAX_KEYS
            or n_rows > MAX_ROWS
            or (magic == LANE and n_rows)
        ):
            # out of step with the peer (not our protocol, or absurd counts): drop the connection
            self._count(refused=1)
            raise ConnectionError(f"bad request header (magic {magic!r}, {n_keys} keys, {n_rows} rows)")
        keys = np.frombuffer(recv_exact(conn, n_keys * KEY_DT.itemsize), dtype=KEY_DT)
        rows = np.frombuffer(recv_exact(conn, n_rows * ROW_DT.itemsize), dtype=ROW_DT)
        if magic == LANE and self._crowded():
            msg = b"no room for another lane"
            conn.sendall(RESPONSE_HEAD.pack(RESPONSE, REFUSED, len(msg)) + msg)
            raise ConnectionError("an extra lane refused for room")  # and closed: it frees its slot
        try:
            bufs, total, keep = self._check(keys, rows)
        except _Refused as exc:
            self._count(refused=1)
            msg = str(exc).encode()[:4096]
            conn.sendall(RESPONSE_HEAD.pack(RESPONSE, REFUSED, len(msg)) + msg)
            return
        conn.sendall(RESPONSE_HEAD.pack(RESPONSE, OK, total))
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
        idle = [
            (since, c)
            for c, since in self._conns.items()
            if since is not None and now - since >= _EVICT_IDLE_S
        ]
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

    def _check(
        self, keys: np.ndarray, rows: np.ndarray
    ) -> tuple[tuple[np.ndarray, np.ndarray], int, list[Any]]:
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
        bad = (
            (pos >= len(known)) | (known[np.minimum(pos, len(known) - 1)] != region)
            if len(known)
            else np.ones(len(rows), dtype=bool)
        )
        if bad.any():
            raise _Refused(
                f"row {int(np.argmax(bad))}: region {int(region[np.argmax(bad)])} has no key in the request"
            )
        size = np.array([served[int(r)].size for r in known], dtype=np.uint64)[pos]
        base = np.array([served[int(r)].address for r in known], dtype=np.uint64)[pos]
        with np.errstate(over="ignore"):
            bad = (length == 0) | (off > size) | (length > size - off)
        if bad.any():
            i = int(np.argmax(bad))
            raise _Refused(
                f"row {i}: [{int(off[i])}, +{int(length[i])}) is empty or outside region "
                f"{int(region[i])} ({int(size[i])} bytes)"
            )
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

"""The wire format of streamed reads, and the socket loop that moves rows' bytes.

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

:func:`move_rows` sends or receives the bytes of rows in order, through the extension's
socket loop (GIL released), or ``move_all`` over memoryviews with ``ASTATE_STREAM_NATIVE=0``.
"""

from __future__ import annotations

import ctypes
import ipaddress
import secrets
import socket
import struct
import time
from collections.abc import Callable

import numpy as np

from astate_store.errors import TransportError
from astate_store.transport.binding import native
from astate_store.transport.config import env_on

__all__ = [
    "REQUEST",
    "RESPONSE",
    "LANE",
    "OK",
    "REFUSED",
    "KEY_BYTES",
    "REQUEST_HEAD",
    "RESPONSE_HEAD",
    "KEY_DT",
    "ROW_DT",
    "MAX_ROWS",
    "MAX_KEYS",
    "IDLE_S",
    "STALL_S",
    "new_key",
    "parse_address",
    "move_all",
    "move_rows",
    "arm",
    "recv_exact",
]

REQUEST, RESPONSE, LANE = b"ASTSRQ01", b"ASTSRS01", b"ASTSLN01"
OK, REFUSED = 0, 1
KEY_BYTES = 16
REQUEST_HEAD = struct.Struct("<8sII")  # magic, n_keys, n_rows
RESPONSE_HEAD = struct.Struct("<8sIQ")  # magic, status, n bytes
KEY_DT = np.dtype([("region", "<u4"), ("key", f"S{KEY_BYTES}")])
ROW_DT = np.dtype([("region", "<u4"), ("offset", "<u8"), ("length", "<u8")])
MAX_ROWS = 1 << 18  # rows per request (5 MiB of request); a longer plan sends several
MAX_KEYS = MAX_ROWS  # a request's rows name at most that many regions
_IOV = 1024  # buffers per sendmsg / recvmsg_into (Linux IOV_MAX)
# A receiver is woken once this much has arrived (SO_RCVLOWAT, capped at what is still expected):
# fewer wake-ups than one per segment; any mark in 256 KiB-1 MiB did alike (docs/performance.md).
_RCVLOWAT = 256 << 10
IDLE_S = 600.0  # a server connection with no request for this long is closed
STALL_S = 120.0  # no byte moving for this long: the peer is gone (also bounds get(timeout=None))


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
        raise TransportError(
            f"malformed transport descriptor: stream address {addr!r} is not 'ip:port'"
        ) from None
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
    return [view[o : o + k] for o, k in zip((a - np.uint64(lo)).tolist(), n.tolist())]


def move_all(call: Callable[[list[memoryview]], int], bufs: list[memoryview]) -> None:
    """Run ``call`` (sendmsg / recvmsg_into) over ``bufs`` until every byte moved, ``_IOV`` at a time."""
    for i in range(0, len(bufs), _IOV):
        batch = bufs[i : i + _IOV]
        while batch:
            n = call(batch)
            if n <= 0:
                raise ConnectionError("connection closed by the peer")
            while batch and n >= len(batch[0]):
                n -= len(batch[0])
                batch = batch[1:]
            if n:
                batch = [batch[0][n:], *batch[1:]]


def move_rows(
    sock: socket.socket, addr: np.ndarray, length: np.ndarray, send: bool, deadline: float | None = None
) -> None:
    """Send from (``send``) or receive into the rows ``(addr, length)``, in order, until every byte
    moved: the native loop (GIL released, no Python per call), or, with ``ASTATE_STREAM_NATIVE=0``,
    ``move_all`` over views. Waits at most ``STALL_S`` for a byte and never past ``deadline``
    (``time.monotonic()``). Raises TimeoutError, ConnectionError, OSError."""
    keep = length > 0  # an empty row moves nothing (and an all-empty batch would read as "closed")
    a, n = _segments(addr[keep], length[keep])
    if not len(a):
        return
    if not env_on("ASTATE_STREAM_NATIVE"):
        call = sock.sendmsg if send else (lambda b: sock.recvmsg_into(b)[0])

        def timed(b: list[memoryview]) -> int:
            arm(sock, deadline)
            return call(b)

        move_all(timed, _slices(a, n))
        return
    left = _until(deadline)
    rows = np.empty((len(a), 2), dtype=np.uint64)
    rows[:, 0], rows[:, 1] = a, n
    native().sock_rows(
        sock.fileno(), rows, send, timeout=-1.0 if left is None else left, stall=STALL_S, lowat=_RCVLOWAT
    )


def _until(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (None: no deadline); TimeoutError once it passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def arm(sock: socket.socket, deadline: float | None) -> None:
    """The socket's timeout for its next call: the stall budget, never past ``deadline``."""
    left = _until(deadline)
    sock.settimeout(STALL_S if left is None else min(STALL_S, left))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (ConnectionError when it closes first)."""
    buf = bytearray(n)
    if n:
        move_all(lambda b: sock.recv_into(b[0]), [memoryview(buf)])
    return bytes(buf)

"""Streamed reads over plain TCP: the data plane of pulls from peers that only tcp reaches.

Why: UCX's tcp transport has no one-sided reads; it emulates each ``ucp_get_nbx`` with a request the
publisher's progress thread answers, so a plan of 25k rows is 25k request/reply exchanges. Here a
pull sends one request per publisher, whose bytes stream back in plan order: bounded by the socket,
like a gloo broadcast of one contiguous buffer (``benchmarks/peers.py --transport tcp``; its figures
in docs/performance.md). The bytes move through the extension's socket loop (``move_rows``), not a
Python loop over memoryviews, which had cost as much CPU as the kernel's copies.

By role: ``wire`` (the request and response format, and the socket loop that moves rows'
bytes), ``server`` (:class:`StreamServer`: checks a request whole, then streams the rows back),
``client`` (:class:`StreamReader`: jobs per publisher, lanes, pooled connections, falling back
to UCX for a peer it cannot use).

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

from astate_store.transport.config import env_on
from astate_store.transport.stream.client import (
    Job,
    StreamReader,
    default_lanes,
    jobs_for,
    lanes_wanted,
    split_job,
)
from astate_store.transport.stream.server import MAX_CONNECTIONS, Served, StreamServer
from astate_store.transport.stream.wire import (
    KEY_BYTES,
    KEY_DT,
    LANE,
    OK,
    REFUSED,
    REQUEST,
    RESPONSE,
    ROW_DT,
    move_all,
    move_rows,
    new_key,
    parse_address,
)

__all__ = [
    "StreamServer",
    "StreamReader",
    "Served",
    "Job",
    "new_key",
    "enabled",
    "parse_address",
    "move_all",
    "move_rows",
    "jobs_for",
    "KEY_BYTES",
    "split_job",
    "lanes_wanted",
    "default_lanes",
    "REQUEST",
    "RESPONSE",
    "LANE",
    "KEY_DT",
    "ROW_DT",
    "OK",
    "REFUSED",
    "MAX_CONNECTIONS",
]


def enabled() -> bool:
    """Streamed reads on (default) unless ``ASTATE_STREAM=0``."""
    return env_on("ASTATE_STREAM")

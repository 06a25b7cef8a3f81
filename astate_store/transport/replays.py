"""Copy plans of recent same-host gets, kept so a steady pull repeats its copy without re-checking.

A steady pull hands the transport the same ops each time (the consumer's ready-made batch of a
staging slot; two alternate with the publisher's two slots). Checking and translating 65,589 rows
(the TP=1 benchmark's 2 GiB model: ``check_ops``, ``resolve_rows``, the host-only mask, the prefault
bookkeeping and the copy plan) is Python and numpy work per row on the pull's path, with nothing
copying meanwhile (and slower when another process takes the core). Where a get went whole through
mapped regions, its copy plan is kept here with the snapshots it was checked against; the same ops
under the same (identical, cached) peer and local snapshots would check and translate to the same
plan, so it is copied again as it is. Any change of peers, mappings or local registrations builds
new snapshots, and then nothing here matches.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from astate_store.transport.peers import PeerSnapshot
from astate_store.transport.regions import LocalSnapshot

__all__ = ["Replay", "Replays"]

# Two staging slots per publisher alternate; a few more leave room for stores sharing a transport.
_KEEP = 4


@dataclass(frozen=True)
class Replay:
    """One checked get: its ops as given (a private copy), the snapshots they were checked
    against, and what ran: the copy plan ``(src, dst, length)``, per row the peer's pid (for
    the exit check after the copy) and the copy threads."""

    ops: np.ndarray
    peers: PeerSnapshot
    local: LocalSnapshot
    plan: np.ndarray
    pids: np.ndarray
    threads: int | None


class Replays:
    """The last few :class:`Replay` entries, newest first.

    An entry holds its peer snapshot, and a snapshot holds the peers' mappings (``PeerTable``
    unmaps a region once no snapshot holds it): entries of any other snapshot go at the next
    lookup, and all of them whenever a peer is forgotten or remapped (:meth:`clear`), so a
    departed publisher's staging is not kept mapped from here."""

    def __init__(self, keep: int = _KEEP) -> None:
        self._items: deque[Replay] = deque(maxlen=keep)
        self._lock = threading.Lock()  # gets may run on several threads at once

    def find(self, ops: np.ndarray, peers: PeerSnapshot, local: LocalSnapshot) -> Replay | None:
        """The entry whose ops equal ``ops`` (same dtype, shape and every value: one vectorised
        comparison, far less work than checking the rows again) under these very snapshots (the
        current ones); None if there is none."""
        with self._lock:
            if any(r.peers is not peers or r.local is not local for r in self._items):
                kept = [r for r in self._items if r.peers is peers and r.local is local]
                self._items.clear()
                self._items.extend(kept)
            items = list(self._items)
        for r in items:
            if r.ops.shape == ops.shape and r.ops.dtype == ops.dtype and np.array_equal(r.ops, ops):
                return r
        return None

    def add(self, entry: Replay) -> None:
        with self._lock:
            self._items.appendleft(entry)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

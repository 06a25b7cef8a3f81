"""Deleting what namespaces hold on leases they share (a session hub's), for many closing
namespaces in a few round trips: a group commit.

A hub's stores share one lease, so closing one cannot revoke it: that namespace's records on the
shared leases are listed (keys only) and deleted, two round trips per close. Closing 1,000
sessions from 8 threads made that 2,000 round trips. Here closes that overlap queue up: the
first (the leader) lists up to ``_RANGES`` namespaces in one transaction and deletes their keys
in transactions of ``_DELETES``, for itself and the others, who wait for it. A lone close costs
the two round trips it did; every close still returns only once its records are gone.

Call sequence of one :meth:`RecordDrops.drop`:
  1. queue the namespace's prefix and leases;
  2. if no close leads, lead: take up to ``_RANGES`` queued, list them in one transaction, delete
     the keys held by their leases, wake their closers; again until nothing is queued;
  3. else wait until the leader has deleted this namespace's keys (or failed to).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pyetcd import transactions as tx

from astate_store.errors import CatalogError
from astate_store.etcd.client import EtcdClient

__all__ = ["RecordDrops"]

_RANGES = 64  # namespaces listed per transaction (etcd allows 128 operations)
_DELETES = 100  # deletes per transaction


@dataclass
class _Drop:
    prefix: str  # the namespace's key prefix ("/astate/<ns>/")
    leases: frozenset[int]  # its keys held by these leases go
    done: threading.Event = field(default_factory=threading.Event)  # set once handled, either way
    error: BaseException | None = None  # why its keys could not be deleted


class RecordDrops:
    """Group-committed deletes of closing namespaces' shared-lease records, over one client."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self._lock = threading.Lock()
        self._queue: list[_Drop] = []
        self._leading = False

    def drop(self, prefix: str, leases: frozenset[int]) -> None:
        """Delete the keys under ``prefix`` that ``leases`` hold; returns when they are deleted.

        Raises:
            CatalogError: they could not be (etcd unreachable within the client's retry budget).
        """
        item = _Drop(prefix, leases)
        with self._lock:
            self._queue.append(item)
            lead, self._leading = not self._leading, True
        if lead:
            self._lead()
        item.done.wait()
        if item.error is not None:
            raise item.error

    def _lead(self) -> None:
        """Handle queued drops until none is left (the closers queued meanwhile included)."""
        try:
            while True:
                with self._lock:
                    batch, self._queue = self._queue[:_RANGES], self._queue[_RANGES:]
                    if not batch:
                        self._leading = False
                        return
                self._run(batch)
        except BaseException as exc:  # e.g. KeyboardInterrupt in the leader: wake every closer
            with self._lock:
                rest, self._queue, self._leading = self._queue, [], False
            for d in rest:
                d.error = CatalogError(f"the close that led the record deletes stopped: {exc!r}")
                d.done.set()
            raise

    def _run(self, batch: list[_Drop]) -> None:
        try:
            resp = self.client.txn_raw(
                "list closing records", [], [self.client.keys_op(d.prefix) for d in batch]
            )
            keys = [
                kv.key
                for d, r in zip(batch, resp.responses)
                for kv in r.response_range.kvs
                if int(kv.lease) in d.leases
            ]
            for i in range(0, len(keys), _DELETES):
                self.client.txn("delete closing records", [], [tx.Delete(k) for k in keys[i : i + _DELETES]])
        except Exception as exc:  # CatalogError mostly; the closers raise it, not the leader alone
            for d in batch:
                d.error = exc
        finally:
            for d in batch:
                d.done.set()

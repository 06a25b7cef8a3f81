"""The UCX part of ``get``: the rows left run as one batched call, and its errors typed.

The extension's ``Worker.get`` takes the whole plan (endpoint and rkey positions,
remote and local addresses, lengths; optionally the local memory handle per row)
and keeps at most ``window`` ``ucp_get_nbx`` outstanding, with the GIL released.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from astate_store.errors import TransportError
from astate_store.process import pid_alive
from astate_store.transport.binding import native, typed_error
from astate_store.transport.peers import PeerSnapshot, PeerTable
from astate_store.transport.regions import LocalSnapshot
from astate_store.transport.rows import Rows
from astate_store.transport.same_host import ProcessIdentity

__all__ = ["UcxReader"]

_NO_MEMH = np.uint64(2**64 - 1)  # plan column 5: destination not inside a registered region


class UcxReader:
    """Runs rows through ``ucp_get_nbx``; names the peer behind a failure.

    ``lock`` is the transport's lock, taken only to look a failed peer up.
    """

    def __init__(self, worker: Any, peers: PeerTable, lock: threading.RLock, me: ProcessIdentity) -> None:
        self._worker = worker
        self._peers = peers
        self._lock = lock
        self._me = me

    def read(
        self, t: PeerSnapshot, lt: LocalSnapshot, rows: Rows, *, timeout: float | None, window: int
    ) -> None:
        """Read every row; returns when all landed. ``timeout`` None waits without bound."""
        plan = self._plan(t, lt, rows)
        try:
            self._worker.get(
                plan,
                t.eps,
                t.rkeys,
                lt.memhs if plan.shape[1] == 6 else None,
                -1.0 if timeout is None else max(0.0, float(timeout)),
                window,
            )
        except native().UcxError as exc:
            raise self._error(exc, t, plan) from exc

    @staticmethod
    def _plan(t: PeerSnapshot, lt: LocalSnapshot, rows: Rows) -> np.ndarray:
        """The extension's plan; a 6th column (local memh position) only with local registrations."""
        ncol = 6 if len(lt.memhs) else 5
        plan = np.empty((len(rows), ncol), dtype=np.uint64)
        plan[:, 0] = rows.ep_pos
        plan[:, 1] = t.rkey_pos[rows.flat]
        plan[:, 2] = rows.remote
        plan[:, 3] = rows.local
        plan[:, 4] = rows.length
        if ncol == 6:
            jj, inside = lt.containing(rows.local, rows.length)
            plan[:, 5] = np.where(inside, jj.astype(np.uint64), _NO_MEMH)
        return plan

    def _error(self, exc: BaseException, t: PeerSnapshot, plan: np.ndarray) -> TransportError:
        """The typed error: PeerUnreachable when the endpoint failed, the wait timed out,
        or a same-node peer's process is gone."""
        ep_i = getattr(exc, "endpoint", None)
        status = int(getattr(exc, "status", 0) or 0)
        if ep_i is None and status == native().ERR_TIMED_OUT:
            return typed_error(exc, f"reading {plan.shape[0]} ops", peer_gone=True)
        if ep_i is None:
            return typed_error(exc, f"reading {plan.shape[0]} ops")
        ep = t.eps[int(ep_i)]
        pi = int(np.argmax(t.ep_pos == int(ep_i)))
        key = t.keys[pi]
        with self._lock:
            p = self._peers.get(key)
        gone = bool(ep.failed)
        if p is not None and p.desc.pid and self._me.same_node(p.desc) and not pid_alive(p.desc.pid):
            gone = True
        who = f"peer {key!r}" + (f" (pid {p.desc.pid} on {p.desc.host})" if p is not None else "")
        if ep.failed and ep.error and ep.error not in str(exc):
            return typed_error(exc, f"reading from {who} [endpoint failed: {ep.error}]", peer_gone=gone)
        return typed_error(exc, f"reading from {who}", peer_gone=gone)

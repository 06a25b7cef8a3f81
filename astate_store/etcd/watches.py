"""Watch streams as the catalog needs them: a refused watch raises, and closing ends the stream.

:class:`Watcher` replaces pyetcd's watcher on every :class:`~astate_store.etcd.client.EtcdClient`
(``raw.get_watcher``); its callbacks always get an event or an exception, never None.
:func:`wait_for_event` is the one watch the client makes itself (``EtcdClient.wait_change``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pyetcd.etcdrpc as etcdrpc
import pyetcd.exceptions as etcd_exc
import pyetcd.watch as etcd_watch

from astate_store.errors import CatalogUnavailable
from astate_store.etcd.failures import RETRYABLE, WatchRefused, WatchStreamEnded

__all__ = ["WatchStub", "Watcher", "new_watcher", "wait_for_event"]


class WatchStub:
    """etcd's Watch stub, remembering the stream it opened (so :meth:`Watcher.close` can end it)."""

    def __init__(self, channel: Any):
        self._stub = etcdrpc.WatchStub(channel)
        self.call: Any = None

    def Watch(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (the gRPC method's name)
        self.call = self._stub.Watch(*args, **kwargs)
        return self.call


class Watcher(etcd_watch.Watcher):
    """pyetcd's watcher, plus: a watch etcd refuses (``created`` and ``canceled`` in one answer, what
    etcd does without read permission) raises :class:`WatchRefused` instead of looking created and
    never firing; :meth:`close` ends the stream (etcd keeps a stream open after the client stops
    sending, so pyetcd's close alone leaves it and its watches behind), and its callbacks get an
    exception (never None), so their owners re-watch on a new stream."""

    def close(self) -> None:
        super().close()
        call = getattr(self._watch_stub, "call", None)
        if call is not None:
            call.cancel()

    def add_callback(self, key: Any, callback: Callable[[Any], None], **kwargs: Any) -> Any:
        def cb(resp: Any) -> None:
            callback(WatchStreamEnded("watch stream ended") if resp is None else resp)

        return super().add_callback(key, cb, **kwargs)

    def _handle_response(self, rs: Any) -> None:
        if rs.created and rs.canceled and not rs.compact_revision:
            with self._lock:
                pending = self._new_watch
                if pending is not None and pending.id is None:
                    pending.err = WatchRefused(rs.cancel_reason)
                    self._new_watch_cond.notify_all()
            return
        super()._handle_response(rs)


def new_watcher(raw: Any) -> Watcher:
    """A watch stream for the endpoint ``raw`` (a pyetcd client) uses now, carrying its current token."""
    return Watcher(WatchStub(raw.channel), timeout=raw.timeout, call_credentials=None, metadata=raw.metadata)


T = TypeVar("T")


def wait_for_event(
    call: Callable[[str, Callable[[], T]], T],
    raw: Any,
    key: str,
    timeout: float | None,
    *,
    range_end: bytes | None = None,
    start_revision: int | None = None,
) -> None:
    """Wait for one watch event on ``key`` (to ``range_end``) after ``start_revision``, or the timeout.

    ``call`` is the client's retrying :meth:`~astate_store.etcd.client.EtcdClient.call`, ``raw``
    its pyetcd client. Returns early (after at most 5 s) even without an event: callers re-read and
    call again.
    """
    event = threading.Event()

    def cb(resp: Any) -> None:
        event.set()

    kwargs: dict[str, Any] = {}
    if range_end is not None:
        kwargs["range_end"] = range_end
    if start_revision is not None:
        kwargs["start_revision"] = start_revision
    try:
        wid = call(f"watch {key}", lambda: raw.add_watch_callback(key, cb, **kwargs))
    except etcd_exc.WatchTimedOut as exc:
        raise CatalogUnavailable(f"etcd watch on {key} could not be created: {exc}") from exc
    try:
        # Bounded so a lost watch stream (etcd restart) is re-established rather than waited on forever.
        event.wait(min(timeout, 5.0) if timeout is not None else 5.0)
    finally:
        try:
            raw.cancel_watch(wid)
        except RETRYABLE:
            pass

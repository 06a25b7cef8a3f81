"""The newest committed step of a namespace, kept current by a watch on its ``latest`` counter:
what ``Store.wait`` and every ``get_into`` ask first, answered without an etcd request in the
steady state."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from astate_store.catalog.records import Skips, counter_value
from astate_store.errors import CodecError, WaitTimeout
from astate_store.etcd.client import EtcdClient
from astate_store.model import codec

__all__ = ["LatestWatch"]

log = logging.getLogger("astate_store.catalog")


class LatestWatch:
    """The newest committed step, kept current by a watch on ``latest``, started at the second
    wait (the first is one read: a store that reads once never watches). Re-established (with
    one read) when the watch stream breaks, and re-read after a quiet wait of 5 s in case a
    watch is stuck without saying so. A value that is not a counter is skipped (counted in
    ``skips``) on the watch; :meth:`wait` raises ``CatalogCorrupted`` when a read finds one."""

    def __init__(self, client: EtcdClient, skips: Skips | None = None):
        self.client = client
        self.skips = skips
        self.key = client.key("latest")
        self._cond = threading.Condition()
        self._value: int | None = None
        self._watch: Any = None
        self._alive = False
        # the first wait is a plain read: a store that reads once and closes (an agent session
        # resuming) never opens a watch; the second wait starts it
        self._read_once = False
        self.blocked_at: deque[int | None] = deque(maxlen=16)

    def _on_event(self, resp: Any) -> None:
        with self._cond:
            if isinstance(resp, Exception):
                self._alive = False  # the stream ended (etcd restart, compaction): re-watch on next wait
            else:
                for ev in getattr(resp, "events", ()):
                    try:
                        v = codec.decode_counter(ev.value)
                    except CodecError as exc:
                        if self.skips is not None:
                            self.skips(self.key, f"not a counter: {exc}", getattr(ev, "mod_revision", None))
                        continue
                    if v is not None and (self._value is None or v > self._value):
                        self._value = v
            self._cond.notify_all()

    def _read(self) -> int:
        """Read ``latest`` (no watch); returns the revision read at."""
        resp = self.client.call("get latest", lambda: self.client.raw.get_response(self.key))
        value = counter_value(self.key, resp.kvs[0].value) if resp.kvs else None
        with self._cond:
            if value is not None and (self._value is None or value > self._value):
                self._value = value
        return int(resp.header.revision)

    def _refresh(self) -> None:
        """Read ``latest`` and (re)start the watch right after the revision read."""
        rev = self._read()
        with self._cond:
            if not self._alive:
                old, self._watch = self._watch, None
                if old is not None:
                    try:
                        self.client.raw.cancel_watch(old)
                    except Exception:  # the old stream is already gone
                        pass
                self._watch = self.client.call(
                    "watch latest",
                    lambda: self.client.raw.add_watch_callback(
                        self.key, self._on_event, start_revision=rev + 1
                    ),
                )
                self._alive = True

    def wait(self, min_step: int | None, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self._alive and not self._read_once:
                self._read_once = True
                self._read()
                with self._cond:
                    v = self._value
                    if v is not None and (min_step is None or v >= min_step):
                        return v
            if not self._alive:
                self._refresh()
            with self._cond:
                v = self._value
                if v is not None and (min_step is None or v >= min_step):
                    return v
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    want = "any version" if min_step is None else f"a version >= {min_step}"
                    raise WaitTimeout(
                        f"namespace {self.client.namespace!r}: {want} was not committed within "
                        f"{timeout}s (latest is {v})"
                    )
                self.blocked_at.append(v)
                woke = self._cond.wait(5.0 if remaining is None else min(remaining, 5.0))
            if not woke:
                self._refresh()  # a quiet 5 s: make sure the watch did not silently miss a commit

    def close(self) -> None:
        with self._cond:
            w, self._watch, self._alive = self._watch, None, False
        if w is not None:
            try:
                self.client.raw.cancel_watch(w)
            except Exception:  # closing: the stream may already be gone
                pass

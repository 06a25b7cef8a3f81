"""Ending reads off the pull's path: a read whose bytes its step words proved untorn
(``get/step_words.py``) still unregisters (so a publisher retiring the step stops waiting for it)
and marks the step delivered (for drains), but the pull does not wait for that transaction.

Call sequence:
  1. ``Readers.end_read_later`` queues the end here and returns;
  2. a daemon thread (started on the first end) runs ``Readers.end_read`` for each, in order;
  3. ``Readers.begin_read`` of the same (step, reader) waits for its queued end first (the
     end deletes the reader record by key), and ``Catalog.close`` flushes what is queued.

An end that fails (etcd unreachable past the retry budget) is logged: the record goes with the
reader's lease, and a publisher waiting for it meanwhile marks the step torn, which this read no
longer cares about.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from astate_store.catalog.client import background_thread

__all__ = ["ReadEnds"]

log = logging.getLogger("astate_store.catalog")

_CLOSE_WAIT = 5.0  # seconds a close waits for the queued ends

Key = tuple[int, str]  # (step, reader id)
End = tuple[int, str, "frozenset[object] | None"]  # (step, reader id, sources)


class ReadEnds:
    """Queued ends of reads, run in order on one daemon thread. ``end``: ``Readers.end_read``."""

    def __init__(self, end: Callable[[int, str, frozenset[object] | None], bool], name: str):
        self._end, self._name = end, name
        self._cond = threading.Condition()
        self._queue: deque[End] = deque()
        self._keys: dict[Key, int] = {}  # queued or running ends per key
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failed = 0  # ends that raised (logged)

    def submit(self, step: int, reader_id: str, sources: frozenset[object] | None) -> None:
        """Queue the end of this read (run inline once closed: nothing is left behind)."""
        with self._cond:
            if not self._closed:
                self._queue.append((step, reader_id, sources))
                self._keys[(step, reader_id)] = self._keys.get((step, reader_id), 0) + 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify_all()
                return
        self._run_one((step, reader_id, sources))

    def wait(self, step: int, reader_id: str, timeout: float = _CLOSE_WAIT) -> bool:
        """Until no end of (step, reader) is queued or running; False on timeout."""
        key = (step, reader_id)
        with self._cond:
            if key not in self._keys:
                return True
            return self._cond.wait_for(lambda: key not in self._keys, timeout)

    def flush(self, timeout: float = _CLOSE_WAIT) -> bool:
        """Until every end queued so far has run; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._keys, timeout)

    def close(self, timeout: float = _CLOSE_WAIT) -> bool:
        """Flush, then stop the thread (later ends run inline)."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    def _run(self) -> None:
        background_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                item = self._queue.popleft()
            try:
                self._run_one(item)
            finally:
                with self._cond:
                    key = (item[0], item[1])
                    left = self._keys[key] - 1
                    if left:
                        self._keys[key] = left
                    else:
                        del self._keys[key]
                    self._cond.notify_all()

    def _run_one(self, item: End) -> None:
        step, reader_id, sources = item
        try:
            self._end(step, reader_id, sources)
        except Exception as exc:  # noqa: BLE001 -- a background end must not end the thread
            self.failed += 1
            log.warning(
                "ending the read of step %d by %s failed (%s: %s); its record goes with its lease",
                step,
                reader_id,
                type(exc).__name__,
                exc,
            )

"""Ending reads off the pull's path: a read whose bytes its step words proved untorn
(``get/step_words.py``) still unregisters (so a publisher retiring the step stops waiting for it)
and marks the step delivered (for drains), but the pull does not wait for that transaction.

Call sequence:
  1. ``Readers.end_read_later`` queues the end here and returns;
  2. one daemon thread per process (started on the first end; a session hub's thousands of
     stores share it) runs ``Readers.end_read`` for each, in the order they were queued;
  3. ``Readers.begin_read`` of the same (step, reader) waits for its queued end first (the
     end deletes the reader record by key), and ``Catalog.close`` flushes its own ends.

An end that fails (etcd unreachable past the retry budget) is logged: the record goes with the
reader's lease, and a publisher waiting for it meanwhile marks the step torn, which this read no
longer cares about.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable

from astate_store.etcd.client import background_thread

__all__ = ["ReadEnds"]

log = logging.getLogger("astate_store.catalog")

_CLOSE_WAIT = 5.0  # seconds a close waits for the queued ends

Key = tuple[int, str]  # (step, reader id)
End = tuple["ReadEnds", int, str, "frozenset[object] | None"]  # (owner, step, reader id, sources)

_cond = threading.Condition()  # guards everything below and every ReadEnds' counts
_queue: deque[End] = deque()
_thread: tuple[int, threading.Thread] | None = None  # (pid, the thread): a forked child starts its own
_owners: weakref.WeakSet[ReadEnds] = weakref.WeakSet()  # to forget their parent's ends after a fork


def _after_fork_in_child() -> None:
    """A forked child inherits no thread, and maybe a lock its parent's thread held: start afresh
    (its parent's queued ends are its parent's)."""
    global _cond, _queue, _thread
    _cond, _queue, _thread = threading.Condition(), deque(), None
    for owner in list(_owners):
        owner.forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _run() -> None:
    background_thread()
    while True:
        with _cond:
            _cond.wait_for(lambda: bool(_queue))
            owner, step, reader_id, sources = _queue.popleft()
        try:
            owner.run_one(step, reader_id, sources)
        finally:
            with _cond:
                owner.done((step, reader_id))
                _cond.notify_all()


class ReadEnds:
    """One namespace's queued ends of reads. ``end``: ``Readers.end_read``."""

    def __init__(self, end: Callable[[int, str, frozenset[object] | None], bool]):
        self._end = end
        self._keys: dict[Key, int] = {}  # queued or running ends per key (under _cond)
        self._closed = False
        self.failed = 0  # ends that raised (logged)
        _owners.add(self)

    def forget(self) -> None:
        """In a forked child: the parent's queued ends are not this process's to wait for."""
        self._keys = {}

    def submit(self, step: int, reader_id: str, sources: frozenset[object] | None) -> None:
        """Queue the end of this read (run inline once closed: nothing is left behind)."""
        global _thread
        with _cond:
            if not self._closed:
                key = (step, reader_id)
                self._keys[key] = self._keys.get(key, 0) + 1
                _queue.append((self, step, reader_id, sources))
                if _thread is None or _thread[0] != os.getpid():
                    t = threading.Thread(target=_run, name="astate-read-ends", daemon=True)
                    t.start()
                    _thread = (os.getpid(), t)
                _cond.notify_all()
                return
        self.run_one(step, reader_id, sources)

    def wait(self, step: int, reader_id: str, timeout: float = _CLOSE_WAIT) -> bool:
        """Until no end of (step, reader) is queued or running; False on timeout."""
        key = (step, reader_id)
        with _cond:
            if key not in self._keys:
                return True
            return _cond.wait_for(lambda: key not in self._keys, timeout)

    def flush(self, timeout: float = _CLOSE_WAIT) -> bool:
        """Until every end queued here so far has run; False on timeout."""
        with _cond:
            return _cond.wait_for(lambda: not self._keys, timeout)

    def close(self, timeout: float = _CLOSE_WAIT) -> bool:
        """Flush; later ends run inline."""
        done = self.flush(timeout)
        with _cond:
            self._closed = True
        return done

    def done(self, key: Key) -> None:
        """One end of ``key`` has run (``_cond`` held)."""
        left = self._keys[key] - 1
        if left:
            self._keys[key] = left
        else:
            del self._keys[key]

    def run_one(self, step: int, reader_id: str, sources: frozenset[object] | None) -> None:
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

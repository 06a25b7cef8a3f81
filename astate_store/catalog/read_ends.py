"""Ending reads off the pull's path: a read whose bytes its step words proved untorn
(``get/step_words.py``) still unregisters (so a publisher retiring the step stops waiting for it)
and marks the step delivered (for drains), but the pull does not wait for that transaction.

Call sequence:
  1. ``Readers.end_read_later`` queues the end here and returns;
  2. one serial worker per process (``background.py``: its thread starts on the first end; a
     session hub's thousands of stores share it) runs ``Readers.end_read`` for each, in the
     order they were queued;
  3. ``Readers.begin_read`` of the same (step, reader) waits for its queued end first (the
     end deletes the reader record by key), and ``Catalog.close`` flushes its own ends.

An end that fails (etcd unreachable past the retry budget) is logged: the record goes with the
reader's lease, and a publisher waiting for it meanwhile marks the step torn, which this read no
longer cares about.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from astate_store.background import SerialWorker

__all__ = ["ReadEnds"]

log = logging.getLogger("astate_store.catalog")

_CLOSE_WAIT = 5.0  # seconds a close waits for the queued ends

# One per process (a forked child's starts afresh: its parent's queued ends are its parent's).
_WORKER = SerialWorker("astate-read-ends")


class ReadEnds:
    """One namespace's queued ends of reads. ``end``: ``Readers.end_read``."""

    def __init__(self, end: Callable[[int, str, frozenset[object] | None], bool]):
        self._end = end
        self._closed = False
        self.failed = 0  # ends that raised (logged)

    def submit(self, step: int, reader_id: str, sources: frozenset[object] | None) -> None:
        """Queue the end of this read (run inline once closed: nothing is left behind)."""
        job = partial(self.run_one, step, reader_id, sources)
        if self._closed or not _WORKER.submit(job, self, (self, step, reader_id)):
            job()

    def wait(self, step: int, reader_id: str, timeout: float = _CLOSE_WAIT) -> bool:
        """Until no end of (step, reader) is queued or running; False on timeout."""
        return _WORKER.wait((self, step, reader_id), timeout)

    def flush(self, timeout: float = _CLOSE_WAIT) -> bool:
        """Until every end queued here so far has run; False on timeout."""
        return _WORKER.wait(self, timeout)

    def close(self, timeout: float = _CLOSE_WAIT) -> bool:
        """Flush; later ends run inline."""
        done = self.flush(timeout)
        self._closed = True
        return done

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

"""Progress of long operations: a callback ``progress(done_bytes, total_bytes)``.

Checkpoint, restore, safetensors import/export and the first pull of a big model take a
``progress`` argument: any callable of two ints (a :class:`Progress`), or None. It is called
with the bytes done so far and the bytes the operation will move in all — first with
``(0, total)``, last with ``(total, total)`` when the operation succeeds — and ``done`` never
goes down. It may be called from worker threads (restore copies on several), so a callback
must be thread-safe; one that raises is logged and then no longer called (a broken progress
bar must never fail a checkpoint). The CLI shows these as rich progress bars.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

__all__ = ["Progress", "ProgressCounter"]

log = logging.getLogger("astate_store")

T = TypeVar("T")


@runtime_checkable
class Progress(Protocol):
    """What a ``progress=`` argument is: called as ``progress(done_bytes, total_bytes)``."""

    def __call__(self, done: int, total: int) -> None: ...


class ProgressCounter:
    """Accumulates bytes done from any thread and reports them to a :class:`Progress`.

    ``ProgressCounter(None, n)`` is a no-op, so callers need no ``if progress`` branches.
    """

    def __init__(self, progress: Progress | None, total: int, done: int = 0):
        self._progress = progress
        self.total = max(0, int(total))
        self.done = min(self.total, max(0, int(done)))  # an operation's later phase starts past 0
        self._lock = threading.Lock()
        self._report(self.done)

    def _report(self, done: int) -> None:
        cb = self._progress
        if cb is None:
            return
        try:
            cb(done, self.total)
        except Exception as exc:  # a progress display must never fail the operation it shows
            log.warning(
                "progress callback %r failed (%s: %s); it is no longer called", cb, type(exc).__name__, exc
            )
            self._progress = None

    def add(self, nbytes: int) -> None:
        """``nbytes`` more are done (capped at the total)."""
        if self._progress is None or nbytes <= 0:
            return
        with self._lock:
            self.done = min(self.total, self.done + int(nbytes))
            done = self.done
            # Reported under the lock: calls reach the callback in order, so ``done`` never goes down.
            self._report(done)

    def finish(self) -> None:
        """The operation succeeded: report ``(total, total)``."""
        with self._lock:
            if self.done < self.total:
                self.done = self.total
                self._report(self.total)

    def chunks(self, items: Iterable[T], size: Callable[[T], int]) -> Iterator[T]:
        """``items`` unchanged; each one counts as done (``size(item)`` bytes) once the consumer
        asks for the next, i.e. after it was written."""
        for item in items:
            yield item
            self.add(size(item))

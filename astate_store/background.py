"""One serial background worker: jobs run off the callers' paths, one at a time, in the order
they were submitted. Ends of reads (``catalog/read_ends.py``), retention after commits
(``catalog/background.py``), unmapping and prefaulting peer mappings (``transport/memfd.py``)
each run on one. It imports nothing of the package, so the catalog and the transport may both
use it.

Lifecycle of a :class:`SerialWorker`:
  1. made: nothing starts (an idle worker costs no thread);
  2. the first :meth:`~SerialWorker.submit` in a process starts its daemon thread, which runs
     the queued jobs in FIFO order; a job that raises is logged and the thread goes on;
  3. in a forked child (which inherits no thread, and maybe a lock its parent's thread held) the
     worker starts afresh: an empty queue, new locks, a new thread at the child's first submit
     (the parent's queued jobs are the parent's);
  4. :meth:`~SerialWorker.wait` waits until no job carrying a tag (or none at all) is queued or
     running: for closes that must not leave work behind, and for tests;
  5. :meth:`~SerialWorker.close` drops what is queued, waits (bounded) for the job in progress and
     the thread, and refuses later submits (their callers then do the work inline).

A job may carry tags (any hashable: an owner, a key): :meth:`~SerialWorker.wait` and
:meth:`~SerialWorker.cancel` select jobs by tag. A job's references are dropped once it has run.
The worker's threads count as background work (:func:`in_background`: the etcd client counts
their requests apart from the callers').
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Hashable

__all__ = ["SerialWorker", "in_background"]

log = logging.getLogger("astate_store")

_MARK = threading.local()  # .active on the workers' threads


def in_background() -> bool:
    """Whether the calling thread is a worker's (its etcd requests count as background work)."""
    return getattr(_MARK, "active", False)


Job = Callable[[], None]


class SerialWorker:
    """A daemon thread running submitted jobs one at a time, in submission order (see the module
    docstring for its lifecycle)."""

    def __init__(self, name: str) -> None:
        self.name = name  # its thread's name
        self._closed = False
        self._fresh()
        _WORKERS.add(self)

    def _fresh(self) -> None:
        """A new process's state: nothing queued or running, no thread."""
        # Re-entrant: a collection while the lock is held may run a __del__ that submits.
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[tuple[Job, tuple[Hashable, ...]]] = deque()
        self._tags: Counter[Hashable] = Counter()  # jobs queued or running, per tag
        self._queued: Counter[Hashable] = Counter()  # jobs queued and not started, per tag
        self._jobs = 0  # jobs queued or running
        self._thread: threading.Thread | None = None

    def submit(self, job: Job, *tags: Hashable, coalesce: bool = False) -> bool:
        """Queue ``job``; True when it (or, with ``coalesce``, an earlier one) will run. With
        ``coalesce``: nothing is queued while a job carrying the first tag waits unstarted (its
        run does what this one would). False when no thread can run it (the worker is closed, or
        the interpreter is shutting down): the caller does the work inline or not at all."""
        if sys.is_finalizing():
            return False
        with self._cond:
            if self._closed:
                return False
            if coalesce and self._queued[tags[0]]:
                return True
            if self._thread is None:
                try:
                    t = threading.Thread(target=self._run, name=self.name, daemon=True)
                    t.start()
                except RuntimeError:  # "can't create new thread at interpreter shutdown"
                    return False
                self._thread = t
            self._queue.append((job, tags))
            self._jobs += 1
            self._tags.update(tags)
            self._queued.update(tags)
            self._cond.notify_all()
        return True

    def queued(self, tag: Hashable) -> bool:
        """Whether a job carrying ``tag`` waits unstarted."""
        with self._cond:
            return self._queued[tag] > 0

    def running(self, tag: Hashable) -> bool:
        """Whether a job carrying ``tag`` is running now."""
        with self._cond:
            return self._tags[tag] > self._queued[tag]

    def cancel(self, tag: Hashable) -> int:
        """Drop the queued (unstarted) jobs carrying ``tag``; returns how many."""
        with self._cond:
            keep = [item for item in self._queue if tag not in item[1]]
            dropped = [item for item in self._queue if tag in item[1]]
            self._queue = deque(keep)
            for _job, tags in dropped:
                self._forget(tags, started=False)
            self._cond.notify_all()
            return len(dropped)

    def wait(self, tag: Hashable | None = None, timeout: float | None = None) -> bool:
        """Until no job carrying ``tag`` (None: no job at all) is queued or running; False on
        timeout."""
        with self._cond:
            if tag is None:
                return self._cond.wait_for(lambda: not self._jobs, timeout)
            return self._cond.wait_for(lambda: not self._tags[tag], timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Drop what is queued, refuse later submits, and wait up to ``timeout`` seconds for the job
        in progress and the thread to end."""
        with self._cond:
            self._closed = True
            for _job, tags in self._queue:
                self._forget(tags, started=False)
            self._queue.clear()
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        _MARK.active = True
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:  # closed
                    return
                job, tags = self._queue.popleft()
                for t in tags:
                    self._queued[t] -= 1
                    if not self._queued[t]:
                        del self._queued[t]
            try:
                job()
            except Exception as exc:  # noqa: BLE001 -- a job's failure must not end the thread
                log.warning("background job on %s failed: %s: %s", self.name, type(exc).__name__, exc)
            finally:
                del job  # drop what it held (a mapping to unmap) before waiting for the next
                with self._cond:
                    self._forget(tags, started=True)
                    self._cond.notify_all()

    def _forget(self, tags: tuple[Hashable, ...], *, started: bool) -> None:
        """One job carrying ``tags`` is done or dropped (``_cond`` held)."""
        self._jobs -= 1
        for t in tags:
            self._tags[t] -= 1
            if not self._tags[t]:
                del self._tags[t]
            if not started:
                self._queued[t] -= 1
                if not self._queued[t]:
                    del self._queued[t]


_WORKERS: weakref.WeakSet[SerialWorker] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for w in list(_WORKERS):
        w._fresh()


os.register_at_fork(after_in_child=_after_fork_in_child)

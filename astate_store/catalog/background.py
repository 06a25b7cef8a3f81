"""Background work off the callers' paths: a daemon thread that runs jobs after they are poked.

Retention runs here after each commit. A ``Runner`` serves one namespace (``Versions``' own, by
default) or many (a ``SessionHub``'s, one thread for thousands of sessions): pokes of one job are
coalesced, jobs run in the order they were poked, and the thread starts at the first poke.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from astate_store.etcd.client import background_thread

__all__ = ["Runner", "Job", "own_job"]

log = logging.getLogger("astate_store.catalog")

_CLOSE_WAIT = 5.0  # seconds a close waits for a run in progress, and for the thread to end


class Job:
    """One job on a runner: what ``Versions`` pokes after a commit and flushes for tools."""

    def __init__(self, runner: Runner, name: str, fn: Callable[[], None], *, owns_runner: bool = False):
        self.runner, self.name, self.fn, self._owns = runner, name, fn, owns_runner
        self.pending = self.busy = self.closed = False

    def poke(self) -> None:
        self.runner.poke(self)

    def wait_idle(self, timeout: float) -> bool:
        """True once no run of this job is pending or in progress (or it is closed)."""
        with self.runner.cond:
            return self.runner.cond.wait_for(lambda: self.closed or not (self.pending or self.busy), timeout)

    def close(self) -> None:
        with self.runner.cond:
            self.closed = True
            self.pending = False
            self.runner.cond.wait_for(lambda: not self.busy, _CLOSE_WAIT)  # a run in progress finishes first
        if self._owns:
            self.runner.close()


class Runner:
    """A daemon thread running its jobs after their pokes (coalesced per job, in poke order)."""

    def __init__(self, name: str):
        self.name = name
        self.cond = threading.Condition()
        self._queue: list[Job] = []
        self._stopped = False
        self._thread: threading.Thread | None = None

    def job(self, name: str, fn: Callable[[], None]) -> Job:
        return Job(self, name, fn)

    def poke(self, job: Job) -> None:
        with self.cond:
            if job.closed or self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            if not job.pending:
                job.pending = True
                self._queue.append(job)
            self.cond.notify_all()

    def _run(self) -> None:
        background_thread()
        while True:
            with self.cond:
                while not self._queue and not self._stopped:
                    self.cond.wait()
                if self._stopped:
                    return
                job = self._queue.pop(0)
                if not job.pending:  # closed while queued
                    continue
                job.pending, job.busy = False, True
            try:
                job.fn()
            except Exception as exc:  # retention is best effort: it runs again after the next commit
                log.warning("%s failed: %s", job.name, exc)
            finally:
                with self.cond:
                    job.busy = False
                    self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self._stopped = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=_CLOSE_WAIT)


def own_job(name: str, fn: Callable[[], None]) -> Job:
    """A job on a runner of its own (one namespace's thread), closed together with it."""
    return Job(Runner(name), name, fn, owns_runner=True)

"""Background work off the callers' paths: jobs run on a serial worker after they are poked.

Retention runs here after each commit. A ``Runner`` (one ``SerialWorker``: ``background.py``)
serves one namespace (``Versions``' own, by default) or many (a ``SessionHub``'s, one thread for
thousands of sessions): pokes of one job are coalesced, jobs run in the order they were poked,
and the thread starts at the first poke.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from astate_store.background import SerialWorker

__all__ = ["Runner", "Job", "own_job"]

log = logging.getLogger("astate_store.catalog")

_CLOSE_WAIT = 5.0  # seconds a close waits for a run in progress, and for the thread to end


class Job:
    """One job on a runner: what ``Versions`` pokes after a commit and flushes for tools."""

    def __init__(self, runner: Runner, name: str, fn: Callable[[], None], *, owns_runner: bool = False):
        self.runner, self.name, self.fn, self._owns = runner, name, fn, owns_runner
        self.closed = False

    @property
    def pending(self) -> bool:
        """A run is queued and not started."""
        return self.runner.worker.queued(self)

    @property
    def busy(self) -> bool:
        """A run is in progress."""
        return self.runner.worker.running(self)

    def poke(self) -> None:
        """Run the job soon (once for every poke made before that run starts)."""
        if not self.closed:
            self.runner.worker.submit(self._run, self, coalesce=True)

    def _run(self) -> None:
        if self.closed:
            return
        try:
            self.fn()
        except Exception as exc:  # retention is best effort: it runs again after the next commit
            log.warning("%s failed: %s", self.name, exc)

    def wait_idle(self, timeout: float) -> bool:
        """True once no run of this job is pending or in progress (or it is closed)."""
        return self.closed or self.runner.worker.wait(self, timeout)

    def close(self) -> None:
        """No run after this one; a run in progress finishes first (bounded)."""
        self.closed = True
        self.runner.worker.cancel(self)
        self.runner.worker.wait(self, _CLOSE_WAIT)
        if self._owns:
            self.runner.close()


class Runner:
    """A serial worker running its jobs after their pokes (coalesced per job, in poke order)."""

    def __init__(self, name: str):
        self.name = name
        self.worker = SerialWorker(name)

    def job(self, name: str, fn: Callable[[], None]) -> Job:
        return Job(self, name, fn)

    def close(self) -> None:
        """Drop queued runs, wait (bounded) for the one in progress; later pokes are ignored."""
        self.worker.close(_CLOSE_WAIT)


def own_job(name: str, fn: Callable[[], None]) -> Job:
    """A job on a runner of its own (one namespace's thread), closed together with it."""
    return Job(Runner(name), name, fn, owns_runner=True)

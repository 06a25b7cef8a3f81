"""How tests start their child processes: a fork server with torch and the store imported once.

A spawned child imports torch and astate_store afresh: 4-5 s of CPU each on the 2-core CI
machine, and the suite starts well over a hundred children (publishers, consumers, ranks), so
spawning alone took minutes of ``make test``. A fork-server child is a fork of one clean
interpreter that imported them (no thread of ours, no UCX context, no etcd connection: those
are made in the child, as with spawn) and starts in ~0.05 s.

What differs from spawn, and is made the same here: a fork-server child inherits the fork
server's environment and stdout/stderr (from when it started, in some earlier test), not the
test's current ones. So each child takes the starting process's ``os.environ`` (tests set
``ASTATE_*`` / ``UCX_*`` for their children) and its fds 1 and 2 (pytest captures them per
test) with it. The working directory, ``sys.path`` and the main module travel as with spawn.
Children are the fork server's, not the test process's: tests signal and join them by their
``Process`` object, as before.
"""

from __future__ import annotations

import multiprocessing.context as mpc
import os
from multiprocessing import reduction
from typing import Any

# What every child imports anyway; imported once in the fork server (an import that fails there
# is skipped by multiprocessing and happens in the child instead).
PRELOAD = [
    "torch",
    "torch.distributed",
    "astate_store",
    "astate_store.store",
    "astate_store.checkpoint",
    "tests._store_workers",
    "tests._catalog_workers",
    "tests._checkpoint_workers",
    "tests._dtensor_workers",
]


class _Stdio:
    """The starter's stdout and stderr, for the child's fds 1 and 2. Pickled only while the
    process object goes to the fork server, which then hands the child duplicates."""

    def __init__(self, fds: tuple[int, ...] = ()) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _stdio_of, (reduction.DupFd(1), reduction.DupFd(2))

    def install(self) -> None:
        for target, fd in zip((1, 2), self.fds):
            os.dup2(fd, target)
            os.close(fd)


def _stdio_of(*dups: Any) -> _Stdio:
    return _Stdio(tuple(d.detach() for d in dups))


class _Process(mpc.ForkServerProcess):
    """A fork-server process that runs with the environment and the stdout/stderr its starter
    had at ``start()``, as a spawned one would."""

    _environ: dict[str, str]
    _stdio: _Stdio

    def start(self) -> None:
        # both pickled with the process object when it goes to the fork server
        self._environ, self._stdio = dict(os.environ), _Stdio()
        super().start()

    def run(self) -> Any:
        self._stdio.install()
        os.environ.clear()
        os.environ.update(self._environ)
        return super().run()


class _Context(mpc.ForkServerContext):
    Process = _Process  # type: ignore[assignment]


CTX = _Context()
CTX.set_forkserver_preload(PRELOAD)

"""The detached supervisor of the shared embedded etcd (see :mod:`astate_store.etcd.supervisor`).

:class:`Supervisor` owns one etcd (:class:`_SupervisedEtcd`, which gets SIGTERM if the supervisor
dies) and stops it once no participant has held its lock for the idle grace. It runs in the process
:func:`astate_store.etcd.supervisor.main` starts, which imports the package without its ``__init__``:
this module imports only the stdlib, :mod:`astate_store.errors` and :mod:`astate_store.etcd.embedded`.
:mod:`astate_store.etcd.supervisor` imports it (for :class:`Supervisor` and the rendezvous record's
reader), never the other way round.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astate_store.errors import UnsafeRendezvousError
from astate_store.etcd.embedded import EmbeddedEtcd, log_tail

log = logging.getLogger("astate_store.etcd")

# The rendezvous file in the rendezvous dir; both this module and the processes that join read it.
RENDEZVOUS_FILE = "embedded-etcd.json"


def run_dir_of(home: Path, supervisor_pid: int) -> Path:
    # Derived from the pid, never read from the rendezvous file.
    return home / f"embedded-etcd-{int(supervisor_pid)}"


def read_info(path: Path) -> dict[str, Any] | None:
    """The rendezvous record; None when absent or unreadable.

    Raises:
        UnsafeRendezvousError: the file is a symlink, not ours, or writable by group or others.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRendezvousError(
                f"the embedded etcd's rendezvous file {path} is a symbolic link: not "
                f"trusting it; remove it (`rm {path}`)"
            ) from None
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise UnsafeRendezvousError(
                f"the embedded etcd's rendezvous file {path} is not a private file of this user (owner uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}; this is uid {os.getuid()}): not trusting "
                f"the etcd it names; remove it (`rm {path}`) and check who else can write to {path.parent}"
            )
        data = f.read(1 << 20)
    try:
        info = json.loads(data)
        return info if isinstance(info, dict) else None
    except ValueError:
        return None


# ---- the shared embedded etcd: the supervisor ---------------------------------------------------


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn: the child gets SIGTERM when the process that started it dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class _SupervisedEtcd(EmbeddedEtcd):
    def _spawn(self, cmd: list[str], logf: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=logf,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )


class Supervisor:
    """Owns one etcd; stops it once no participant has been alive for ``grace`` seconds."""

    def __init__(self, home: Path, grace: float, binary: str | None = None):
        self.home, self.grace, self.me, self.binary = home, grace, os.getpid(), binary
        self.run_dir = run_dir_of(home, self.me)
        self.pdir = self.run_dir / "participants"
        self.rendezvous = home / RENDEZVOUS_FILE  # as supervisor._rendezvous_file(home)
        self.stopping = threading.Event()
        self.etcd: _SupervisedEtcd | None = None
        self.withdrawn = False
        self._ready_fd = -1
        self._alive_fd = -1
        self._last: list[int] | None = None

    def _withdraw(self) -> None:
        """Remove the rendezvous file if it names this supervisor. Rendezvous lock held."""
        try:
            info = read_info(self.rendezvous)
        except UnsafeRendezvousError as exc:  # not ours to remove
            log.warning("%s", exc)
            return
        if info is not None and info.get("supervisor") == self.me:
            self.rendezvous.unlink(missing_ok=True)

    def _sweep(self) -> list[int]:
        """Pids of live participants; removes the files of dead ones. Rendezvous lock held."""
        live = []
        for entry in self.pdir.iterdir():
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(int(entry.name) if entry.name.isdigit() else -1)
                continue
            finally:
                os.close(fd)
            entry.unlink(missing_ok=True)  # nobody holds it: that participant is gone
        return sorted(live)

    def _check(self, idle_for: float) -> bool | None:
        """True when participants live; False when idle past the grace (rendezvous file removed:
        nobody can join any more); None otherwise (idle within the grace, or the rendezvous lock is
        busy: someone is joining)."""
        with open(str(self.rendezvous) + ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            live = self._sweep()
            if live != self._last:
                log.info("participants: %d %s", len(live), live)
                self._last = live
            if live:
                return True
            if idle_for >= self.grace:
                self._withdraw()
                self.withdrawn = True
                return False
            return None

    def _withdraw_locked(self, wait: float = 10.0) -> None:
        with open(str(self.rendezvous) + ".lock", "a") as lock:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("rendezvous lock busy for %.0fs; withdrawing without it", wait)
                        break
                    time.sleep(0.05)
            self._withdraw()

    def run(self, ready_fd: int) -> int:
        self._ready_fd = ready_fd
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.stopping.set())
        shutil.rmtree(self.run_dir, ignore_errors=True)  # left by a dead process with our pid
        self.pdir.mkdir(parents=True)
        self._alive_fd = os.open(
            self.run_dir / "supervisor.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600
        )
        fcntl.flock(self._alive_fd, fcntl.LOCK_EX)
        code = 0
        try:
            self.etcd = _SupervisedEtcd(self.binary, data_dir=str(self.run_dir / "etcd")).start()
            assert self.etcd.proc is not None
            log.info(
                "supervisor %d: etcd pid %d at %s; stops %.1fs after the last participant",
                self.me,
                self.etcd.proc.pid,
                self.etcd.endpoint,
                self.grace,
            )
            self._report({"endpoint": self.etcd.endpoint, "pid": self.etcd.proc.pid, "supervisor": self.me})
            code = self._loop()
        except Exception:
            log.exception("supervisor %d failed", self.me)
            code = 1
        finally:
            self._report(None)  # a starter still waiting gets EOF at once: no etcd
            if not self.withdrawn:
                self._withdraw_locked()
            if self.etcd is not None:
                self.etcd.stop()
            os.close(self._alive_fd)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            log.info("supervisor %d: etcd stopped, exiting", self.me)
        return code

    def _report(self, msg: dict[str, Any] | None) -> None:
        """Tell the starter (once) what runs: write the message to the ready fd and close it."""
        fd, self._ready_fd = self._ready_fd, -1
        if fd < 0:
            return
        try:
            if msg is not None:
                os.write(fd, json.dumps(msg).encode())
        except OSError:  # the starter died meanwhile: the idle check stops us soon
            pass
        finally:
            os.close(fd)

    def _loop(self) -> int:
        assert self.etcd is not None and self.etcd.proc is not None
        poll = max(0.05, min(0.5, self.grace / 4))
        last_seen = time.monotonic()  # the starter registers right after our report
        while not self.stopping.wait(poll):
            rc = self.etcd.proc.poll()
            if rc is not None:
                log.error(
                    "etcd (pid %d) exited with %s; its log ends:\n%s",
                    self.etcd.proc.pid,
                    rc,
                    log_tail(os.path.join(self.etcd.data_dir, "etcd.log")),
                )
                return 1
            now = time.monotonic()
            state = self._check(now - last_seen)
            if state is True:
                last_seen = now
            elif state is False:
                log.info("no participant for %.1fs: stopping etcd", now - last_seen)
                return 0
        log.info("supervisor %d: signalled, stopping etcd", self.me)
        return 0

"""The host's shared embedded etcd, kept up by a detached supervisor while any participant lives.

``connect(namespace)`` with no endpoint calls :func:`shared_endpoint`: ``$ASTATE_ETCD`` when set,
else this host's shared embedded etcd. That etcd is owned by a small detached **supervisor**
process (``python -m astate_store.etcd.supervisor --supervise``, its own session, log in the
rendezvous dir), not by the process that happened to need it first, so it outlives that process.

Lifecycle of the shared etcd (rendezvous dir: ``$ASTATE_HOME``, else ``/tmp/astate-store-<uid>``,
created with mode 0700; a dir or rendezvous file another user owns or could write is refused with
:class:`~astate_store.errors.UnsafeRendezvousError`):

- ``embedded-etcd.json`` names the live one (endpoint, etcd pid, supervisor pid, starter pid);
  ``embedded-etcd.json.lock`` (``flock``) serializes finding, starting and retiring it.
- Every process that calls :func:`shared_endpoint` registers as a **participant**: it holds an
  ``flock`` on ``embedded-etcd-<supervisor pid>/participants/<pid>`` for the rest of its life.
  The kernel drops that lock when the process dies, however it dies (SIGKILL included).
- The supervisor holds ``embedded-etcd-<its pid>/supervisor.lock`` while it runs. When no
  participant has held its lock for ``$ASTATE_ETCD_IDLE_GRACE`` seconds (default 5), it removes
  the rendezvous file (under the rendezvous lock, so no process can join in between), stops etcd
  (SIGTERM, SIGKILL after a grace period) and exits. A later :func:`shared_endpoint` starts a
  fresh one. The supervisor only ever signals the etcd it started, by its pid; etcd also gets
  SIGTERM if the supervisor itself is killed (``PR_SET_PDEATHSIG``).

:class:`~astate_store.etcd.embedded.EmbeddedEtcd` (one private server, used by tests and
benchmarks) is independent of it; the supervisor runs one of its own.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import re
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astate_store.errors import CatalogUnavailable, UnsafeRendezvousError
from astate_store.process import pid_alive

if TYPE_CHECKING:  # the supervisor imports this module alone: nothing above errors/process at run time
    pass

from astate_store.etcd.embedded import ENV_ENDPOINT, etcd_healthy, find_etcd_binary, log_tail
from astate_store.etcd.supervisor_loop import RENDEZVOUS_FILE, Supervisor, read_info, run_dir_of

__all__ = ["shared_endpoint", "main", "ENV_HOME", "ENV_IDLE_GRACE"]

log = logging.getLogger("astate_store.etcd")

ENV_HOME = "ASTATE_HOME"
#: Seconds the shared embedded etcd stays up after its last participant is gone.
ENV_IDLE_GRACE = "ASTATE_ETCD_IDLE_GRACE"
DEFAULT_IDLE_GRACE = 5.0

_RUN_DIR_RE = re.compile(r"^embedded-etcd-(\d+)$")
# How long a process waits for a live supervisor's etcd to answer /health before giving up (a second
# etcd for the same host would split the processes of one job over two catalogs).
_REUSE_HEALTH_WAIT = 10.0
# How long a starter waits for a new supervisor to report its etcd healthy (EmbeddedEtcd tries 3 ports).
_START_WAIT = 90.0


def _check_private_dir(path: Path, *, default: bool) -> None:
    """Refuse a rendezvous dir another user could control: not a plain directory of ours, or
    writable by group or others. (A default dir of ours that others may read is tightened to 0700.)

    Raises:
        UnsafeRendezvousError: naming the path and the fix.
    """
    fix = (
        f"remove it (as its owner, or root), or set {ENV_HOME} to a directory of yours with mode 0700"
        if default
        else f"point {ENV_HOME} at a directory of yours with mode 0700"
    )
    st = os.lstat(path)
    what = f"the embedded etcd's rendezvous dir {path}"
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRendezvousError(f"{what} is a symbolic link (to {os.readlink(path)}); {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRendezvousError(f"{what} is not a directory; {fix}")
    if st.st_uid != os.getuid():
        raise UnsafeRendezvousError(
            f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}): "
            f"its owner could point this process at an etcd of theirs; {fix}"
        )
    if st.st_mode & 0o022:
        raise UnsafeRendezvousError(
            f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"anyone could replace its files; run `chmod 700 {path}`, or {fix}"
        )
    if default and st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours, made by an older version with the umask's mode


def _home() -> Path:
    """The rendezvous dir: ``$ASTATE_HOME``, else ``/tmp/astate-store-<uid>``; created with mode
    0700, and refused (:class:`UnsafeRendezvousError`) when another user could control it."""
    env = os.environ.get(ENV_HOME)
    if env:
        Path(env).mkdir(parents=True, exist_ok=True, mode=0o700)
        base = Path(env).resolve()  # a symlink to a directory of ours is fine for an explicit home
    else:
        base = Path(tempfile.gettempdir()) / f"astate-store-{os.getuid()}"
        try:
            base.mkdir(mode=0o700)
        except FileExistsError:
            pass
    _check_private_dir(base, default=not env)
    return base.resolve()  # the supervisor runs in /, and participants compare homes


def _rendezvous_file(home: Path | None = None) -> Path:
    return (home or _home()) / RENDEZVOUS_FILE


def _idle_grace() -> float:
    raw = os.environ.get(ENV_IDLE_GRACE)
    if raw is None or raw == "":
        return DEFAULT_IDLE_GRACE
    try:
        return max(0.0, float(raw))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %.1f", ENV_IDLE_GRACE, raw, DEFAULT_IDLE_GRACE)
        return DEFAULT_IDLE_GRACE


def _flock_held(path: Path) -> bool:
    """Whether another open file holds an flock on ``path`` (False when the file is absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's own lock
    return False


def _supervisor_alive(home: Path, supervisor_pid: int) -> bool:
    return _flock_held(run_dir_of(home, supervisor_pid) / "supervisor.lock")


def _write_info(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info))
    os.replace(tmp, path)


@dataclass
class _Participation:
    """This process's registration with one supervisor (the flock'd file stays open until exit)."""

    home: Path
    supervisor: int
    endpoint: str
    fd: int


_state_lock = threading.Lock()
_participation: _Participation | None = None


def _live_info(home: Path, path: Path) -> dict[str, Any] | None:
    """The rendezvous record when its supervisor runs and its etcd answers; None when there is
    none (or it is stale). Called with the rendezvous lock held.

    Raises:
        CatalogUnavailable: a supervisor runs but its etcd stays unhealthy.
    """
    info = read_info(path)
    if info is None:
        return None
    try:
        sup, pid, endpoint = int(info["supervisor"]), int(info["pid"]), str(info["endpoint"])
    except (KeyError, TypeError, ValueError):
        log.info("ignoring rendezvous file %s without a supervisor (older format)", path)
        return None
    deadline = time.monotonic() + _REUSE_HEALTH_WAIT
    while True:
        if not _supervisor_alive(home, sup) or not pid_alive(pid):
            log.info("embedded etcd of supervisor %d is gone; starting a new one", sup)
            return None
        if etcd_healthy(endpoint):
            return info
        if time.monotonic() > deadline:
            raise CatalogUnavailable(
                f"embedded etcd at {endpoint} (pid {pid}, supervisor pid {sup}) does not answer /health; "
                f"see {home / 'embedded-etcd.log'}, or set {ENV_ENDPOINT}"
            )
        time.sleep(0.1)


def _remove_stale_run_dirs(home: Path) -> None:
    """Run dirs of supervisors that died without cleaning up (SIGKILL). Rendezvous lock held."""
    for entry in home.iterdir():
        m = _RUN_DIR_RE.match(entry.name)
        if m and entry.is_dir() and not _supervisor_alive(home, int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


# The supervisor runs this module without executing the package's __init__ (which imports torch):
# a stub package whose __path__ is the package dir makes the relative imports work.
_BOOT = (
    "import sys, types\n"
    "pkg = types.ModuleType('astate_store'); pkg.__path__ = [sys.argv[1]]\n"
    "sys.modules['astate_store'] = pkg\n"
    "from astate_store.etcd.supervisor import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def _start_supervisor(home: Path) -> dict[str, Any]:
    """Launch a detached supervisor and wait until it reports its etcd healthy. Rendezvous lock held."""
    grace = _idle_grace()
    binary = find_etcd_binary()  # here, so a missing etcd is this caller's error at once
    log_path = home / "embedded-etcd.log"
    rfd, wfd = os.pipe()
    try:
        with open(log_path, "ab") as logf:
            # -I: no PYTHON* variables, no cwd or user site on the path (it needs the stdlib only).
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-c",
                    _BOOT,
                    str(Path(__file__).resolve().parents[1]),
                    "--supervise",
                    "--home",
                    str(home),
                    "--ready-fd",
                    str(wfd),
                    "--grace",
                    repr(grace),
                    "--etcd-binary",
                    binary,
                ],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                pass_fds=(wfd,),
                close_fds=True,
                start_new_session=True,
                cwd="/",
            )
    except BaseException:
        os.close(rfd)
        raise
    finally:
        os.close(wfd)
    # Reap it if it exits while this process still runs (no zombie under the starter).
    threading.Thread(target=proc.wait, name="astate-etcd-supervisor-reaper", daemon=True).start()
    buf = b""
    deadline = time.monotonic() + _START_WAIT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([rfd], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
            if ready:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    break
                buf += chunk
    finally:
        os.close(rfd)
    try:
        info = json.loads(buf.decode())
        info["supervisor"], info["pid"], info["endpoint"] = (
            int(info["supervisor"]),
            int(info["pid"]),
            str(info["endpoint"]),
        )
    except (ValueError, KeyError, TypeError):
        if proc.poll() is None:  # it never reported: our own child, stop it
            proc.terminate()
        raise CatalogUnavailable(
            f"the embedded etcd supervisor (pid {proc.pid}) did not start etcd; {log_path} ends:\n"
            f"{log_tail(log_path)}"
        ) from None
    info.update(starter=os.getpid(), started_at=time.time(), log=str(log_path), idle_grace=grace)
    return info


def _register(home: Path, info: dict[str, Any]) -> _Participation:
    """Hold an flock on participants/<pid> of this supervisor for the rest of this process's life.
    Rendezvous lock held, so the supervisor cannot be deciding to stop meanwhile."""
    sup = int(info["supervisor"])
    pdir = run_dir_of(home, sup) / "participants"
    tmp = pdir / f".{os.getpid()}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"pid": os.getpid(), "argv": sys.argv[:4]}).encode())
        os.rename(tmp, pdir / str(os.getpid()))  # appears already locked: never seen unlocked
    except BaseException:
        os.close(fd)
        raise
    return _Participation(home, sup, str(info["endpoint"]), fd)


def shared_endpoint() -> str:
    """The etcd endpoint for ``connect`` without one: ``$ASTATE_ETCD`` when set, else this host's
    shared embedded etcd, started (under a detached supervisor) when none runs.

    This process becomes a participant of that etcd: it stays up while any participant lives, and
    stops ``$ASTATE_ETCD_IDLE_GRACE`` seconds (default 5) after the last one exits.

    Raises:
        CatalogUnavailable: no etcd binary, or etcd did not start / does not answer.
    """
    global _participation
    env = os.environ.get(ENV_ENDPOINT)
    if env:
        return env
    with _state_lock:
        home = _home()
        mine = _participation
        if mine is not None and mine.home == home and _supervisor_alive(home, mine.supervisor):
            return mine.endpoint
        path = _rendezvous_file(home)
        with open(str(path) + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for attempt in range(2):
                info = _live_info(home, path)
                if info is not None:
                    log.info(
                        "reusing embedded etcd at %s (pid %s, supervisor %s)",
                        info["endpoint"],
                        info["pid"],
                        info["supervisor"],
                    )
                else:
                    _remove_stale_run_dirs(home)
                    info = _start_supervisor(home)
                    _write_info(path, info)
                    log.warning(
                        "started embedded etcd at %s (pid %d) under supervisor %d; it stops %.1fs after "
                        "the last process using it exits (log: %s)",
                        info["endpoint"],
                        info["pid"],
                        info["supervisor"],
                        info["idle_grace"],
                        info["log"],
                    )
                if mine is not None and mine.home == home and mine.supervisor == int(info["supervisor"]):
                    return mine.endpoint
                try:
                    new = _register(home, info)
                except FileNotFoundError:  # that supervisor died (signal, etcd crash) just now
                    if attempt:
                        raise CatalogUnavailable(
                            f"the embedded etcd supervisor {info['supervisor']} "
                            "exited while this process joined"
                        ) from None
                    continue
                if mine is not None:
                    os.close(mine.fd)  # registered with a supervisor that is gone
                _participation = new
                return new.endpoint
        raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m astate_store.etcd.embedded --supervise``: the supervisor :func:`shared_endpoint`
    starts (detached, own session) to own the shared embedded etcd. Internal: the process that
    starts it writes the rendezvous file from what it reports on ``--ready-fd``."""
    ap = argparse.ArgumentParser(prog="python -m astate_store.etcd.embedded", description=main.__doc__)
    ap.add_argument("--supervise", action="store_true", required=True)
    ap.add_argument(
        "--home", default=None, help="rendezvous dir (default: $ASTATE_HOME or /tmp/astate-store-<uid>)"
    )
    ap.add_argument(
        "--ready-fd", type=int, default=-1, help="fd to write {endpoint, pid, supervisor} to, then close"
    )
    ap.add_argument(
        "--grace",
        type=float,
        default=None,
        help=f"idle seconds before stopping (default ${ENV_IDLE_GRACE}, else {DEFAULT_IDLE_GRACE})",
    )
    ap.add_argument("--etcd-binary", default=None, help="etcd executable (default: as find_etcd_binary)")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    home = Path(args.home) if args.home else _home()
    grace = _idle_grace() if args.grace is None else max(0.0, args.grace)
    return Supervisor(home, grace, args.etcd_binary).run(args.ready_fd)


if __name__ == "__main__":
    sys.exit(main())

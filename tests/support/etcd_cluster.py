"""A real several-member etcd cluster on one host, for client failover tests (and the fault suite)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from astate_store.errors import CatalogUnavailable

if TYPE_CHECKING:  # the supervisor imports this module alone: nothing above errors/process at run time
    pass

from astate_store.etcd.embedded import (
    _etcd_command,
    _free_ports,
    _stop_process,
    etcd_healthy,
    find_etcd_binary,
    log_tail,
    tied_to_caller,
)

__all__ = ["EtcdCluster", "EtcdMember"]

log = logging.getLogger("astate_store.etcd")


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

    def __init__(
        self,
        size: int = 3,
        binary: str | None = None,
        start_timeout: float = 20.0,
        host: str = "127.0.0.1",
        token: str | None = None,
    ):
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

    def start(self) -> EtcdCluster:
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
                cmd = _etcd_command(
                    self.binary, name, os.path.join(d, "data"), client, peers[i], initial, token=self.token
                )
                with open(os.path.join(d, "etcd.log"), "ab") as logf:
                    # tied to this process: a killed test run leaves no member behind
                    m.proc = subprocess.Popen(
                        tied_to_caller(cmd),
                        stdout=logf,
                        stderr=logf,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                self.members.append(m)
            deadline = time.monotonic() + self.start_timeout
            pending = list(self.members)
            while pending and time.monotonic() < deadline and all(m.alive for m in self.members):
                pending = [m for m in pending if not etcd_healthy(m.endpoint, 0.5)]
                if pending:
                    time.sleep(0.05)
            if not pending:
                atexit.register(self.stop)
                log.info(
                    "etcd cluster of %d at %s (pids %s)",
                    self.size,
                    self.endpoint,
                    [m.proc.pid for m in self.members if m.proc],
                )
                return self
            last = "\n".join(
                f"{m.name}: {log_tail(os.path.join(m.data_dir, 'etcd.log'), 800)}" for m in pending
            )
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

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- the shared embedded etcd: participants' side ---------------------------------------------

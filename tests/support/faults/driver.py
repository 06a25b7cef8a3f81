"""The driver side of the fault actors: :class:`Actor` (one actor process, every wait bounded,
ended by PID), :class:`Pool` (a spare actor is always starting, so a killed one is replaced
cheaply) and :class:`EtcdProcess` (an etcd that can be SIGSTOPped, SIGKILLed and restarted on the
same data dir and port).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the repository root (this file is tests/support/faults/)


class Hang(Exception):
    """An actor did not answer within the timeout (it has been killed)."""


class Died(Exception):
    """An actor exited (or was killed) before answering."""


class Actor:
    """One actor process. Every wait is bounded; :meth:`kill` ends it by PID."""

    def __init__(
        self, name: str, logdir: str, netns: str | None = None, env: Mapping[str, str] | None = None
    ):
        self.name = name
        self.netns = netns
        self.log_path = os.path.join(logdir, f"{name}.log")
        e = dict(os.environ)
        e.pop("ASTATE_ETCD", None)
        e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        e.setdefault("ASTATE_HOME", os.path.join(logdir, "home"))  # never the host's shared embedded etcd
        e.setdefault("UCX_LOG_LEVEL", "error")
        e.update(env or {})
        cmd = [sys.executable, "-u", "-m", "tests.support.faults.actor"]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        # SIGTERM when the driver dies (its pipes would close too, but an actor stuck in a call never reads)
        from astate_store.etcd.embedded import tied_to_caller

        cmd = tied_to_caller(cmd)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=str(ROOT),
            env=e,
            text=True,
            bufsize=1,
        )
        self._q: queue.Queue[Any] = queue.Queue()
        self._events: queue.Queue[Any] = queue.Queue()
        self._replies: dict[int, Any] = {}
        self._next = 0
        self.pid: int | None = None
        self.dead = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "event" in msg:
                self._events.put(msg)
            else:
                self._q.put(msg)
        self._q.put(None)  # EOF: the process is gone
        self._events.put(None)

    def wait_ready(self, timeout: float = 120.0) -> Actor:
        ev = self.event(timeout)
        if ev.get("event") != "ready":
            raise Died(f"actor {self.name}: unexpected first event {ev}")
        self.pid = int(ev["pid"])
        return self

    def event(self, timeout: float) -> dict[str, Any]:
        try:
            ev = self._events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise Hang(f"actor {self.name}: no event within {timeout:.1f}s") from None
        if ev is None:
            self._events.put(None)
            raise Died(f"actor {self.name} exited ({self.exit_status()})")
        return dict(ev)

    def send(self, op: str, *args: Any, **kw: Any) -> int:
        if self.dead or self.proc.poll() is not None:
            raise Died(f"actor {self.name} is not running ({self.exit_status()})")
        self._next += 1
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(
                json.dumps({"id": self._next, "op": op, "args": list(args), "kw": kw}) + "\n"
            )
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise Died(f"actor {self.name}: {exc}") from None
        return self._next

    def result(self, rid: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while rid not in self._replies:
            try:
                msg = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise Hang(f"actor {self.name} (pid {self.pid}): no answer within {timeout:.1f}s") from None
            if msg is None:
                self._q.put(None)
                raise Died(
                    f"actor {self.name} (pid {self.pid}) exited before answering ({self.exit_status()})"
                )
            self._replies[int(msg["id"])] = msg
        return dict(self._replies.pop(rid))

    def call(self, op: str, *args: Any, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        """Run an op; the reply dict (``ok``, ``result`` or the error). Raises Hang/Died."""
        return self.result(self.send(op, *args, **kw), timeout)

    def must(self, op: str, *args: Any, timeout: float = 60.0, **kw: Any) -> Any:
        """Run an op that must succeed (set-up steps); raises RuntimeError with its error otherwise."""
        r = self.call(op, *args, timeout=timeout, **kw)
        if not r["ok"]:
            raise SetupError(f"{self.name}.{op}: {r['etype']}: {r['msg']}", r)
        return r["result"]

    def exit_status(self) -> str:
        rc = self.proc.poll()
        if rc is None:
            return "running"
        return f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"

    def log_tail(self, n: int = 1500) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stacks(self, wait: float = 1.0) -> str:
        """Ask a live actor for every thread's Python stack (faulthandler on SIGUSR1); its log tail."""
        if self.proc.poll() is not None or self.pid is None:
            return ""
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        time.sleep(wait)
        return self.log_tail(3000)

    def kill(self) -> None:
        """SIGKILL by PID and reap. Only a process not yet reaped is signalled (its pid cannot
        have been reused); ``ip netns exec`` execs the actor, so its pid is the Popen's."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.dead = True
        if not self._log.closed:
            self._log.close()

    def close(self, timeout: float = 15.0) -> None:
        if self.dead:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


class SetupError(Exception):
    """A set-up step of a trial failed (reported as a typed error when the store's error was typed)."""

    def __init__(self, msg: str, reply: Mapping[str, Any] | None = None):
        super().__init__(msg)
        self.reply = dict(reply or {})


class Pool:
    """Actors for trials: ``take`` hands out a ready one and starts its replacement at once (a
    Python + torch start takes seconds), ``give`` takes back one that is still healthy."""

    def __init__(self, logdir: str, spares: int = 2):
        self.logdir, self.nspares = logdir, spares
        self._n = 0
        self.spares: list[Actor] = []
        self.idle: list[Actor] = []
        self.all: list[Actor] = []
        self._fill()

    def _new(self, netns: str | None = None, env: Mapping[str, str] | None = None) -> Actor:
        self._n += 1
        a = Actor(f"a{self._n:03d}" + (f"-{netns}" if netns else ""), self.logdir, netns=netns, env=env)
        self.all.append(a)
        return a

    def _fill(self) -> None:
        while len(self.spares) < self.nspares:
            self.spares.append(self._new())

    def take(self, timeout: float = 120.0) -> Actor:
        a = self.idle.pop() if self.idle else self.spares.pop(0)
        self._fill()
        if a.pid is None:
            a.wait_ready(timeout)
        return a

    def take_in(self, netns: str, timeout: float = 120.0, env: Mapping[str, str] | None = None) -> Actor:
        return self._new(netns, env).wait_ready(timeout)

    def give(self, a: Actor, timeout: float = 30.0) -> None:
        """Reset a surviving actor (close its stores) for reuse; kill it if it does not answer."""
        if a.dead or a.netns or a.proc.poll() is not None:
            a.kill()
            return
        try:
            r = a.call("reset", timeout=timeout)
            if r["ok"]:
                self.idle.append(a)
                return
        except (Hang, Died):
            pass
        a.kill()

    def close(self) -> None:
        for a in self.all:
            if not a.dead:
                a.close(timeout=5.0)


# ---- etcd that can be restarted on its data dir and port --------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(endpoint: str, timeout: float = 0.5) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout) as r:
            return json.loads(r.read()).get("health") in ("true", True)
    except (OSError, ValueError):
        return False


class EtcdProcess:
    """One etcd on 127.0.0.1 that keeps its data dir and ports across restarts."""

    def __init__(self, base: str):
        from astate_store.etcd.embedded import find_etcd_binary

        self.binary = find_etcd_binary()
        self.dir = tempfile.mkdtemp(prefix="etcd-", dir=base)
        self.client_port, self.peer_port = _free_port(), _free_port()
        while self.peer_port == self.client_port:
            self.peer_port = _free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> EtcdProcess:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name",
            "f",
            "--data-dir",
            os.path.join(self.dir, "data"),
            "--listen-client-urls",
            c,
            "--advertise-client-urls",
            c,
            "--listen-peer-urls",
            p,
            "--initial-advertise-peer-urls",
            p,
            "--initial-cluster",
            f"f={p}",
            "--initial-cluster-state",
            "new",
            "--log-level",
            "error",
        ]
        from astate_store.etcd.embedded import tied_to_caller

        with open(os.path.join(self.dir, "etcd.log"), "ab") as log:
            self.proc = subprocess.Popen(
                tied_to_caller(cmd), stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if _health(self.endpoint):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd did not become healthy on {self.endpoint}")

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM, wait=5.0)
        shutil.rmtree(self.dir, ignore_errors=True)

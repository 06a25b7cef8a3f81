"""The shared embedded etcd: it outlives the process that started it, stops after the last one.

Real processes throughout: torchrun with two ranks running the README quick start
(``tests/_quickstart.py``), and plain interpreters that join and get SIGKILLed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from astate_store.process import exited
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
GRACE = "1"  # seconds the supervisor waits after the last participant (ASTATE_ETCD_IDLE_GRACE)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Host:
    """One rendezvous dir (``ASTATE_HOME``) and every process a test starts against it."""

    def __init__(self, home: Path):
        self.home = home
        self.rendezvous = home / "embedded-etcd.json"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {k: v for k, v in os.environ.items() if k != "ASTATE_ETCD"}
        self.env.update(ASTATE_HOME=str(home), ASTATE_ETCD_IDLE_GRACE=GRACE, PYTHONPATH=str(ROOT))

    def info(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.rendezvous.read_text()))
        except (OSError, ValueError):
            return None

    def spawn(self, args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(args, cwd=ROOT, env={**self.env, **kw.pop("env", {})}, **kw)
        self.procs.append(p)
        return p

    def supervisors(self) -> list[int]:
        """Pids of the supervisors of this home (from their run dirs) that still run."""
        out = []
        for d in self.home.glob("embedded-etcd-*"):
            m = re.fullmatch(r"embedded-etcd-(\d+)", d.name)
            if m and not exited(int(m.group(1))) and "--supervise" in _cmdline(int(m.group(1))):
                out.append(int(m.group(1)))
        return out

    def assert_stopped(self, info: dict[str, Any], timeout: float = 20.0) -> None:
        """The supervisor of ``info`` stops its etcd and itself, and removes the rendezvous file."""
        wait_until(lambda: exited(int(info["pid"])), timeout, message=f"etcd pid {info['pid']} did not stop")
        wait_until(
            lambda: exited(int(info["supervisor"])),
            timeout,
            message=f"supervisor {info['supervisor']} did not exit",
        )
        now = self.info()
        assert now is None or now.get("supervisor") != info["supervisor"], now
        assert not (self.home / f"embedded-etcd-{info['supervisor']}").exists()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()  # torchrun forwards it to its ranks
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        # What our processes started: the supervisor of this home stops its own etcd on SIGTERM.
        info = self.info() or {}
        sups = set(self.supervisors())
        if info.get("supervisor") and "--supervise" in _cmdline(int(info["supervisor"])):
            sups.add(int(info["supervisor"]))
        for pid in sups:
            os.kill(pid, signal.SIGTERM)
        try:
            wait_until(lambda: all(exited(p) for p in sups), 15)
        except AssertionError:  # a clean-up: what is still running is SIGKILLed below
            pass
        for pid in sups:
            if not exited(pid):
                os.kill(pid, signal.SIGKILL)
        etcd = info.get("pid")
        if (
            etcd
            and not exited(int(etcd))
            and "etcd" in _cmdline(int(etcd))
            and str(self.home) in _cmdline(int(etcd))
        ):
            os.kill(int(etcd), signal.SIGKILL)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path / "home")
    yield h
    h.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("starter_rank", [0, 1])
def test_torchrun_quickstart_survives_the_starter_exiting_first(
    host: Host, tmp_path: Path, starter_rank: int
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "torchrun.log"
    torchrun = Path(sys.executable).parent / "torchrun"
    with open(log, "wb") as logf:
        run = host.spawn(
            [str(torchrun), "--standalone", "--nproc-per-node", "2", "tests/_quickstart.py"],
            env={"QS_OUT": str(out), "QS_STARTER": str(starter_rank)},
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    try:
        rc = run.wait(90)
    except subprocess.TimeoutExpired:
        rc = None
    assert rc == 0, f"torchrun exited {rc}; its log ends:\n{log.read_text(errors='replace')[-6000:]}"
    results = {r: json.loads((out / f"result-{r}.json").read_text()) for r in (0, 1)}
    starter, survivor = results[starter_rank], results[1 - starter_rank]
    info = starter["info"]
    assert starter["starter"] and not survivor["starter"]
    assert info["starter"] == starter["pid"] and survivor["info"] == info  # one etcd for both ranks
    for r in results.values():
        assert r["endpoint"] == info["endpoint"]
        assert r["step1"] == 1 and r["step1_exact"]
    # After the starter was gone: the same etcd served the survivor's pulls and puts.
    assert survivor["own_step1"] == 1 and survivor["own_step1_exact"]
    assert survivor["solo_endpoint"] == info["endpoint"] and survivor["info_after"] == info
    assert survivor["committed2"] is True and survivor["step2"] == 2 and survivor["step2_exact"]
    assert survivor["latest"] == 2
    # Every participant has exited: the supervisor stops etcd and removes the rendezvous file.
    host.assert_stopped(info)
    assert not host.rendezvous.exists()


_JOIN = (
    "import os, sys, time\n"
    "from astate_store.etcd.supervisor import shared_endpoint\n"
    "print(shared_endpoint(), flush=True)\n"
    "sys.stdin.read()\n"
)  # a participant until its stdin closes (or it is killed)


def _join(host: Host) -> tuple[subprocess.Popen[bytes], str]:
    p = host.spawn([sys.executable, "-c", _JOIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None
    line = p.stdout.readline().decode().strip()
    assert line, "the participant did not get an endpoint"
    return p, line


def _healthy(endpoint: str) -> bool:
    from astate_store.etcd.embedded import etcd_healthy as healthy

    return healthy(endpoint)


@pytest.mark.timeout(90)
def test_sigkilled_participants_do_not_keep_etcd_alive_and_a_fresh_one_starts(host: Host) -> None:
    first, ep = _join(host)
    second, ep2 = _join(host)
    info = host.info()
    assert info is not None and ep == ep2 == info["endpoint"] and info["starter"] == first.pid
    first.kill()  # the starter dies without any cleanup
    first.wait(30)
    time.sleep(float(GRACE) * 2)  # longer than the grace: the second participant keeps it up
    assert _healthy(ep) and host.info() == info
    second.kill()
    second.wait(30)
    host.assert_stopped(info)
    # A later participant starts a fresh etcd under a new supervisor.
    third, ep3 = _join(host)
    fresh = host.info()
    assert fresh is not None and fresh["supervisor"] != info["supervisor"] and fresh["endpoint"] == ep3
    assert _healthy(ep3)
    assert third.stdin is not None
    third.stdin.close()  # a clean exit
    third.wait(30)  # interpreter exit under load: bounded, not timed
    host.assert_stopped(fresh)


@pytest.mark.timeout(60)
def test_explicit_endpoint_wins(host: Host, etcd: Any) -> None:
    from astate_store.etcd.supervisor import shared_endpoint

    p = host.spawn(
        [sys.executable, "-c", "from astate_store.etcd.supervisor import shared_endpoint as s; print(s())"],
        env={"ASTATE_ETCD": etcd.endpoint},
        stdout=subprocess.PIPE,
    )
    assert p.communicate(timeout=30)[0].decode().strip() == etcd.endpoint
    assert not host.rendezvous.exists() and not host.supervisors()
    assert shared_endpoint() == etcd.endpoint  # this process has ASTATE_ETCD from the etcd fixture

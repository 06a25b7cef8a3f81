"""Two test hosts in network namespaces made here (iproute2): etcd and the trainer ranks on host A,
a rollout on host B; bytes cross a veth link over UCX tcp. Skips where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from astate_store.etcd.embedded import tied_to_caller

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def hosts() -> Iterator[tuple[str, str, str]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = "%06x" % random.getrandbits(24)
    a, b, net = f"as-{tag}-a", f"as-{tag}-b", f"10.231.{random.randint(1, 254)}"
    try:
        _ip("netns", "add", a)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        _ip("link", "set", f"va{tag}", "netns", a)
        _ip("link", "set", f"vb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", f"{net}.1"), (b, f"vb{tag}", f"{net}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, f"{net}.1"
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


class _Proc:
    """A worker in a namespace; it lives until its stdin is closed."""

    def __init__(self, ns: str, *args: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("ASTATE_ETCD", None)
        # tied to this process: a worker (and the etcd it runs) never outlives the test run
        cmd = tied_to_caller(["ip", "netns", "exec", ns, sys.executable, "-m", "tests._netns_worker", *args])
        self.p = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def line(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        out = self.p.stdout.readline()
        assert out, f"worker exited with {self.p.wait(10)}"
        return dict(json.loads(out))

    def stop(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)


def test_sync_across_two_hosts_over_tcp(hosts: tuple[str, str, str]) -> None:
    a, b, addr = hosts
    procs = [_Proc(a, "etcd", addr)]
    try:
        endpoint = procs[0].line()["endpoint"]
        assert endpoint.startswith(addr)
        procs += [_Proc(a, "publish", endpoint, "policy", str(r)) for r in (0, 1)]
        assert sorted(p.line()["rank"] for p in procs[1:]) == [0, 1]
        consumer = _Proc(b, "consume", endpoint, "policy")
        procs.append(consumer)
        res = consumer.line()
        print(res["info"])
        assert res["got"] == 2 and res["exact"] and res["peers"] == 2
        assert res["tcp"], "host B must reach host A's memory over tcp"
        # the publishers' stream servers bound host A's address (the one they reach etcd from): the rows were
        # streamed across the link, 256 x 512 floats of w and all of b, then each rank's 8-byte step word
        assert res["streamed"] == [True, True]
        assert res["streamed_bytes"] == (256 * 512 + 1024) * 4 + 2 * 8
    finally:
        for p in reversed(procs):
            p.stop()

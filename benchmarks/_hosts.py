"""Two hosts on one machine, for the benchmarks that cross a network: two network namespaces joined by
a veth pair (root and iproute2), and this interpreter run inside one of them (multiprocessing's spawn
executable, or a command line).

    with VethPair("delta") as hosts:  # namespaces hosts.a and hosts.b, at hosts.a_addr and hosts.b_addr
        mp.spawn.set_executable(netns_python(hosts.b))  # processes started from here run in B

Used by ``delta_sync.py``, ``peers.py`` (and ``stream_lanes.py`` through it) and ``fault_suite.py``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile

__all__ = ["VethPair", "ip", "netns_python"]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """``ip ARGS`` (iproute2); CalledProcessError when it fails and ``check``."""
    return subprocess.run(["ip", *args], check=check, capture_output=True, timeout=20)


def _wrapper(netns: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{netns}-python.sh")


def netns_python(netns: str) -> str:
    """A one-line script that runs this interpreter inside ``netns`` (made once per namespace; the
    pair that made the namespace removes it)."""
    path = _wrapper(netns)
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec ip netns exec {netns} {sys.executable} "$@"\n')
        os.chmod(path, 0o700)
    return path


class VethPair:
    """Network namespaces ``a`` and ``b`` (named after ``prefix`` and a random tag) joined by a veth
    pair: ``a_dev`` at ``a_addr`` in A, ``b_dev`` at ``b_addr`` in B, in a random /24 of 10.``net``.
    Made by ``__enter__`` (or :meth:`open`), removed by ``__exit__`` (or :meth:`close`), with the
    interpreter wrappers of both."""

    def __init__(self, prefix: str, net: int = 232) -> None:
        tag = "%06x" % random.getrandbits(24)
        subnet = f"10.{net}.{random.randint(1, 254)}"
        self.a, self.b = f"{prefix}-{tag}-a", f"{prefix}-{tag}-b"
        self.a_addr, self.b_addr = f"{subnet}.1", f"{subnet}.2"
        self.a_dev, self.b_dev = f"{prefix[0]}a{tag}", f"{prefix[0]}b{tag}"

    def open(self) -> VethPair:
        try:
            for ns in (self.a, self.b):
                ip("netns", "add", ns)
            ip("link", "add", self.a_dev, "type", "veth", "peer", "name", self.b_dev)
            for ns, dev, addr in ((self.a, self.a_dev, self.a_addr), (self.b, self.b_dev, self.b_addr)):
                ip("link", "set", dev, "netns", ns)
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove both namespaces (the veth pair goes with them) and their interpreter wrappers."""
        for ns in (self.a, self.b):
            ip("netns", "del", ns, check=False)
            try:
                os.unlink(_wrapper(ns))
            except OSError:
                pass

    def __enter__(self) -> VethPair:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A real 3-member etcd cluster: the member the clients talk to is killed mid-run.

A publisher process and a consumer process both get all three endpoints (``"h:p1,h:p2,h:p3"``).
After some committed steps, the member both of them use is SIGKILLed while the consumer waits
for the next version; every version committed before stays committed, ``latest`` never goes
back, and puts and pulls carry on with exact bytes through the two surviving members.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests._procs import CTX
from tests.support.etcd_cluster import EtcdCluster

SHAPE = (64, 48)
TIMEOUT = 60.0


def value(step: int) -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) * 0.125 + step


def _member_in_use(store: Any) -> str:
    """The etcd member this store's client sends its requests to now."""
    return str(store.catalog.client.raw.endpoint_in_use.netloc)


def publisher(endpoint: str, ns: str, cmds: Any, out: Any) -> None:
    from astate_store import AStateError
    from astate_store.store import Store

    store = Store(ns, endpoint=endpoint, transport="shm", session_id=f"{ns}-pub", lease_ttl=5.0, retention=16)
    tensor = torch.zeros(SHAPE)
    out.put(("ready", os.getpid(), _member_in_use(store)))
    while True:
        cmd = cmds.get()
        if cmd[0] == "exit":
            break
        step = cmd[1]
        tensor.copy_(value(step))
        try:
            out.put(("put", step, store.put(step, {"w": tensor}), _member_in_use(store)))
        except AStateError as exc:
            out.put(("error", step, f"{type(exc).__name__}: {exc}"))
    store.close()
    out.put(("bye",))


def consumer(endpoint: str, ns: str, member: str, cmds: Any, out: Any) -> None:
    from astate_store import AStateError
    from astate_store.store import Store

    # pyetcd starts each client on a random member: open stores until this one uses the
    # publisher's, so the member killed is the one both clients talk to.
    for _ in range(100):
        store = Store(ns, endpoint=endpoint, transport="shm", lease_ttl=5.0)
        if _member_in_use(store) == member:
            break
        store.close()
    buf = torch.zeros(SHAPE)
    out.put(("ready", os.getpid(), _member_in_use(store)))
    while True:
        cmd = cmds.get()
        if cmd[0] == "exit":
            break
        try:
            got = store.get_into({"w": buf}, step=cmd[1], timeout=30)
            out.put(
                (
                    "got",
                    got,
                    torch.equal(buf, value(got)),
                    store.latest(),
                    store.catalog.versions.committed_steps(),
                    _member_in_use(store),
                )
            )
        except AStateError as exc:
            out.put(("error", cmd[1], f"{type(exc).__name__}: {exc}"))
    store.close()
    out.put(("bye",))


class Worker:
    """One spawned process driven through a command queue."""

    def __init__(self, target: Callable[..., None], *args: Any):
        self.cmds, self.out = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=target, args=(*args, self.cmds, self.out), daemon=True)
        self.proc.start()

    def ask(self, *cmd: Any) -> None:
        self.cmds.put(cmd)

    def reply(self, kind: str) -> tuple[Any, ...]:
        msg = self.out.get(timeout=TIMEOUT)
        assert msg[0] == kind, msg
        return tuple(msg)

    def close(self) -> None:
        if self.proc.is_alive():
            self.cmds.put(("exit",))
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    c = EtcdCluster(3).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for w in made:
        w.close()


@pytest.mark.timeout(120)
def test_member_killed_mid_run_loses_no_version_and_sync_carries_on(
    cluster: EtcdCluster, workers: list[Worker]
) -> None:
    ns = "cluster-" + uuid.uuid4().hex[:8]
    assert len(cluster.endpoint.split(",")) == 3
    pub = Worker(publisher, cluster.endpoint, ns)
    workers.append(pub)
    _, _, member = pub.reply("ready")
    cons = Worker(consumer, cluster.endpoint, ns, member)
    workers.append(cons)
    assert cons.reply("ready")[2] == member  # both clients talk to the member about to die

    latest_seen = 0

    def step(s: int, *, consumer_waiting: bool = False) -> tuple[Any, ...]:
        nonlocal latest_seen
        if not consumer_waiting:
            cons.ask("get", s)
        pub.ask("put", s)
        put = pub.reply("put")
        assert put[1] == s and put[2] is True, put  # one rank: its put commits the version
        _, got, exact, latest, committed, _ = got_msg = cons.reply("got")
        assert got == s and exact, got_msg
        assert latest >= latest_seen and latest >= s, (latest, latest_seen)  # never goes back
        latest_seen = latest
        assert committed == list(range(1, s + 1)), committed  # every committed version still there
        return put + got_msg

    for s in (1, 2, 3):
        step(s)
    # The consumer now waits for step 4 on a watch through that member; kill it under the watch.
    cons.ask("get", 4)
    cluster.kill(cluster.index_of(member))
    res = step(4, consumer_waiting=True)
    assert res[3] != member and res[-1] != member, res  # both clients moved to a live member
    for s in range(5, 9):
        step(s)

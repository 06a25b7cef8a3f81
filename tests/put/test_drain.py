"""Drain: a publisher waits, bounded, until every live consumer of its namespace has read the
newest version it put, or has left. Separate processes, real etcd.

- a slow consumer (registered, but starts reading the last step only seconds later) gets that
  step, whole, although the publisher closes right after draining;
- a consumer SIGKILLed before reading holds the drain only until its lease (2 s) ends: the drain,
  given far longer than the test may run, returns with that consumer's record gone;
- with no consumer, drain returns at once (again given far longer than the test may run).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from tests._procs import CTX
from tests.put._drain_workers import consumer, publisher

LONG = 600.0  # a drain timeout far past each test's own limit: only the condition can end it


def _get(q: Any, kind: str, timeout: float = 60) -> tuple[Any, ...]:
    msg = q.get(timeout=timeout)
    assert msg[0] == kind, msg
    return tuple(msg)


def _stop(*procs: Any) -> None:
    for p in procs:
        p.join(20)
        if p.is_alive():
            p.kill()
            p.join(5)


@pytest.mark.timeout(120)
def test_drain_waits_for_a_slow_consumer(etcd: Any, namespace: str) -> None:
    pub_out, con_out, go = CTX.Queue(), CTX.Queue(), CTX.Event()
    pub = CTX.Process(target=publisher, args=(etcd.endpoint, namespace, 2, go, LONG, pub_out), daemon=True)
    pub.start()
    con = None
    try:
        _get(pub_out, "put")
        # registered by its pull of step 1; it starts pulling step 2 only 3 s after step 2 commits
        con = CTX.Process(target=consumer, args=(etcd.endpoint, namespace, 1, 2, 3.0, con_out), daemon=True)
        con.start()
        _, cid, got, exact, _pid = _get(con_out, "ready")
        assert (got, exact) == (1, True)
        go.set()
        _get(pub_out, "put")
        _, left, records = _get(pub_out, "drained")
        assert left == 0, records
        _get(pub_out, "closed")
        # the publisher closed only after the consumer had read the last step: whole and exact
        assert _get(con_out, "got") == ("got", cid, 2, True)
    finally:
        go.set()
        _stop(*(p for p in (pub, con) if p is not None))


@pytest.mark.timeout(120)
def test_a_dead_consumer_holds_the_drain_no_longer_than_its_lease(etcd: Any, namespace: str) -> None:
    pub_out, live_out, dead_out, go = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Event()
    pub = CTX.Process(target=publisher, args=(etcd.endpoint, namespace, 2, go, LONG, pub_out), daemon=True)
    pub.start()
    procs = [pub]
    try:
        _get(pub_out, "put")
        dead = CTX.Process(
            target=consumer, args=(etcd.endpoint, namespace, 1, 2, 3600.0, dead_out), daemon=True
        )
        live = CTX.Process(target=consumer, args=(etcd.endpoint, namespace, 1, 2, 0.5, live_out), daemon=True)
        procs += [dead, live]
        dead.start()
        live.start()
        _, dead_id, _, _, dead_pid = _get(dead_out, "ready")
        _, live_id, _, _, _ = _get(live_out, "ready")
        os.kill(dead_pid, signal.SIGKILL)  # registered, never reads step 2, never closes
        dead.join(10)
        go.set()
        _get(pub_out, "put")
        _, left, records = _get(pub_out, "drained", timeout=90)
        # The drain ended because the dead consumer's lease did: its record was gone by then.
        assert left == 0 and dead_id not in records, records
        _get(pub_out, "closed")
        assert _get(live_out, "got") == ("got", live_id, 2, True)
    finally:
        go.set()
        _stop(*procs)


@pytest.mark.timeout(60)
def test_drain_without_consumers_returns_at_once(etcd: Any, namespace: str) -> None:
    pub_out, go = CTX.Queue(), CTX.Event()
    go.set()
    pub = CTX.Process(target=publisher, args=(etcd.endpoint, namespace, 3, go, LONG, pub_out), daemon=True)
    pub.start()
    try:
        _get(pub_out, "put")
        _get(pub_out, "put")
        assert _get(pub_out, "drained")[1:] == (0, [])
        _get(pub_out, "closed")
    finally:
        _stop(pub)

"""Many cheap sessions (SessionHub): one writer process holds 50 namespaces over one etcd
connection, one lease and one UCX worker; a reader process pulls every one byte-exact; closing
one store leaves the others working; SIGKILL of the writer ends all its sessions together.

Real etcd, real UCX, separate processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from astate_store import SessionHub, Store, connect
from astate_store.errors import CatalogError
from astate_store.etcd.client import EtcdClient
from tests._procs import CTX
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)
N = 50
TTL = 2.0


def _tensors(i: int, step: int) -> dict[str, torch.Tensor]:
    """Session ``i``'s state at ``step``: different bytes and shapes per session and step."""
    return {
        "context": torch.arange(64 + i, dtype=torch.float32) * (step + 1) + i,
        "position": torch.tensor([i, step], dtype=torch.int64),
    }


def writer_main(endpoint: str, prefix: str, out: Any, go: Any) -> None:
    """The agent process: N sessions from one hub, 2 steps each; then one store is closed and
    another keeps publishing."""
    try:
        hub = SessionHub(etcd=endpoint, lease_ttl=TTL, transport="shm")
        stores = [hub.open(f"{prefix}{i}") for i in range(N)]
        for step in (1, 2):
            for i, s in enumerate(stores):
                s.put(step, _tensors(i, step), meta={"turn": step})
        shared = {
            "leases": sorted({s.catalog.session.lease_id for s in stores}),
            "hub_lease": hub.lease_id,
            "one_transport": all(s.transport.shared is hub.transport for s in stores),
            "distinct_views": len({id(s.transport) for s in stores}),
            "threads": threading.active_count(),
        }
        out.put(("ready", shared))
        go.get(timeout=60)  # the reader has pulled every session
        stores[0].close()
        stores[1].put(3, _tensors(1, 3), meta={"turn": 3})
        out.put(("closed-one", len(hub)))
    except Exception as exc:  # reported to the test, which fails on it
        out.put(("error", f"{type(exc).__name__}: {exc}"))
    time.sleep(300)  # SIGKILLed by the test


def _expect(q: Any, kind: str) -> Any:
    tag, value = q.get(timeout=90)
    assert tag == kind, value
    return value


def _session_records(client: EtcdClient, prefix: str) -> int:
    """Session records of the run's namespaces, from one range read (one etcd revision)."""
    resp = client.call("list", lambda: client.raw.get_prefix_response(f"/astate/{prefix}", keys_only=True))
    return sum(kv.key.decode().endswith("/session") for kv in resp.kvs)


def test_many_sessions_one_process(etcd: Any, namespace: str) -> None:
    prefix = namespace + "-s"
    out, go = CTX.Queue(), CTX.Queue()
    writer = CTX.Process(target=writer_main, args=(etcd.endpoint, prefix, out, go), daemon=True)
    writer.start()
    client = EtcdClient(etcd.endpoint, "_test", lease_ttl=10, op_timeout=5, retry_deadline=15)
    readers: list[Store] = []
    hub = SessionHub(etcd=etcd.endpoint, transport="shm", read_timeout=20.0)
    try:
        shared = _expect(out, "ready")
        # one lease and one UCX worker for all 50 sessions, each store with its own view
        assert shared["leases"] == [shared["hub_lease"]]
        assert shared["one_transport"] and shared["distinct_views"] == N
        assert shared["threads"] < 25, shared  # not a few threads per session
        # Reader process: plain stores for some sessions, a hub (shared worker) for the rest.
        for i in range(N):
            s = (
                connect(f"{prefix}{i}", etcd=etcd.endpoint, transport="shm")
                if i < 5
                else hub.open(f"{prefix}{i}")
            )
            readers.append(s)
            step, got = s.get(timeout=20)
            want = _tensors(i, 2)
            assert step == 2 and set(got) == set(want)
            for k, v in want.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (i, k)
            assert s.meta(2) == {"turn": 2}
        buf = {"context": torch.empty(64 + 7), "position": torch.empty(2, dtype=torch.int64)}
        assert readers[7].get_into(buf, timeout=20) == 2 and torch.equal(
            buf["context"], _tensors(7, 2)["context"]
        )
        assert _session_records(client, prefix) == N
        go.put("closed")
        assert _expect(out, "closed-one") == N - 1
        # closing store 0 removed its session (as revoking its own lease would), and only its
        assert readers[0].catalog.sessions.record() is None
        assert _session_records(client, prefix) == N - 1
        step, got = readers[1].get(step=3, timeout=20)  # the others keep publishing on the shared parts
        assert step == 3 and torch.equal(got["context"], _tensors(1, 3)["context"])
        step, got = readers[2].get(timeout=20)
        assert step == 2 and torch.equal(got["context"], _tensors(2, 2)["context"])
        # SIGKILL: the one lease expires, and every session goes with it in one revision
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
        seen: list[int] = []

        def all_gone() -> bool:
            seen.append(_session_records(client, prefix))
            return seen[-1] == 0

        wait_until(all_gone, 10 * TTL, message="the sessions outlived the writer's lease")
        assert set(seen) <= {N - 1, 0}, seen  # never some sessions gone and others not
        assert all(r.latest() in (2, 3) for r in readers[1:])  # committed versions outlive the writer
    finally:
        if writer.is_alive():
            os.kill(writer.pid, signal.SIGKILL)
            writer.join(10)
        for r in readers[:5]:
            r.close()
        hub.close()
        client.close(revoke=False)


def test_hub_refuses_what_it_shares(etcd: Any, namespace: str) -> None:
    with SessionHub(etcd=etcd.endpoint) as hub:
        with pytest.raises(TypeError, match="lease_ttl"):
            hub.open(namespace, lease_ttl=3.0)  # a hub's sessions share one lease
        with pytest.raises(TypeError, match="unknown Store options"):
            hub.open(namespace, no_such_option=1)
        s = hub.open(namespace)
        with pytest.raises(CatalogError, match="already open"):
            hub.open(namespace)  # one writer per namespace
        with pytest.raises(CatalogError, match="bad namespace"):
            hub.open("a/b")
        s.put(1, {"x": torch.ones(3)})
        assert hub.namespaces == [namespace] and s.latest() == 1
        s.close()
        assert hub.namespaces == []
        again = hub.open(namespace)  # reopened: a new session fences the old epoch
        again.put(2, {"x": torch.full((3,), 2.0)})
        assert again.latest() == 2 and again.catalog.session.epoch == 2
    with pytest.raises(CatalogError, match="closed"):
        hub.open(namespace + "x")

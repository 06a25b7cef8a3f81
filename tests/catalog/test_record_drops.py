"""Closing namespaces' shared-lease records deleted together (catalog/record_drops.py), on real
etcd: each close deletes exactly its own namespace's keys on the given leases, closes that overlap
share the round trips, and every close returns only once its keys are gone."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from astate_store.catalog.record_drops import RecordDrops
from astate_store.etcd.client import EtcdClient

N = 12


def _keys(client: EtcdClient, prefix: str) -> set[str]:
    resp = client.call("list", lambda: client.raw.get_prefix_response(prefix, keys_only=True))
    return {kv.key.decode() for kv in resp.kvs}


def test_overlapping_closes_delete_their_own_records_in_shared_round_trips(etcd: Any) -> None:
    client = EtcdClient(etcd.endpoint, "_drops", lease_ttl=30, op_timeout=5, retry_deadline=15)
    try:
        shared, other = client.new_lease(), client.new_lease()
        run = f"/astate/drops{uuid.uuid4().hex[:6]}-"
        prefixes = [f"{run}{i}/" for i in range(N)]
        for p in prefixes:
            client.raw.put(p + "session", b"s", lease=shared)
            client.raw.put(p + "members/0", b"m", lease=shared)
            client.raw.put(p + "versions/1/commit", b"c")  # leaseless: stays
            client.raw.put(p + "readers/x", b"r", lease=other)  # another lease: stays
        drops, lists = RecordDrops(client), []
        real = client.txn_raw

        def slow_list(*args: Any, **kw: Any) -> Any:
            lists.append(len(args[2]))
            if len(lists) == 1:
                threading.Event().wait(0.5)  # the first leader's list: the other closes queue up
            return real(*args, **kw)

        client.txn_raw = slow_list  # type: ignore[method-assign]
        start = threading.Barrier(N)

        def close(p: str) -> None:
            start.wait()
            drops.drop(p, frozenset({shared}))

        threads = [threading.Thread(target=close, args=(p,)) for p in prefixes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        for p in prefixes:
            assert _keys(client, p) == {p + "versions/1/commit", p + "readers/x"}
        # one list for the first close, one for all those queued behind it (N namespaces, not N lists)
        assert sum(lists) == N and len(lists) <= 3, lists
    finally:
        client.close(revoke=True)

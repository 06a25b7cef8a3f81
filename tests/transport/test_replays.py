"""Replays: a steady pull's plan, copied again from the peer's mapping without checking its rows
again (transport/replays.py), and only while nothing it was checked against has changed.

Real processes, real UCX endpoints, real memfds (the publisher helper of test_transport).
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch

from astate_store.errors import TransportError
from astate_store.transport import UcxTransport
from astate_store.transport import ucx as ucx_module
from tests._transport_peer import pattern
from tests.support.waiting import wait_until
from tests.transport.test_mapped_reads import _spy, _strided_ops
from tests.transport.test_transport import Peer, ops_for

N = 4 << 20


def _count_resolves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of each plan the transport checks and translates (``resolve_rows``)."""
    real = ucx_module.resolve_rows
    seen: list[int] = []

    def spy(t: Any, o: np.ndarray) -> Any:
        seen.append(int(o.shape[0]))
        return real(t, o)

    monkeypatch.setattr(ucx_module, "resolve_rows", spy)
    return seen


@pytest.mark.timeout(120)
def test_a_repeated_plan_is_copied_again_unchecked_and_a_changed_one_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pub = Peer("shm", [N], memfd=True)
    try:
        with UcxTransport("shm") as t:
            t.connect("pub", pub.descriptor)
            p = t.peer_index("pub")
            resolves, copies = _count_resolves(monkeypatch), _spy(monkeypatch, "copy_rows")
            dst = torch.zeros(N, dtype=torch.uint8)
            want = pattern(N, 0).reshape(-1, 8192)[:, :4096].reshape(-1)
            ops = _strided_ops(p, dst, N)
            t.get(ops, timeout=30)
            for again in (ops, ops.copy()):  # the same plan, as the same array or an equal one
                dst.zero_()
                t.get(again, timeout=30)
                assert np.array_equal(dst.numpy()[: want.size], want) and not dst.numpy()[want.size :].any()
            assert resolves == [len(ops)] and copies == [len(ops)] * 3

            ops[0, 2] += 8192  # changed in place: checked again, and its rows read
            t.get(ops, timeout=30)
            assert resolves == [len(ops)] * 2 and np.array_equal(
                dst.numpy()[:4096], pattern(N, 0)[8192:12288]
            )
            ops[0, 2] = N  # out of the region: refused as before, whatever was replayed
            with pytest.raises(TransportError, match="out of bounds"):
                t.get(ops, timeout=30)

            ok = _strided_ops(p, dst, N)  # the first plan again: still kept
            t.get(ok, timeout=30)
            assert len(resolves) == 3  # the two plans and the refused one
            extra = torch.zeros(4096, dtype=torch.uint8)
            t.register_tensor(extra)  # another local table: checked again
            t.get(ok, timeout=30)
            t.get(ok, timeout=30)
            assert len(resolves) == 4
            t.connect("pub", pub.call("register", 1 << 16))  # the peer's regions change: again
            t.get(ok, timeout=30)
            assert len(resolves) == 5
            assert np.array_equal(dst.numpy()[: want.size], want)
    finally:
        pub.stop()


@pytest.mark.timeout(120)
def test_a_replay_keeps_no_mapping_of_a_disconnected_peer() -> None:
    """A replay holds the snapshot that holds the peer's mappings: disconnecting the peer
    drops it, so the mapping is still unmapped (the publisher's pages can be freed)."""
    pub = Peer("shm", [N], memfd=True)
    try:
        with UcxTransport("shm") as t:
            t.connect("pub", pub.descriptor)
            dst = torch.zeros(N, dtype=torch.uint8)
            ops = ops_for([(t.peer_index("pub"), 0, 0, dst.data_ptr(), N)])
            t.get(ops, timeout=30)
            t.get(ops, timeout=30)
            start = f"{t._peers.get('pub').maps[0].address:x}-"

            def mapped() -> bool:
                with open("/proc/self/maps") as f:
                    return any(line.startswith(start) for line in f)

            assert mapped()
            t.disconnect("pub")
            gc.collect()
            wait_until(
                lambda: not mapped(), 30, interval=0.01, message="the peer's mapping outlived disconnect"
            )
    finally:
        pub.stop()

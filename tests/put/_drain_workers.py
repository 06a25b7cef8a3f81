"""Processes of tests/put/test_drain.py: one publisher that drains, consumers that pull late or die."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

SHAPE = (64, 32)


def value(step: int) -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) * 0.5 + step


def publisher(endpoint: str, ns: str, steps: int, go: Any, timeout: float, out: Any) -> None:
    """Put steps 1..steps-1, wait for ``go`` (the consumers pulled), put ``steps``, drain, report
    (drain's count, the consumer records left right after it), then close."""
    import astate_store

    store = astate_store.connect(ns, etcd=endpoint, rank=0, world_size=1, session_id=f"{ns}-pub")
    try:
        for step in range(1, steps):
            store.put(step, {"w": value(step)})
        out.put(("put", steps - 1))
        go.wait(60)
        store.put(steps, {"w": value(steps)})
        out.put(("put", steps))
        left = store.drain(timeout)
        out.put(("drained", left, sorted(store.catalog.consumers.ids())))
    finally:
        store.close()
    out.put(("closed", os.getpid()))


def consumer(endpoint: str, ns: str, first: int, last: int, delay: float, out: Any) -> None:
    """Pull ``first`` (this registers the consumer), report, wait ``delay`` seconds, pull ``last``
    and report what came (or the error), then close."""
    import astate_store

    buf = torch.zeros(SHAPE)
    with astate_store.connect(ns, etcd=endpoint, lease_ttl=2.0) as store:
        got = store.get_into({"w": buf}, step=first, timeout=30)
        out.put(("ready", store.consumer_id, got, torch.equal(buf, value(got)), os.getpid()))
        time.sleep(delay)
        try:
            got = store.get_into({"w": buf}, step=last, timeout=30)
            out.put(("got", store.consumer_id, got, torch.equal(buf, value(got))))
        except Exception as exc:  # the test asserts on it
            out.put(("error", store.consumer_id, f"{type(exc).__name__}: {exc}"))

"""The CUDA path: GPU->GPU, CPU->GPU and GPU->CPU pulls between processes. Skips without a GPU."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from typing import Any

import pytest
import torch

from astate_store.store import Store
from tests._store_workers import device_publisher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CTX = mp.get_context("spawn")


@pytest.mark.parametrize("src,dst", [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")])
def test_pull_between_devices(etcd: Any, src: str, dst: str) -> None:
    ns, numel = "cuda-" + uuid.uuid4().hex[:8], 1 << 22
    out = CTX.Queue()
    p = CTX.Process(target=device_publisher, args=(etcd.endpoint, ns, src, numel, out), daemon=True)
    p.start()
    try:
        assert out.get(timeout=120) == ("put", 1)
        buf = torch.zeros(numel, device=dst)
        ptr = buf.data_ptr()
        with Store(ns, endpoint=etcd.endpoint, transport="auto") as store:
            assert store.get_into({"w": buf}, timeout=60) == 1
        assert buf.data_ptr() == ptr
        assert torch.equal(buf.cpu(), torch.arange(numel, dtype=torch.float32))
    finally:
        p.kill()
        p.join(10)


def test_snapshot_staging_lives_on_the_device(etcd: Any) -> None:
    with Store("cuda-" + uuid.uuid4().hex[:8], endpoint=etcd.endpoint, transport="auto") as store:
        store.put(1, {"w": torch.ones(1024, device="cuda")})
        assert store.staging.device is not None and store.staging.device.startswith("cuda")
        assert store.staging.snapshot_bytes >= 1024 * 4
        buf = torch.zeros(1024, device="cuda")
        assert store.get_into({"w": buf}, timeout=60) == 1  # the device staging is what consumers read
        assert torch.equal(buf, torch.ones(1024, device="cuda"))

"""examples/ray_sync.py on a real local Ray cluster: two FSDP2 trainer actors (their own gloo group) and
two rollout actors (plain HF, vLLM-style fused) sync through the store; the actors learn etcd's endpoint
only from the job's runtime_env (``ASTATE_ETCD``), and every step the rollouts' logits equal the
trainer's bit for bit. The model here ties lm_head to the embedding (one storage under two names), the
case tests/integrations/test_rl_loop.py leaves out."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from examples import ray_sync, rl_loop  # noqa: E402

STEPS = 2


@pytest.fixture
def ray_cluster(etcd: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # Ray's processes inherit the driver's environment: without ASTATE_ETCD there, the only way the
    # actors can find etcd is the runtime_env the example documents.
    monkeypatch.delenv("ASTATE_ETCD", raising=False)
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray_sync.start_ray(etcd.endpoint, num_cpus=4, temp_dir=temp)
    try:
        yield etcd.endpoint
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow  # a Ray cluster's start and the sync: about a minute
@pytest.mark.timeout(240)
def test_ray_trainer_and_rollout_actors_sync_through_the_store(ray_cluster: str, namespace: str) -> None:
    o = rl_loop.LoopOptions(etcd="", namespace=namespace, steps=STEPS, timeout=120.0, tied=True)
    reports = ray_sync.run(o)
    assert [r.step for r in reports] == list(range(1, STEPS + 1))
    labels = {rl_loop.rollout_label(i, k) for i, k in enumerate(o.rollouts)}
    for r in reports:
        assert set(r.equal) == labels and all(r.equal.values()), r.line()
        assert r.moved, r.line()  # the trainer's weights changed: every pull had new bytes to move
        assert all(ms > 0 for ms in r.sync_ms.values()), r.line()
    good, last = rl_loop.summary(reports, o)
    assert good and last.startswith("ok"), last

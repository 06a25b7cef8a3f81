"""A trainer's full state beyond weights: FSDP2 model and Adam state (DTensors), RNG state, step
and param groups go out with ``put(..., meta=...)``, into a checkpoint, and come back into
another layout (one process, no FSDP) with ``restore`` and ``meta``."""

from __future__ import annotations

import socket
from typing import Any

import torch

from astate_store.model.state_dict import flatten_state_dict
from astate_store.model.usermeta import set_rng_state
from astate_store.store import Store
from tests._procs import CTX
from tests._training_state_workers import full_training_state, make_model, train_step, trainer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_results(etcd: Any, ns: str, uri: str, ref: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, port = CTX.Queue(), _port()
    procs = [
        CTX.Process(target=trainer, args=(etcd.endpoint, ns, r, port, uri, ref, out), daemon=True)
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            kind, rank, why = out.get(timeout=180)
            assert kind == "done", f"rank {rank} failed:\n{why}"
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    saved = torch.load(ref)
    return saved["full"], saved["draw"]


def test_full_training_state_checkpoints_and_restores_into_another_layout(etcd, namespace, tmp_path):
    uri = str(tmp_path / "ckpt")
    full, next_draw = _trainer_results(etcd, namespace, uri, str(tmp_path / "reference.pt"))

    # A restarted trainer of another layout: one process, plain tensors. Adam's state exists only
    # after a first step, so one step with zero gradients makes the buffers to restore into.
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    tensors, _meta = full_training_state(model, optim)
    with Store(namespace + "-restart", endpoint=etcd.endpoint, transport="shm") as store:
        assert store.restore(tensors, uri=uri) == 2
        meta = store.meta(2)
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model,
        optim,
        model_state_dict=tensors["model"],
        optim_state_dict={"state": tensors["optim"], "param_groups": meta["param_groups"]},
    )
    got = flatten_state_dict(full_training_state(model, optim)[0])
    assert set(got) == set(full) and any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in got)
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    assert meta["step"] == 2 and optim.param_groups[0]["lr"] == 0.01  # the trainer's, not 0.5
    set_rng_state(meta["rng"])
    assert torch.equal(torch.rand(3), next_draw)
    # and training goes on from the restored state exactly as the trainer would
    train_step(model, optim, 3)

"""Processes for the control-plane tests: a publisher rank of a model with 10^5 tiny tensors."""

from __future__ import annotations

from typing import Any

import torch


def tiny_model(total: int, ranks: int, rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share (expert-parallel style: tensor i lives on rank i % ranks) of a model
    of ``total`` two-element tensors; tensor i holds (i, step) so any process can check it."""
    return {
        f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w": torch.tensor([float(i), float(step)])
        for i in range(rank, total, ranks)
    }


def scale_publisher(endpoint: str, ns: str, rank: int, ranks: int, total: int, cmds: Any, out: Any) -> None:
    from astate_store.store import Store

    with Store(
        ns, endpoint=endpoint, rank=rank, world_size=ranks, transport="shm", session_id=ns, lease_ttl=30
    ) as store:
        tensors = tiny_model(total, ranks, rank, 0)
        out.put(("ready", rank))
        while True:
            cmd = cmds.get()
            if cmd[0] == "exit":
                break
            step = cmd[1]
            for t in tensors.values():
                t[1] = float(step)
            out.put(("put", rank, store.put(step, tensors)))

"""A 2-rank FSDP2 trainer (gloo) that saves its full training state through the store: model
and Adam state (DTensors), RNG, step and the optimizer's param groups (meta), then a checkpoint.
The recipe of docs/replicas.md "A trainer's full state"."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from torch import nn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 5))  # 9 and 5 rows: uneven on 2 ranks


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank (FSDP averages)
    x = torch.randn(4, 6, generator=g)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def full_training_state(
    model: nn.Module, optim: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, meta) of the recipe: DCP's FQN-keyed model and optimizer state dicts; the
    optimizer's tensors go in as tensors, its param groups (floats, bools, names) as meta."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd["state"]}, {"param_groups": osd["param_groups"]}


def trainer(endpoint: str, ns: str, rank: int, port: int, uri: str, ref: str, out: Any) -> None:
    """Train 2 steps, put both with meta, checkpoint step 2; rank 0 saves the reference to ``ref``."""
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from astate_store.model.usermeta import rng_state
        from astate_store.store import Store

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model = make_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        torch.manual_seed(7)  # the RNG state the restored trainer must get back
        with Store(ns, endpoint=endpoint, rank=rank, world_size=2, session_id=f"{ns}-train") as store:
            for step in (1, 2):
                train_step(model, optim, step)
                tensors, meta = full_training_state(model, optim)
                store.put(step, tensors, meta={**meta, "step": step, "rng": rng_state()})
            store.wait(2, timeout=60)
            store.checkpoint(2, uri)
            tensors, _ = full_training_state(model, optim)
            # The reference: every tensor whole, gathered by torch itself, and the next draw.
            from astate_store.model.state_dict import flatten_state_dict

            full = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                for k, v in flatten_state_dict(tensors).items()
            }
            if rank == 0:
                torch.save({"full": full, "draw": torch.rand(3)}, ref)  # a file: tensors outlive this process
            out.put(("done", rank, None))
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))

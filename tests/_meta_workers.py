"""A publisher rank that stores per-rank meta with each step and checkpoints the last one."""

from __future__ import annotations

import os
from typing import Any

import torch


def rank_tensors(rank: int, step: int) -> dict[str, Any]:
    from astate_store import Shard

    rows = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8) + 1000 * step + 100 * rank
    return {"w": Shard(rows, (4 * rank, 0), (8, 8))}


def rank_meta(rank: int, step: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "step": step,
        "loader": {"epoch": 1, "offset": 17 * step + rank},
        "lr": 0.5 / (step + 1),
        "tags": ["a", b"\x00\xff", None, True],
    }


def publisher(endpoint: str, ns: str, rank: int, steps: int, uri: str, out: Any) -> None:
    """Rank ``rank`` of 2: put steps 1..steps with meta, checkpoint the last, report, exit."""
    from astate_store.store import Store

    torch.manual_seed(rank)
    with Store(
        ns, endpoint=endpoint, rank=rank, world_size=2, transport="shm", session_id=f"{ns}-s"
    ) as store:
        for step in range(1, steps + 1):
            store.put(step, rank_tensors(rank, step), meta=rank_meta(rank, step))
        store.wait(steps, timeout=30)
        store.checkpoint(steps, uri)
        out.put(("done", rank, os.getpid()))

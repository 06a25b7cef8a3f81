"""Publisher processes for the delta tests (tests/get/test_delta.py), and the sparse model both
sides rebuild: every tensor's value at step s is a pure function of (name, step), where each
step changes a few elements (about 2%) and a *dense* step changes all of them.

The "mixed" tensors of ``_store_workers`` (row, column, uneven, expert and replicated splits, a
0-d counter) plus ``bits``: float32 whose changes are raw-bit ones (0.0 and -0.0, NaNs of
different payloads), which only a comparison of bits tells apart.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

import torch

from tests._store_workers import SPECS, Box, split, whole
from tests.support.data import value

SPEC: dict[str, Any] = {
    **SPECS["mixed"],
    "bits": ((64, 40), torch.float32, lambda r, n: split((64, 40), 0, n, r)),
}
FRACTION = 0.02


def _bits(shape: tuple[int, ...], step: int) -> torch.Tensor:
    """Raw-bit patterns: 0.0 / -0.0 and NaNs whose payload is the step."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    sign = 0x80000000 if step % 2 else 0  # 0.0 and -0.0 in turn
    pat = torch.where(i % 3 == 0, torch.tensor(0x7FC00000 + step), torch.where(i % 3 == 1, sign, 0))
    return pat.to(torch.int32).view(torch.float32).reshape(shape)


def _value(name: str, shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
    return _bits(shape, step) if name == "bits" else value(name, shape, dtype, step)


def sparse(name: str, step: int, dense: tuple[Any, ...] = ()) -> torch.Tensor:
    """The global tensor ``name`` at ``step``: step 0's values, then per step k <= step about
    ``FRACTION`` of the elements take step k's values (all of them when ``dense`` holds k, or
    (name, k): that tensor alone changes entirely)."""
    shape, dtype, _ = SPEC[name]
    t = _value(name, shape, dtype, 0).clone()
    flat = t.view(-1)
    for k in range(1, step + 1):
        new = _value(name, shape, dtype, k).reshape(-1)
        if k in dense or (name, k) in dense or t.dim() == 0:
            flat.copy_(new)
            continue
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{k}".encode()))
        pick = torch.rand(flat.numel(), generator=g) < FRACTION
        flat[pick] = new[pick]
    return t


def piece_of(name: str, step: int, box: Box, dense: tuple[Any, ...] = ()) -> torch.Tensor:
    offs, sizes = box
    return sparse(name, step, dense)[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]


def local_tensors(step: int, tp_rank: int, tp_size: int, dense: tuple[Any, ...] = ()) -> dict[str, Any]:
    from astate_store import Shard

    out: dict[str, Any] = {}
    for name, (shape, _dt, boxer) in SPEC.items():
        box = boxer(tp_rank, tp_size)
        out[name] = Shard(piece_of(name, step, box, dense).clone(), box[0], shape)
    return out


def delta_publisher(
    endpoint: str,
    ns: str,
    rank: int,
    world: int,
    transport: str,
    cmds: Any,
    out: Any,
    session: str,
    options: dict[str, Any],
) -> None:
    """A trainer rank publishing the sparse model with ``delta=True``: on ("put", step, dense)
    it writes step's values into its tensors (the same objects every step) and puts them; on
    ("exit",) it leaves."""
    import astate_store
    from astate_store.store import Store

    store = Store(
        ns,
        endpoint=endpoint,
        rank=rank,
        world_size=world,
        transport=transport,
        session_id=f"{ns}-{session}",
        lease_ttl=3.0,
        delta=True,
        **options,
    )
    tensors = local_tensors(0, rank, world)
    out.put(("ready", rank, os.getpid()))
    while True:
        cmd = cmds.get()
        if cmd[0] == "exit":
            break
        step, dense = cmd[1], tuple(tuple(d) if isinstance(d, list) else d for d in cmd[2])
        new = local_tensors(step, rank, world, dense)
        for name, sh in tensors.items():
            sh.tensor.copy_(new[name].tensor)
        try:
            committed = store.put(step, tensors)
            out.put(("put", rank, step, committed))
        except astate_store.AStateError as exc:
            out.put(("error", rank, step, f"{type(exc).__name__}: {exc}"))
    store.close()
    out.put(("bye", rank))
    time.sleep(0.1)


__all__ = ["SPEC", "sparse", "piece_of", "local_tensors", "delta_publisher", "whole", "split"]

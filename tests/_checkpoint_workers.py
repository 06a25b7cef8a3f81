"""Model specs and child processes for the checkpoint tests.

Every tensor's value at step s is a pure function of (name, step), so any process can compute the
expected global tensor and check restored buffers byte for byte.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tests._store_workers import split, whole  # noqa: F401  (shared split helpers)
from tests.support.data import value

BoxT = tuple[tuple[int, ...], tuple[int, ...]]


# name -> (global shape, dtype, publisher box for (rank, world), consumer box for (index, consumers))
SPEC: dict[
    str, tuple[tuple[int, ...], torch.dtype, Callable[[int, int], BoxT], Callable[[int, int], BoxT]]
] = {
    "emb": (
        (64, 48),
        torch.float32,
        lambda r, n: split((64, 48), 0, n, r),
        lambda c, n: split((64, 48), 1, n, c),
    ),  # row -> column
    "qkv": (
        (96, 48),
        torch.bfloat16,
        lambda r, n: split((96, 48), 1, n, r),
        lambda c, n: split((96, 48), 0, n, c),
    ),  # column -> row
    "odd": (
        (37, 29),
        torch.float32,
        lambda r, n: split((37, 29), 0, n, r, uneven=True),
        lambda c, n: split((37, 29), 1, n, c, uneven=True),
    ),  # uneven both ways
    "experts": (
        (8, 24, 16),
        torch.float16,
        lambda r, n: split((8, 24, 16), 0, n, r),
        lambda c, n: split((8, 24, 16), 1, n, c),
    ),  # 3-D, other dim
    "norm": (
        (48,),
        torch.float32,
        lambda r, n: whole((48,)),
        lambda c, n: split((48,), 0, n, c),
    ),  # replicated
    "step_count": ((), torch.int64, lambda r, n: whole(()), lambda c, n: whole(())),  # 0-d
    "mask": (
        (10, 3),
        torch.bool,
        lambda r, n: split((10, 3), 1, n, r, uneven=True),
        lambda c, n: split((10, 3), 0, n, c),
    ),
    "empty": ((0, 5), torch.float32, lambda r, n: whole((0, 5)), lambda c, n: whole((0, 5))),
}


def expected(name: str, step: int) -> torch.Tensor:
    shape, dtype, _, _ = SPEC[name]
    return value(name, shape, dtype, step)


def box_slice(box: BoxT) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(box[0], box[1]))


def rank_tensors(
    step: int, rank: int, world: int, *, strided: bool = False, names: Sequence[str] | None = None
) -> dict[str, Any]:
    """This rank's ``{name: Shard}`` of the spec; ``strided`` makes every 2-d+ piece a non-contiguous view."""
    from astate_store import Shard

    out: dict[str, Any] = {}
    for name, (shape, dtype, pub, _) in SPEC.items():
        if names is not None and name not in names:
            continue
        offs, sizes = pub(rank, world)
        piece = expected(name, step)[box_slice((offs, sizes))].clone()
        if strided and piece.dim() >= 2:
            piece = piece.transpose(0, 1).contiguous().transpose(0, 1)  # same values, column-major memory
        out[name] = Shard(piece, offs, shape)
    return out


def rank_shards(step: int, rank: int, world: int, **kw: Any) -> list:
    from astate_store import checkpoint as ck

    return ck.local_shards(rank_tensors(step, rank, world, **kw), rank=rank)


# ---- child processes (multiprocessing spawn targets) --------------------------------------------


def write_and_commit(
    root: str, step: int, rank: int, world: int, checksum: str, barrier: Any, results: Any
) -> None:
    """Write this rank's part, wait for every rank, then race try_commit."""
    from astate_store import checkpoint as ck

    info = ck.write_part(root, step, rank, world, rank_shards(step, rank, world), checksum=checksum)
    barrier.wait(timeout=60)
    results.put((rank, info.file, ck.try_commit(root, step, world)))


def pause_at(root: str, step: int, world: int, point: str, big_mib: int, checksum: str, conn: Any) -> None:
    """Write every rank's part and commit ``step``, pausing forever at hook ``point`` (the parent
    SIGKILLs this process there). ``big_mib`` adds a tensor large enough that the data write spans
    many chunks, so "data_started" is genuinely mid-file. ``conn``: this child's own pipe (a shared
    Queue's write lock could be left held by a killed child)."""
    from astate_store import checkpoint as ck
    from astate_store.model.layout import Box, ShardRecord, contiguous_strides

    def hook(p: str) -> None:
        if p == point:
            conn.send((os.getpid(), p))
            time.sleep(3600)

    ck._TEST_HOOK = hook
    for r in range(world):
        shards = rank_shards(step, r, world)
        if big_mib:
            n = big_mib << 18  # float32 elements
            big = torch.full((n,), float(step), dtype=torch.float32)
            rows = n // world
            rec = ShardRecord(
                "big", "float32", (n,), Box((r * rows,), (rows,)), contiguous_strides((rows,)), r, 0, 0
            )
            shards.append((rec, big[r * rows : (r + 1) * rows]))
        ck.write_part(root, step, r, world, shards, fsync=False, checksum=checksum)
    ck.try_commit(root, step, world, fsync=False)
    conn.send((os.getpid(), "done"))

"""`make demo`: a real weight sync on one machine.

A trainer group (2 processes, Megatron-style TP=2) holds a small transformer made here,
updates it every RL step and ``put``s it; two rollout groups laid out differently pull it
into their preallocated models with ``get_into``: one process with the whole model, and
two processes that split every matrix on the other dimension. Every step, each side's
exact bit checksum of every tensor is compared, and per-step sync time and GB/s printed.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import sys
import time
from typing import Any

import torch

from astate_store.etcd.embedded import EmbeddedEtcd
from astate_store.model.layout import Shard
from astate_store.store import Store

NS = "demo-policy"


def model_spec(hidden: int, layers: int, vocab: int, mlp: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (global shape, how Megatron TP splits it: rows 'col'umn-parallel, 'row'-parallel, 'rep')."""
    spec: dict[str, tuple[tuple[int, ...], str]] = {"embed.weight": ((vocab, hidden), "col")}
    for i in range(layers):
        p = f"layers.{i}."
        spec[p + "attn.qkv.weight"] = ((3 * hidden, hidden), "col")
        spec[p + "attn.out.weight"] = ((hidden, hidden), "row")
        spec[p + "mlp.up.weight"] = ((mlp, hidden), "col")
        spec[p + "mlp.down.weight"] = ((hidden, mlp), "row")
        spec[p + "norm1.weight"] = ((hidden,), "rep")
        spec[p + "norm2.weight"] = ((hidden,), "rep")
    spec["final_norm.weight"] = ((hidden,), "rep")
    return spec


def _box(
    shape: tuple[int, ...], dim: int | None, rank: int, parts: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if dim is None:
        return (0,) * len(shape), shape
    offs, sizes = [0] * len(shape), list(shape)
    step = shape[dim] // parts
    offs[dim], sizes[dim] = rank * step, step if rank < parts - 1 else shape[dim] - rank * step
    return tuple(offs), tuple(sizes)


def trainer_box(
    kind: str, shape: tuple[int, ...], rank: int, tp: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _box(shape, {"col": 0, "row": 1, "rep": None}[kind], rank, tp)


def rollout_box(shape: tuple[int, ...], rank: int, parts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The rollout split: every matrix on its last dim (where the trainer split rows, and vice versa)."""
    return _box(shape, len(shape) - 1 if len(shape) == 2 and parts > 1 else None, rank, parts)


def bit_checksum(t: torch.Tensor) -> int:
    """Exact and partition-independent: the sum of the float32 bit patterns."""
    return int(t.contiguous().view(torch.int32).to(torch.int64).sum())


def _init(name: str, sizes: tuple[int, ...], offs: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    # Same global values whatever the split: a function of the global index.
    idx = torch.zeros(sizes, dtype=torch.float64)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        ar = torch.arange(offs[d], offs[d] + sizes[d], dtype=torch.float64) * stride
        idx += ar.view([-1 if i == d else 1 for i in range(len(shape))])
        stride *= shape[d]
    return (torch.sin(idx * 0.001 + sum(map(ord, name))) * 0.02).float()


def trainer(
    rank: int, tp: int, endpoint: str, spec: dict[str, Any], steps: int, barrier: Any, out: Any
) -> None:
    logging.basicConfig(level=logging.WARNING)
    params = {}
    for name, (shape, kind) in spec.items():
        offs, sizes = trainer_box(kind, shape, rank, tp)
        params[name] = Shard(_init(name, sizes, offs, shape), offs, shape)
    with Store(NS, endpoint=endpoint, rank=rank, world_size=tp, session_id="demo-trainer") as store:
        for step in range(1, steps + 1):
            with torch.no_grad():
                for p in params.values():  # one SGD step on a made-up elementwise loss
                    p.tensor.sub_(0.01 * torch.cos(p.tensor * step))
            t0 = time.perf_counter()
            store.put(step, params)
            put_s = time.perf_counter() - t0
            sums = {n: bit_checksum(p.tensor) for n, p in params.items() if spec[n][1] != "rep" or rank == 0}
            out.put(("trainer", rank, step, put_s, sums))
            barrier.wait()


def rollout(
    group: str, rank: int, parts: int, endpoint: str, spec: dict[str, Any], steps: int, barrier: Any, out: Any
) -> None:
    logging.basicConfig(level=logging.WARNING)
    bufs = {}
    for name, (shape, _kind) in spec.items():
        offs, sizes = rollout_box(shape, rank, parts)
        bufs[name] = Shard(torch.empty(sizes, dtype=torch.float32), offs, shape)
    nbytes = sum(b.tensor.numel() * 4 for b in bufs.values())
    ptrs = {n: b.tensor.data_ptr() for n, b in bufs.items()}
    with Store(NS, endpoint=endpoint) as store:
        for step in range(1, steps + 1):
            store.wait(step, timeout=120)  # time the pull, not the trainer's update
            t0 = time.perf_counter()
            got = store.get_into(bufs, step=step, timeout=120)
            dt = time.perf_counter() - t0
            assert {n: b.tensor.data_ptr() for n, b in bufs.items()} == ptrs, "buffers moved"
            sums = {
                n: bit_checksum(b.tensor) for n, b in bufs.items() if not (len(spec[n][0]) == 1 and rank > 0)
            }
            out.put(("rollout", f"{group}{rank}", got, dt, nbytes, sums))
            barrier.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args(argv)
    spec = model_spec(args.hidden, args.layers, args.vocab, 4 * args.hidden)
    total = sum(torch.Size(s).numel() * 4 for s, _ in spec.values())
    ctx = mp.get_context("spawn")
    with EmbeddedEtcd() as etcd:
        print(f"embedded etcd at {etcd.endpoint}; model: {len(spec)} tensors, {total / 2**20:.0f} MiB fp32")
        print(
            "trainer: 2 processes, TP=2 (column/row-parallel); rollout A: 1 process, whole model; "
            "rollout B: 2 processes, every matrix split on its other dim"
        )
        barrier, out = ctx.Barrier(5), ctx.Queue()
        procs = [
            ctx.Process(target=trainer, args=(r, 2, etcd.endpoint, spec, args.steps, barrier, out))
            for r in range(2)
        ]
        procs.append(
            ctx.Process(target=rollout, args=("A", 0, 1, etcd.endpoint, spec, args.steps, barrier, out))
        )
        procs += [
            ctx.Process(target=rollout, args=("B", r, 2, etcd.endpoint, spec, args.steps, barrier, out))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        ok = True
        for step in range(1, args.steps + 1):
            msgs = [out.get(timeout=300) for _ in procs]
            want: dict[str, int] = {}
            for m in msgs:
                if m[0] == "trainer":
                    for n, v in m[4].items():
                        want[n] = want.get(n, 0) + v
            line = [f"step {step}:"]
            put_s = max(m[3] for m in msgs if m[0] == "trainer")
            line.append(f"put {put_s * 1e3:6.1f} ms")
            for grp in ("A", "B"):
                ms = [m for m in msgs if m[0] == "rollout" and m[1].startswith(grp)]
                got: dict[str, int] = {}
                for m in ms:
                    for n, v in m[5].items():
                        got[n] = got.get(n, 0) + v
                match = got == want and all(m[2] == step for m in ms)
                ok &= match
                dt = max(m[3] for m in ms)
                nb = sum(m[4] for m in ms)
                line.append(
                    f"rollout {grp}: {dt * 1e3:6.1f} ms {nb / dt / 1e9:5.2f} GB/s "
                    f"checksum {'OK' if match else 'MISMATCH'}"
                )
            print(" | ".join(line), flush=True)
        for p in procs:
            p.join(60)
        ok &= all(p.exitcode == 0 for p in procs)
        print("all steps verified" if ok else "FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Worker processes for ``benchmarks/sync_bench.py``: model specs, trainer and rollout roles, gloo.

One generic worker process per role slot (2 trainer slots, 2 rollout slots) is reused across
cases, so a case costs tensor set-up, not a Python + torch start. Workers talk to the driver
through queues: the driver sends ``(command, *args)``, the worker answers ``("ok", payload)``
or ``("error", text)``; a worker never raises out of its loop.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import traceback
from typing import Any

import numpy as np
import torch

Spec = dict[str, tuple[tuple[int, ...], str]]  # name -> (global shape, Megatron kind: col/row/rep)
Box = tuple[tuple[int, ...], tuple[int, ...]]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


# ---------------------------------------------------------------------------------------- models


def transformer_spec(gib: float) -> Spec:
    """A GPT-like model of about ``gib`` GiB in fp32 (embedding, L x (qkv, out, up, down, 2 norms),
    final norm, lm_head). hidden 2048 / vocab 32768 / 8 layers is exactly 2 GiB + the norms."""
    target = gib * 2**30 / 4  # elements
    hidden = 2048
    while hidden > 256 and 2 * 16 * hidden * hidden + 12 * hidden * hidden > target:
        hidden //= 2
    vocab = 16 * hidden
    layers = max(1, round((target - 2 * vocab * hidden) / (12 * hidden * hidden)))
    spec: Spec = {"embed.weight": ((vocab, hidden), "col")}
    for i in range(layers):
        p = f"layers.{i}."
        spec[p + "attn.qkv.weight"] = ((3 * hidden, hidden), "col")
        spec[p + "attn.out.weight"] = ((hidden, hidden), "row")
        spec[p + "mlp.up.weight"] = ((4 * hidden, hidden), "col")
        spec[p + "mlp.down.weight"] = ((hidden, 4 * hidden), "row")
        spec[p + "norm1.weight"] = ((hidden,), "rep")
        spec[p + "norm2.weight"] = ((hidden,), "rep")
    spec["final_norm.weight"] = ((hidden,), "rep")
    spec["lm_head.weight"] = ((vocab, hidden), "col")
    return spec


def many_shape(gib: float, n: int, cols: int = 256) -> tuple[int, int]:
    """(rows, cols) of each of ``n`` equal tensors that together hold about ``gib`` GiB of fp32."""
    rows = max(2, int(gib * 2**30 / 4 / n / cols))
    return rows, cols


def many_spec(gib: float, n: int) -> Spec:
    rows, cols = many_shape(gib, n)
    return {f"t{i:05d}.weight": ((rows, cols), "col") for i in range(n)}


def single_spec(gib: float, n: int) -> Spec:
    """One tensor with exactly the bytes of :func:`many_spec` (gib, n)."""
    rows, cols = many_shape(gib, n)
    return {"flat.weight": ((rows * n, cols), "col")}


def make_spec(kind: str, gib: float, n_many: int) -> Spec:
    if kind == "transformer":
        return transformer_spec(gib)
    if kind == "many":
        return many_spec(gib, n_many)
    if kind == "single":
        return single_spec(gib, n_many)
    raise ValueError(kind)


def split(shape: tuple[int, ...], dim: int, parts: int, index: int) -> Box:
    n = shape[dim]
    lo, hi = n * index // parts, n * (index + 1) // parts
    offs, sizes = [0] * len(shape), list(shape)
    offs[dim], sizes[dim] = lo, hi - lo
    return tuple(offs), tuple(sizes)


def box_of(rule: str, shape: tuple[int, ...], kind: str, rank: int, parts: int) -> Box:
    """The box a rank holds.

    rules: ``megatron`` (col-parallel kind -> dim 0, row-parallel kind -> dim 1, rep whole),
    ``dim0`` (every matrix on dim 0), ``lastdim`` (every matrix on its last dim), ``whole``.
    1-d tensors are always whole (replicated)."""
    if rule == "whole" or parts == 1 or len(shape) < 2 or kind == "rep":
        return (0,) * len(shape), shape
    if rule == "megatron":
        return split(shape, 0 if kind == "col" else 1, parts, rank)
    if rule == "dim0":
        return split(shape, 0, parts, rank)
    if rule == "lastdim":
        return split(shape, len(shape) - 1, parts, rank)
    raise ValueError(rule)


def fill_values(t: torch.Tensor, name: str, box: Box, global_shape: tuple[int, ...]) -> None:
    """Deterministic values that are a function of (name, global index) only, so replicas agree."""
    salt = (sum(map(ord, name)) % 251) * 0.01
    offs, sizes = box
    tmp = t if t.dtype == torch.float32 else torch.empty(sizes, dtype=torch.float32)
    if len(global_shape) == 1:
        torch.arange(offs[0], offs[0] + sizes[0], dtype=torch.float32, out=tmp)
        tmp.mul_(1e-4).add_(salt)
        if tmp is not t:
            t.copy_(tmp)
        return
    rows = torch.arange(offs[0], offs[0] + sizes[0], dtype=torch.float32).mul_(1e-3).view(-1, 1)
    cols = torch.arange(offs[1], offs[1] + sizes[1], dtype=torch.float32).mul_(1e-6).add_(salt).view(1, -1)
    torch.add(rows, cols, out=tmp)
    if tmp is not t:
        t.copy_(tmp)


def bit_checksum(t: torch.Tensor) -> int:
    """Exact and partition-independent: the sum of the bit patterns."""
    return int(t.contiguous().view(_INT_VIEW[t.dtype]).to(torch.int64).sum())


def alloc(shape: tuple[int, ...], dtype: torch.dtype, how: str) -> torch.Tensor:
    """A destination buffer as a user would make it: ``torch`` (torch.empty: 4 KiB pages unless
    THP_MEM_ALLOC_ENABLE=1) or ``thp`` (numpy-backed: numpy madvises huge pages on big arrays)."""
    if how == "torch":
        return torch.empty(shape, dtype=dtype)
    if how == "thp":
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        return torch.from_numpy(np.empty(max(n, 1), dtype=np.uint8))[:n].view(dtype).view(shape)
    raise ValueError(how)


def thp_kib() -> int:
    """AnonHugePages of this process (KiB): how much of its memory sits on transparent huge pages."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


# ---------------------------------------------------------------------------------------- roles


class _Trainer:
    def __init__(self, endpoint: str, cfg: dict[str, Any], rank: int):
        from astate_store import Shard
        from astate_store.store import Store

        self.rank, self.tp = rank, cfg["tp"]
        self.spec = make_spec(cfg["model"], cfg["gib"], cfg["n_many"])
        dtype = DTYPES[cfg["dtype"]]
        self.params: dict[str, Any] = {}
        for name, (shape, kind) in self.spec.items():
            box = box_of(cfg["rule"], shape, kind, rank, self.tp)
            t = torch.empty(box[1], dtype=dtype)
            fill_values(t, name, box, shape)
            self.params[name] = Shard(t, box[0], shape)
        self.store = Store(
            cfg["ns"],
            endpoint=endpoint,
            rank=rank,
            world_size=self.tp,
            transport=cfg["transport"],
            session_id=cfg["ns"] + "-trainer",
        )
        self.nbytes = sum(p.tensor.numel() * p.tensor.element_size() for p in self.params.values())

    def put(self, step: int) -> dict[str, Any]:
        with torch.no_grad():
            for p in self.params.values():  # a cheap per-step change: element 0 of every piece
                p.tensor.view(-1)[0] = float(step)
        t0 = time.perf_counter()
        committed = self.store.put(step, self.params)
        return {"put_s": time.perf_counter() - t0, "committed": committed}

    def checksum(self, as_dtype: str | None) -> dict[str, int]:
        out = {}
        for n, p in self.params.items():
            if self.spec[n][1] == "rep" and self.rank != 0:
                continue
            t = p.tensor if as_dtype is None else p.tensor.to(DTYPES[as_dtype])
            out[n] = bit_checksum(t)
        return out

    def close(self) -> None:
        self.store.close()
        self.params.clear()


class _Rollout:
    def __init__(self, endpoint: str, cfg: dict[str, Any], rank: int):
        from astate_store import Shard
        from astate_store.store import Store

        self.rank, self.parts = rank, cfg["parts"]
        self.spec = make_spec(cfg["model"], cfg["gib"], cfg["n_many"])
        dtype = DTYPES[cfg["dtype"]]
        self.bufs: dict[str, Any] = {}
        for name, (shape, kind) in self.spec.items():
            box = box_of(cfg["rule"], shape, kind, rank, self.parts)
            t = alloc(box[1], dtype, cfg["alloc"])
            t.zero_()  # a live model's weights: pages already touched (first touch is not the sync's)
            self.bufs[name] = Shard(t, box[0], shape) if box[1] != shape else t
        self.nbytes = sum(self._t(b).numel() * self._t(b).element_size() for b in self.bufs.values())
        self.store = Store(
            cfg["ns"],
            endpoint=endpoint,
            transport=cfg["transport"],
            **({"staging_cap_bytes": cfg["staging_cap"]} if cfg.get("staging_cap") else {}),
        )
        # Instrument the transport (no library change): time and rows inside the batched UCX get.
        tr = self.store.transport
        orig = tr.get
        self.get_s, self.get_rows, self.get_calls = 0.0, 0, 0

        def timed_get(ops: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            try:
                orig(ops, **kw)
            finally:
                self.get_s += time.perf_counter() - t0
                self.get_rows += len(ops)
                self.get_calls += 1

        tr.get = timed_get  # type: ignore[method-assign]
        self.thp_kib = thp_kib()
        self.profile_first: str | None = cfg.get("profile_first")
        self.pulled = False
        # Time spent in the cyclic garbage collector during a pull (Python overhead that scales with
        # the number of live objects, e.g. per-tensor records of a 10,000-tensor model).
        self.gc_s, self._gc_t0 = 0.0, 0.0
        gc.callbacks.append(self._gc_cb)

    def _gc_cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_t0

    @staticmethod
    def _t(b: Any) -> torch.Tensor:
        return b if isinstance(b, torch.Tensor) else b.tensor

    def get(self, step: int, barrier: Any) -> dict[str, Any]:
        # Time only the pull of a version that is already committed and visible.
        self.store.wait(step, timeout=120)
        if barrier is not None:
            barrier.wait(120)
        self.get_s, self.get_rows, self.get_calls, self.gc_s = 0.0, 0, 0, 0.0
        prof = self._first_profiler()
        c0 = os.times()
        t0 = time.perf_counter()
        got = self.store.get_into(self.bufs, step=step, timeout=120)
        t1 = time.perf_counter()
        c1 = os.times()
        if prof is not None:
            prof.disable()
            prof.dump_stats(self.profile_first)
        return {
            "t0": t0,
            "t1": t1,
            "step": got,
            "transport_s": self.get_s,
            "rows": self.get_rows,
            "calls": self.get_calls,
            "user_s": c1.user - c0.user,
            "sys_s": c1.system - c0.system,
            "gc_s": self.gc_s,
            "nbytes": self.nbytes,
            "stats": dataclasses.asdict(self.store.stats),
        }

    def _first_profiler(self) -> Any:
        """A running cProfile for this rollout's first pull when ``--profile-dir`` asked (the
        first step: connect, plan and pull), else None."""
        if not self.profile_first or self.pulled:
            return None
        self.pulled = True
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        return prof

    def repeat(self, step: int, n: int) -> dict[str, Any]:
        """Pull the same committed step ``n`` times (for attaching a profiler); per-pull seconds."""
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.store.get_into(self.bufs, step=step, timeout=120)
            out.append(time.perf_counter() - t0)
        return {"seconds": out}

    def checksum(self) -> dict[str, int]:
        return {
            n: bit_checksum(self._t(b))
            for n, b in self.bufs.items()
            if not (self.spec[n][1] == "rep" and self.rank != 0)
        }

    def profile(self, step: int, path: str) -> dict[str, Any]:
        """cProfile one more steady-state get_into (same step again: plan and connection cached)."""
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        self.store.get_into(self.bufs, step=step, timeout=120)
        pr.disable()
        pr.dump_stats(path)
        st = pstats.Stats(pr)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:12]  # by cumulative time
        return {"top_cumulative": [f"{f[2]} ({os.path.basename(f[0])}:{f[1]}) {v[3]:.4f}s" for f, v in top]}

    def close(self) -> None:
        if self._gc_cb in gc.callbacks:
            gc.callbacks.remove(self._gc_cb)
        self.store.close()
        self.bufs.clear()


def worker_main(slot: int, endpoint: str, cmds: Any, out: Any, barrier: Any) -> None:
    """One reusable worker: ``trainer``/``rollout`` set-up, ``put``/``get``, ``checksum``, ``close``."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    role: Any = None
    while True:
        cmd = cmds.get()
        op, args = cmd[0], cmd[1:]
        if op == "exit":
            break
        try:
            if op == "trainer":
                role = _Trainer(endpoint, args[0], args[1])
                res: Any = {"nbytes": role.nbytes, "pid": os.getpid()}
            elif op == "rollout":
                role = _Rollout(endpoint, args[0], args[1])
                res = {"nbytes": role.nbytes, "pid": os.getpid(), "thp_kib": role.thp_kib}
            elif op == "put":
                res = role.put(args[0])
            elif op == "get":
                res = role.get(args[0], barrier if args[1] else None)
            elif op == "checksum":
                res = role.checksum(*args)
            elif op == "profile":
                res = role.profile(*args)
            elif op == "repeat":
                res = role.repeat(*args)
            elif op == "close":
                if role is not None:
                    role.close()
                role = None
                gc.collect()
                res = None
            else:
                raise ValueError(f"unknown command {op!r}")
            out.put((slot, "ok", res))
        except BaseException as exc:  # noqa: BLE001 - report, keep serving
            if isinstance(exc, KeyboardInterrupt):
                raise
            out.put((slot, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))


# ---------------------------------------------------------------------------------------- gloo


def gloo_main(rank: int, port: int, nbytes: int, iters: int, out: Any) -> None:
    """Two processes: broadcast ``nbytes`` of fp32 from rank 0 with torch.distributed gloo."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        t = torch.empty(nbytes // 4, dtype=torch.float32)
        t.fill_(1.0 if rank == 0 else 0.0)
        times = []
        for i in range(iters + 1):  # +1: the first is warm-up (connection, first touch)
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(t, src=0)
            if i:
                times.append(time.perf_counter() - t0)
        ok = bool(t[0].item() == 1.0 and t[-1].item() == 1.0)
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, "ok", {"times": times, "ok": ok}))
    except BaseException as exc:  # noqa: BLE001
        out.put((rank, "error", f"{type(exc).__name__}: {exc}"))

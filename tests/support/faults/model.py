"""The tensor model the fault actors and their driver share, and process probes.

Every tensor's bytes at step ``s`` are a pure function of (name, step): any process can check a
buffer byte for byte against the step a pull reported (:func:`check_buffers`).
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.data import value

# name -> (global shape of the "big"/"small" model, dtype name, how the publisher ranks split it)
_SIZES = {"big": (2048, 4096), "small": (256, 256)}


def spec(size: str) -> dict[str, tuple[tuple[int, ...], str, str]]:
    rows, cols = _SIZES[size]
    return {
        "w": ((rows, cols), "float32", "rows"),  # row-parallel over the publisher ranks
        "c": ((64, 96), "bfloat16", "cols"),  # column-parallel
        "b": ((cols,), "float32", "rep"),  # replicated
        "n": ((), "int64", "rep"),  # a 0-dim counter
    }


def lazy_torch() -> Any:
    import torch

    return torch


def tdtype(name: str) -> Any:
    return getattr(lazy_torch(), name)


def split_box(
    shape: Sequence[int], dim: int, parts: int, index: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = shape[dim]
    lo, hi = n * index // parts, n * (index + 1) // parts
    offs = [0] * len(shape)
    sizes = list(shape)
    offs[dim], sizes[dim] = lo, hi - lo
    return tuple(offs), tuple(sizes)


def publisher_boxes(size: str, rank: int, world: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    out = {}
    for name, (shape, _dt, how) in spec(size).items():
        if how == "rows":
            out[name] = split_box(shape, 0, world, rank)
        elif how == "cols":
            out[name] = split_box(shape, 1, world, rank)
        else:
            out[name] = ((0,) * len(shape), tuple(shape))
    return out


def select_box(t: Any, box: tuple[tuple[int, ...], tuple[int, ...]]) -> Any:
    offs, sizes = box
    return t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] if offs else t


LAYOUTS = ("whole", "cols0", "cols1", "sub", "bf16", "strided")


def make_buffers(size: str, layout: str) -> dict[str, Any]:
    """A consumer's preallocated buffers, laid out its own way (never the publishers')."""
    from astate_store import Shard

    torch = lazy_torch()
    sp = spec(size)
    out: dict[str, Any] = {}
    for name, (shape, dt, _how) in sp.items():
        if layout == "whole":
            out[name] = torch.zeros(shape, dtype=tdtype(dt))
        elif layout in ("cols0", "cols1"):
            idx = int(layout[-1])
            if name == "w":
                box = split_box(shape, 1, 2, idx)  # the other dim than the publishers split
            elif name == "c":
                box = split_box(shape, 0, 2, idx)
            else:
                out[name] = torch.zeros(shape, dtype=tdtype(dt))
                continue
            out[name] = Shard(torch.zeros(box[1], dtype=tdtype(dt)), box[0], shape)
        elif layout == "sub":
            if name in ("b", "n"):
                out[name] = torch.zeros(shape, dtype=tdtype(dt))
        elif layout == "bf16":  # converted on the pull (fp32 -> bf16)
            if name == "w":
                out[name] = torch.zeros(shape, dtype=torch.bfloat16)
            elif name == "b":
                out[name] = torch.zeros(shape, dtype=tdtype(dt))
        elif layout == "strided":  # a transposed, offset view inside a wider holder
            if name == "w":
                holder = torch.zeros(shape[1], shape[0] + 3, dtype=tdtype(dt))
                out[name] = holder[:, 3:].t()
            else:
                out[name] = torch.zeros(shape, dtype=tdtype(dt))
        else:
            raise ValueError(f"unknown layout {layout!r}")
    return out


def tensor_of(b: Any) -> Any:
    return b.tensor if hasattr(b, "tensor") and hasattr(b, "global_shape") else b


def expected_of(size: str, name: str, buf: Any, step: int) -> Any:
    shape, dt, _ = spec(size)[name]
    full = value(name, shape, dt, step)
    if hasattr(buf, "global_shape"):
        full = select_box(full, (tuple(buf.offsets), tuple(buf.tensor.shape)))
    t = tensor_of(buf)
    return full.to(t.dtype) if t.dtype != full.dtype else full


def same_bytes(a: Any, b: Any) -> bool:
    torch = lazy_torch()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def check_buffers(size: str, bufs: Mapping[str, Any], step: int) -> list[str]:
    """Names whose bytes are not exactly those of ``step`` (empty: all exact)."""
    return [n for n, b in bufs.items() if not same_bytes(tensor_of(b), expected_of(size, n, b, step))]


def identify(size: str, name: str, buf: Any, step: int, around: int = 3) -> str:
    """For a wrong buffer: which step's bytes it holds (whole or in part), for the report."""
    t = tensor_of(buf)
    if bool((t == -7).all()):
        return "untouched (the pull wrote nothing)"
    best = (0.0, -1)
    for s in range(max(0, step - around), step + around + 1):
        exp = expected_of(size, name, buf, s)
        eq = t.contiguous().reshape(-1) == exp.contiguous().reshape(
            -1
        )  # element-wise: values differ per step
        frac = float(eq.float().mean()) if eq.numel() else 1.0
        if frac == 1.0:
            return f"all of step {s}"
        best = max(best, (frac, s))
    return f"mixed: at most {best[0]:.0%} of elements of one step (step {best[1]})" if best[1] >= 0 else "?"


def poison(bufs: Mapping[str, Any]) -> None:
    """Overwrite buffers with a value no step has, so a pull that writes nothing is caught."""
    for b in bufs.values():
        t = tensor_of(b)
        t.fill_(-7.0 if t.dtype.is_floating_point else -7)


# ------------------------------------------------------------------------------ process probes


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: free heap pages go back to the system (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def probe_process() -> dict[str, int]:
    """This process's resident memory (``rss_kb``; ``anon_kb``: its anonymous part, where a leak
    grows: RSS also counts library pages first touched late and the publishers' shared staging
    pages mapped at the moment), open fds and threads. Garbage awaiting the cycle collector is
    collected first: a closed store's cycles go at the collector's next pass, which may come ~100
    stores later, and a sample taken before or after it must not read as growth. Then glibc is
    asked to return its free heap pages (``malloc_trim``): without it a process's anonymous memory
    sat on plateaus 10-15 MB apart depending on the layout of the buffers it freed last, which is
    the allocator's hysteresis, not growth (2026-12-07, the short soak's consumer1)."""
    gc.collect()
    _malloc_trim()
    rss = anon = threads = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("RssAnon:"):
                anon = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    except OSError:
        pass
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = -1
    return {"rss_kb": rss, "anon_kb": anon, "fds": fds, "threads": threads}


def slope_per_100(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys over xs, times 100 (growth per 100 steps); None under 3 points."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx

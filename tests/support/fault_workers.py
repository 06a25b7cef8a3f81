"""Worker processes and shared pieces of ``benchmarks/fault_suite.py`` (and ``tests/faults/test_faults.py``).

Two halves:

* **The actor** (``python -m tests.support.fault_workers``): a separate process that reads one JSON
  command per line on stdin (``{"id", "op", "args", "kw"}``), runs ``op_<op>(state, *args, **kw)``
  and answers one JSON line on stdout (``{"id", "ok": true, "result"}`` or ``{"id", "ok": false,
  "etype", "typed", "msg"}``; ``typed`` means an ``AStateError``). It may also print events
  (``{"event": ...}``) while an op runs, e.g. "this pull is about to move bytes". It holds any
  number of stores by key. The same actor runs inside a network namespace (``ip netns exec``).
* **The driver side**: :class:`Actor` (one such process, every wait bounded, ended by PID),
  :class:`Pool` (a spare actor is always starting, so a killed one is replaced cheaply),
  :class:`EtcdProcess` (an etcd that can be SIGSTOPped, SIGKILLed and restarted on the same data
  dir and port), probes, slopes and the tensor model both sides share.

Every tensor's bytes at step ``s`` are a pure function of (name, step): any process can check a
buffer byte for byte against the step a pull reported.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.data import value

ROOT = Path(__file__).resolve().parents[2]  # the repository root (this file is tests/support/)

# ---------------------------------------------------------------------------------------- model

# name -> (global shape of the "big"/"small" model, dtype name, how the publisher ranks split it)
_SIZES = {"big": (2048, 4096), "small": (256, 256)}


def _close_all(stores: Any) -> None:
    """Close every store a trial opened; one failing close does not keep the others open."""
    for s in stores:
        try:
            s.close()
        except Exception:  # the trial's outcome is already recorded
            pass


def spec(size: str) -> dict[str, tuple[tuple[int, ...], str, str]]:
    rows, cols = _SIZES[size]
    return {
        "w": ((rows, cols), "float32", "rows"),  # row-parallel over the publisher ranks
        "c": ((64, 96), "bfloat16", "cols"),  # column-parallel
        "b": ((cols,), "float32", "rep"),  # replicated
        "n": ((), "int64", "rep"),  # a 0-dim counter
    }


def _torch() -> Any:
    import torch

    return torch


def tdtype(name: str) -> Any:
    return getattr(_torch(), name)


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


def _sel(t: Any, box: tuple[tuple[int, ...], tuple[int, ...]]) -> Any:
    offs, sizes = box
    return t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] if offs else t


LAYOUTS = ("whole", "cols0", "cols1", "sub", "bf16", "strided")


def make_buffers(size: str, layout: str) -> dict[str, Any]:
    """A consumer's preallocated buffers, laid out its own way (never the publishers')."""
    from astate_store import Shard

    torch = _torch()
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


def _tensor_of(b: Any) -> Any:
    return b.tensor if hasattr(b, "tensor") and hasattr(b, "global_shape") else b


def expected_of(size: str, name: str, buf: Any, step: int) -> Any:
    shape, dt, _ = spec(size)[name]
    full = value(name, shape, dt, step)
    if hasattr(buf, "global_shape"):
        full = _sel(full, (tuple(buf.offsets), tuple(buf.tensor.shape)))
    t = _tensor_of(buf)
    return full.to(t.dtype) if t.dtype != full.dtype else full


def same_bytes(a: Any, b: Any) -> bool:
    torch = _torch()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def check_buffers(size: str, bufs: Mapping[str, Any], step: int) -> list[str]:
    """Names whose bytes are not exactly those of ``step`` (empty: all exact)."""
    return [n for n, b in bufs.items() if not same_bytes(_tensor_of(b), expected_of(size, n, b, step))]


def identify(size: str, name: str, buf: Any, step: int, around: int = 3) -> str:
    """For a wrong buffer: which step's bytes it holds (whole or in part), for the report."""
    t = _tensor_of(buf)
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
        t = _tensor_of(b)
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


# =============================================================================== actor (worker)

_OUT_LOCK = threading.Lock()


def _emit(obj: Mapping[str, Any]) -> None:
    line = json.dumps(obj, default=str)
    with _OUT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def emit_event(kind: str, **kw: Any) -> None:
    _emit({"event": kind, **kw})


class _Held:
    """One store an actor holds, with its buffers and tensors."""

    def __init__(self, store: Any, role: str, size: str, **kw: Any):
        self.store, self.role, self.size = store, role, size
        self.bufs: dict[str, dict[str, Any]] = {}  # layout -> buffers (kept: serve needs the same tensors)
        self.tensors: dict[str, Any] = {}
        self.serving = False
        self.hook: dict[str, Any] | None = None
        self.extra = kw


def _store(endpoint: str, ns: str, **kw: Any) -> Any:
    from astate_store.store import Store

    kw.setdefault("affinity", False)
    return Store(ns, endpoint=endpoint, **kw)


def _close_held(h: _Held) -> None:
    try:
        h.store.close()
    except Exception:  # closing after a fault may fail; the next op reports what matters
        pass


def _install_hook(h: _Held) -> None:
    """Wrap the store's transport ``get`` (one batched call per pull): when armed, announce the
    pull, optionally SIGKILL a pid (a publisher dying mid-pull) and optionally hold the read."""
    t = h.store.transport
    if getattr(t, "_fault_hooked", False):
        return
    orig = t.get

    def get(ops: Any, **kw: Any) -> Any:
        hook, h.hook = h.hook, None
        if hook:
            emit_event("pulling", pid=os.getpid(), rows=int(len(ops)))
            kill_pid = hook.get("kill_pid")
            if kill_pid:
                delay = float(hook.get("kill_delay", 0.0))
                if delay <= 0:
                    os.kill(int(kill_pid), signal.SIGKILL)
                else:
                    threading.Timer(delay, os.kill, (int(kill_pid), signal.SIGKILL)).start()
            if hook.get("hold"):
                time.sleep(float(hook["hold"]))
        return orig(ops, **kw)

    t.get = get
    t._fault_hooked = True


def op_ping(state: dict[str, Any]) -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def op_probe(state: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = probe_process()
    out["stores"] = len(state["held"])
    h = state["held"].get(key) if key else None
    if h is not None:
        t = h.store._ctx._transport  # do not create one just to count
        out["regions"] = int(getattr(t, "num_regions", 0)) if t is not None else 0
        out["peers"] = len(t.peers) if t is not None else 0
    return out


def op_pub_open(
    state: dict[str, Any],
    key: str,
    endpoint: str,
    ns: str,
    *,
    rank: int = 0,
    world: int = 1,
    session: str | None = None,
    size: str = "small",
    **kw: Any,
) -> dict[str, Any]:
    torch = _torch()
    from astate_store import Shard

    store = _store(endpoint, ns, rank=rank, world_size=world, session_id=session or f"{ns}-s", **kw)
    h = _Held(store, "pub", size, rank=rank, world=world)
    for name, (offs, sizes) in publisher_boxes(size, rank, world).items():
        shape, dt, _ = spec(size)[name]
        h.tensors[name] = (
            Shard(torch.zeros(sizes, dtype=tdtype(dt)), offs, shape)
            if shape
            else torch.zeros((), dtype=tdtype(dt))
        )
    old = state["held"].pop(key, None)
    if old is not None:
        _close_held(old)
    state["held"][key] = h
    return {"pid": os.getpid()}


def op_pub_put(
    state: dict[str, Any], key: str, step: int, *, copy: bool = True, retire: bool | None = None
) -> dict[str, Any]:
    """Write step's values into this rank's tensors and put them; ``copy=False`` retires first."""
    h = state["held"][key]
    t0 = time.monotonic()
    if retire or (retire is None and not copy):
        h.store.retire()
    t1 = time.monotonic()
    boxes = publisher_boxes(h.size, h.extra["rank"], h.extra["world"])
    for name, t in h.tensors.items():
        shape, dt, _ = spec(h.size)[name]
        _tensor_of(t).copy_(_sel(value(name, shape, dt, step), boxes[name]))
    committed = h.store.put(step, h.tensors, copy=copy)
    return {"committed": bool(committed), "seconds": time.monotonic() - t0, "retire_seconds": t1 - t0}


def op_pub_checkpoint(
    state: dict[str, Any],
    key: str,
    step: int,
    uri: str,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """This rank's part of checkpoint ``step`` at ``uri``, under the retention policy when the
    store's ``checkpoint`` takes one (``retention``: whether it did)."""
    import inspect

    store = state["held"][key].store
    params = inspect.signature(store.checkpoint).parameters
    kw: dict[str, Any] = {}
    if keep_last is not None and "keep_last" in params:
        kw["keep_last"] = keep_last
        if keep_every is not None and "keep_every" in params:
            kw["keep_every"] = keep_every
    if "timeout" in params:
        kw["timeout"] = timeout
    return {"complete": bool(store.checkpoint(step, uri, **kw)), "retention": "keep_last" in kw}


def op_pub_recover(state: dict[str, Any], key: str, *, timeout: float = 60.0) -> dict[str, Any]:
    """A restarted rank: recover into zeroed tensors; the step and whether every byte is that step's."""
    h = state["held"][key]
    for t in h.tensors.values():
        _tensor_of(t).zero_()
    got = h.store.recover(h.tensors, timeout=timeout)
    boxes = publisher_boxes(h.size, h.extra["rank"], h.extra["world"])
    exact = got is not None and all(
        same_bytes(_tensor_of(t), _sel(value(n, spec(h.size)[n][0], spec(h.size)[n][1], got), boxes[n]))
        for n, t in h.tensors.items()
    )
    return {"step": got, "exact": exact}


def op_open_close(state: dict[str, Any], endpoint: str, ns: str, **kw: Any) -> dict[str, Any]:
    """Open a store, ask for the newest step, close it (a process that opens a store every step)."""
    store = _store(endpoint, ns, **kw)
    try:
        return {"latest": store.latest()}
    finally:
        store.close()


def op_con_open(
    state: dict[str, Any], key: str, endpoint: str, ns: str, *, size: str = "small", **kw: Any
) -> dict[str, Any]:
    old = state["held"].pop(key, None)
    if old is not None:
        _close_held(old)
    state["held"][key] = _Held(_store(endpoint, ns, **kw), "con", size)
    return {"pid": os.getpid(), "consumer_id": state["held"][key].store.consumer_id}


def op_con_pull(
    state: dict[str, Any],
    key: str,
    layout: str = "whole",
    *,
    step: int | None = None,
    wait: float = 30.0,
    kill_pid: int | None = None,
    kill_delay: float = 0.0,
    hold: float = 0.0,
    announce: bool = False,
    reuse_from: str | None = None,
) -> dict[str, Any]:
    """get_into the layout's buffers; returns the step and whether every byte is that step's.
    ``reuse_from``: pull into the buffers another (closed) store of this actor used."""
    h = state["held"][key]
    if reuse_from is not None and reuse_from in state["orphans"]:
        h.bufs.setdefault(layout, state["orphans"].pop(reuse_from))
    bufs = h.bufs.get(layout)
    if bufs is None:
        bufs = h.bufs[layout] = make_buffers(h.size, layout)
    if h.serving:
        h.store.unserve()
        h.serving = False
    poison(bufs)
    if kill_pid or hold or announce:
        _install_hook(h)
        h.hook = {"kill_pid": kill_pid, "kill_delay": kill_delay, "hold": hold}
    t0 = time.monotonic()
    try:
        got = h.store.get_into(bufs, step=step, timeout=wait)
    finally:
        h.hook = None
    seconds = time.monotonic() - t0
    bad = check_buffers(h.size, bufs, got)
    out: dict[str, Any] = {"step": got, "exact": not bad, "bad": bad, "seconds": seconds}
    if bad:
        out["looks_like"] = {n: identify(h.size, n, bufs[n], got) for n in bad}
    return out


def op_con_serve(state: dict[str, Any], key: str, step: int, layout: str = "whole") -> dict[str, Any]:
    h = state["held"][key]
    h.store.serve(step, h.bufs[layout])
    h.serving = True
    return {"serving": step}


def op_close(state: dict[str, Any], key: str, *, keep_buffers: bool = False) -> dict[str, Any]:
    """Close one store (a consumer leaving). ``keep_buffers``: keep its buffers for a later store
    of this actor (``con_pull(reuse_from=key)``), as a process that leaves and rejoins would."""
    h = state["held"].pop(key, None)
    if h is None:
        return {"closed": False}
    _close_held(h)
    if keep_buffers and h.bufs:
        state["orphans"][key] = next(iter(h.bufs.values()))
    return {"closed": True}


def op_reset(state: dict[str, Any]) -> dict[str, Any]:
    n = len(state["held"])
    for h in list(state["held"].values()):
        _close_held(h)
    state["held"].clear()
    state["orphans"].clear()
    import gc

    gc.collect()
    return {"closed": n}


def op_peer_paths(state: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """How this store reaches each peer: same-host ``process_vm_readv`` (direct) or UCX, its lanes."""
    t = state["held"][key].store._ctx._transport
    out = []
    for p in t.peers if t is not None else []:
        info = t.peer_info(p)
        out.append(
            {
                "peer": str(p),
                "direct": info.direct,
                "peer_error_mode": info.peer_error_handling,
                "lanes": t.endpoint_info(p)[:300],
            }
        )
    return out


def op_member_in_use(state: dict[str, Any], key: str) -> str:
    return str(state["held"][key].store.catalog.client.raw.endpoint_in_use.netloc)


def op_catalog_view(state: dict[str, Any], key: str, steps: Sequence[int] = ()) -> dict[str, Any]:
    """What the catalog says now: ``latest``, the committed steps, and whether each of ``steps``
    reads back as a committed version (True, or the error)."""
    from astate_store import AStateError

    cat = state["held"][key].store.catalog
    readable: dict[int, Any] = {}
    for s in steps:
        try:
            cat.versions.read_version(int(s))
            readable[int(s)] = True
        except AStateError as exc:
            readable[int(s)] = f"{type(exc).__name__}: {exc}"[:200]
    return {
        "latest": cat.versions.latest(),
        "committed": cat.versions.committed_steps(),
        "readable": readable,
    }


def op_etcd_start(state: dict[str, Any], host: str) -> dict[str, Any]:
    """Run an embedded etcd in this actor (inside a network namespace: on that host's address)."""
    from astate_store.etcd.embedded import EmbeddedEtcd

    state["etcd"] = EmbeddedEtcd(host=host).start()
    return {"endpoint": state["etcd"].endpoint}


def op_sleep(state: dict[str, Any], seconds: float) -> float:
    time.sleep(seconds)
    return seconds


# ---- zombie writes ----------------------------------------------------------------------------


def op_zombie(state: dict[str, Any], endpoint: str, ns: str, variant: int) -> list[dict[str, Any]]:
    """An old session keeps writing after a new one opened; every write must be a
    ``StaleSessionError`` and none may commit. Returns one result per operation."""
    from astate_store import AStateError

    res: list[dict[str, Any]] = []
    size = "small"
    old = _pub(endpoint, ns, "old", 0, 1, size)
    new = None
    stores = [old[0]]
    try:
        _put(old, 1, True)
        res.append({"what": "old put 1", "ok": True})
        if variant % 3 == 2:
            # The new session opens (epoch bumped) but never commits: world 2, rank 1 never comes.
            new = _pub(endpoint, ns, "new", 0, 2, size)
            stores.append(new[0])
            committed_new = _put(new, 2, True)
            newest = 1
            res.append({"what": "new put 2 (rank 1 absent)", "ok": True, "committed": committed_new})
        else:
            new = _pub(endpoint, ns, "new", 0, 1, size)
            stores.append(new[0])
            _put(new, 2, True)
            newest = 2
            res.append({"what": "new put 2", "ok": True})
        zombie_ops: list[tuple[str, Callable[[], Any]]] = [
            ("zombie put 3 (snapshot)", lambda: _put(old, 3, True)),
            ("zombie put 4 (in place)", lambda: _put(old, 4, False)),
        ]
        # (A zombie's retire() is not fenced on purpose: marking its memory retired protects readers.)
        if variant % 3 == 1:
            zombie_ops.insert(0, ("zombie put 2 (same step as the new session)", lambda: _put(old, 2, True)))
        for what, fn in zombie_ops:
            r: dict[str, Any] = {"what": what, "zombie": True}
            try:
                r["result"] = fn()
                r["ok"] = True
            except AStateError as exc:
                r.update(ok=False, etype=type(exc).__name__, typed=True, msg=str(exc)[:300])
            res.append(r)
        # What consumers see: the newest commit is the new session's, exact.
        con = _store(endpoint, ns, read_timeout=10.0)
        stores.append(con)
        cat = con.catalog
        latest, committed = cat.versions.latest(), cat.versions.committed_steps()
        zombie_commits = [s for s in (3, 4) if s in committed]
        if (
            variant % 3 == 1
            and 2 in committed
            and cat.versions.read_version(2).epoch != new[0].catalog.session.epoch
        ):
            zombie_commits.append(2)
        res.append(
            {
                "what": "catalog",
                "ok": True,
                "latest": latest,
                "committed": committed,
                "zombie_commits": zombie_commits,
                "newest_expected": newest,
            }
        )
        bufs = make_buffers(size, "whole")
        poison(bufs)
        got = con.get_into(bufs, timeout=10)
        res.append(
            {
                "what": "pull",
                "ok": True,
                "pull": True,
                "step": got,
                "exact": not check_buffers(size, bufs, got),
                "expected_step": newest,
            }
        )
    finally:
        _close_all(stores)
    return res


def _pub(
    endpoint: str, ns: str, session: str, rank: int, world: int, size: str, **kw: Any
) -> tuple[Any, Any, int, int, str]:
    torch = _torch()
    from astate_store import Shard

    kw.setdefault("lease_ttl", 5.0)
    store = _store(endpoint, ns, rank=rank, world_size=world, session_id=f"{ns}-{session}", **kw)
    tensors: dict[str, Any] = {}
    for name, (offs, sizes) in publisher_boxes(size, rank, world).items():
        shape, dt, _ = spec(size)[name]
        tensors[name] = (
            Shard(torch.zeros(sizes, dtype=tdtype(dt)), offs, shape)
            if shape
            else torch.zeros((), dtype=tdtype(dt))
        )
    return store, tensors, rank, world, size


def _put(pub: tuple[Any, Any, int, int, str], step: int, copy: bool) -> bool:
    store, tensors, rank, world, size = pub
    if not copy:
        store.retire(timeout=1.0)
    boxes = publisher_boxes(size, rank, world)
    for name, t in tensors.items():
        shape, dt, _ = spec(size)[name]
        _tensor_of(t).copy_(_sel(value(name, shape, dt, step), boxes[name]))
    return bool(store.put(step, tensors, copy=copy))


# ---- hostile inputs --------------------------------------------------------------------------

# A bad record per key family, written with the raw etcd client over what the store wrote.
# (name, key family, how): ``how`` is interpreted by _bad_record.
HOSTILE_RECORDS: tuple[tuple[str, str], ...] = (
    ("epoch_garbage", "epoch"),
    ("epoch_huge", "epoch"),
    ("session_garbage", "session"),
    ("member_own_garbage", "members"),
    ("member_extra_garbage", "members"),
    ("manifest_garbage", "manifests"),
    ("manifest_wrong_content", "manifests"),
    ("manifest_bad_digest", "manifests"),
    ("manifest_missing_chunks", "manifests"),
    ("manifest_zlib_bomb", "manifests"),
    ("layout_garbage", "layouts"),
    ("layout_wrong_kind", "layouts"),
    ("layout_extra_chunk", "layouts"),
    ("replica_layout_garbage", "layouts/replicas"),
    ("piece_garbage", "versions/pieces"),
    ("piece_non_numeric_key", "versions/pieces"),
    ("piece_offset_out_of_range", "versions/pieces"),
    ("piece_unknown_layout", "versions/pieces"),
    ("piece_extra_rank", "versions/pieces"),
    ("commit_garbage", "versions/commit"),
    ("commit_world_too_big", "versions/commit"),
    ("commit_future_step", "versions/commit"),
    ("commits_index_garbage_key", "commits"),
    ("replica_garbage", "versions/replicas"),
    ("replica_unknown_layout", "versions/replicas"),
    ("latest_garbage", "latest"),
    ("latest_huge", "latest"),
    ("reader_leaseless", "readers"),
    ("delivered_garbage", "delivered"),
    ("consumer_garbage", "consumers"),
    ("consumer_pack_wrong_ndim", "consumers"),
    ("consumer_pack_huge_box", "consumers"),
    ("consumer_pack_unknown_name", "consumers"),
    ("consumer_pack_unknown_rank", "consumers"),
    ("consumer_pack_0dim_convert", "consumers"),
    ("retired_garbage", "retired"),
    ("torn_garbage", "torn"),
    ("checkpoint_garbage", "checkpoints"),
    ("checkpoint_missing_uri", "checkpoints"),
    ("recovery_plan_garbage", "recovery"),
    ("version_key_not_utf8", "versions"),
    ("manifest_key_not_utf8", "manifests"),
    ("layout_key_not_utf8", "layouts"),
    ("stray_key", "(none)"),
)

GARBAGE = b"\xc1\xff\x00 not a record \x93"


def _bad_record(name: str, pub: Any, con: Any, step: int) -> list[tuple[Any, bytes]]:
    """(key, value) pairs to write for hostile record ``name`` after ``step`` committed."""
    from astate_store.catalog.blobs import blob_requests
    from astate_store.catalog.records import pad20
    from astate_store.model import codec

    c = pub.catalog.client
    sess = pub.catalog.session
    e, r = pad20(sess.epoch), pad20(sess.rank)
    vpre = c.key("versions", pad20(step))
    ver = pub.catalog.versions.read_version(step)
    piece = ver.pieces[0]
    lkey = c.key("layouts", e, r, piece.layout_id)
    mkey = c.key("manifests", piece.manifest_id)
    raw = c.raw

    def head_of(data: bytes) -> bytes:
        _chunks, put = blob_requests("x", data)
        return put.value

    def piece_rec(**over: Any) -> bytes:
        rec = {
            "step": step,
            "epoch": sess.epoch,
            "rank": 0,
            "world_size": 1,
            "layout_id": piece.layout_id,
            "base_offset": piece.base_offset,
            "manifest_id": piece.manifest_id,
        }
        rec.update(over)
        return codec.encode("piece", rec)

    if name == "epoch_garbage":
        return [(c.key("epoch"), GARBAGE)]
    if name == "epoch_huge":
        return [(c.key("epoch"), codec.encode_counter(10**19 - 1))]
    if name == "session_garbage":
        return [(c.key("session"), GARBAGE)]
    if name == "member_own_garbage":
        return [(c.key("members", e, r), GARBAGE)]
    if name == "member_extra_garbage":
        return [(c.key("members", e, pad20(7)), GARBAGE)]
    if name == "manifest_garbage":
        return [(mkey, GARBAGE)]
    if name == "manifest_wrong_content":
        # A well-formed manifest blob, but of other shards: its content is not its key's id.
        rec = codec.decode("manifest", _blob_bytes(c, mkey))
        rec["names"] = [n + "x" for n in rec["names"]]
        return [(mkey, head_of(codec.encode("manifest", rec)))]
    if name == "manifest_bad_digest":
        head = codec.decode("blob", raw.get(mkey)[0])
        head["digest"] = "0" * 16
        return [(mkey, codec.encode("blob", head))]
    if name == "manifest_missing_chunks":
        head = codec.decode("blob", raw.get(mkey)[0])
        head.pop("data", None)
        head["chunks"] = 3
        return [(mkey, codec.encode("blob", head)), (mkey + "/000001", GARBAGE)]
    if name == "manifest_zlib_bomb":
        # A well-formed head (digest right) whose zlib data inflates to 1 GiB while the head claims
        # the real size: a reader must not inflate it all.
        import zlib

        from astate_store.catalog import blobs

        z = zlib.compressobj(9)
        zero = bytes(16 << 20)
        stored = b"".join(z.compress(zero) for _ in range(64)) + z.flush()
        head = codec.decode("blob", raw.get(mkey)[0])
        head.update(codec="zlib", chunks=0, data=stored, digest=blobs._digest(stored))
        return [(mkey, codec.encode("blob", head))]
    if name == "layout_garbage":
        return [(lkey, GARBAGE)]
    if name == "layout_wrong_kind":
        return [(lkey, head_of(piece_rec()))]
    if name == "layout_extra_chunk":
        return [(lkey + "/000000", GARBAGE), (lkey + "/zz", GARBAGE)]
    if name == "replica_layout_garbage":
        rid = "ghost-" + uuid.uuid4().hex[:6]
        return [
            (c.key("layouts", "replicas", rid, piece.layout_id), GARBAGE),
            (
                vpre + f"/replicas/g/{rid}",
                codec.encode(
                    "replica",
                    {
                        "step": step,
                        "group": "g",
                        "member": rid,
                        "layout_id": piece.layout_id,
                        "manifest_id": piece.manifest_id,
                    },
                ),
            ),
        ]
    if name == "piece_garbage":
        return [(vpre + f"/pieces/{e}/{r}", GARBAGE)]
    if name == "piece_non_numeric_key":
        return [(vpre + "/pieces/xx/yy", piece_rec())]
    if name == "piece_offset_out_of_range":
        return [(vpre + f"/pieces/{e}/{r}", piece_rec(base_offset=1 << 40))]
    if name == "piece_unknown_layout":
        return [(vpre + f"/pieces/{e}/{r}", piece_rec(layout_id="f" * 24))]
    if name == "piece_extra_rank":
        return [(vpre + f"/pieces/{e}/{pad20(1)}", piece_rec(rank=1, world_size=2))]
    if name == "commit_garbage":
        return [(vpre + "/commit", GARBAGE)]
    if name == "commit_world_too_big":
        rec = codec.decode("commit", raw.get(vpre + "/commit")[0])
        rec["world_size"] = 2
        return [(vpre + "/commit", codec.encode("commit", rec))]
    if name == "commit_future_step":
        rec = codec.decode("commit", raw.get(vpre + "/commit")[0])
        rec["step"] = step + 5
        return [
            (c.key("versions", pad20(step + 5), "commit"), codec.encode("commit", rec)),
            (c.key("commits", pad20(step + 5)), b""),
        ]
    if name == "commits_index_garbage_key":
        return [(c.key("commits", "not-a-step"), GARBAGE)]
    if name == "replica_garbage":
        return [(vpre + "/replicas/g/ghost", GARBAGE)]
    if name == "replica_unknown_layout":
        return [
            (
                vpre + "/replicas/g/ghost",
                codec.encode(
                    "replica",
                    {
                        "step": step,
                        "group": "g",
                        "member": "ghost",
                        "layout_id": "e" * 24,
                        "manifest_id": "d" * 24,
                    },
                ),
            )
        ]
    if name == "latest_garbage":
        return [(c.key("latest"), GARBAGE)]
    if name == "latest_huge":
        return [(c.key("latest"), codec.encode_counter(10**19 - 1))]
    if name == "reader_leaseless":
        # A reader that never finishes and has no lease: the publisher must stop waiting for it.
        return [
            (
                c.key("readers", pad20(step), "ghost"),
                codec.encode("reader", {"step": step, "reader_id": "ghost", "host": "nowhere", "pid": 1}),
            )
        ]
    if name == "delivered_garbage":
        return [(c.key("delivered", pad20(step), "ghost"), GARBAGE)]
    if name == "consumer_garbage":
        return [(c.key("consumers", "ghost"), GARBAGE)]
    packs = {
        "consumer_pack_wrong_ndim": {"rank": 0, "name": "w", "offsets": [0], "sizes": [1]},
        "consumer_pack_huge_box": {"rank": 0, "name": "w", "offsets": [0, 0], "sizes": [1 << 30, 1 << 30]},
        "consumer_pack_unknown_name": {"rank": 0, "name": "nope", "offsets": [0], "sizes": [1]},
        "consumer_pack_unknown_rank": {"rank": 9, "name": "b", "offsets": [0], "sizes": [4]},
        "consumer_pack_0dim_convert": {
            "rank": 0,
            "name": "n",
            "offsets": [],
            "sizes": [],
            "dtype": "bfloat16",
        },
    }
    if name in packs:  # a consumer record asking publishers for a copy that cannot be built
        return [
            (
                c.key("consumers", "ghost"),
                codec.encode("consumer", {"reader_id": "ghost", "packs": [packs[name]]}),
            )
        ]
    if name == "retired_garbage":
        return [(c.key("retired", pad20(step), pad20(5)), GARBAGE)]
    if name == "torn_garbage":
        return [(c.key("torn", pad20(step), pad20(5)), GARBAGE)]
    if name == "checkpoint_garbage":
        return [(c.key("checkpoints", pad20(step)), GARBAGE)]
    if name == "checkpoint_missing_uri":
        return [
            (
                c.key("checkpoints", pad20(step)),
                codec.encode(
                    "checkpoint",
                    {
                        "step": step,
                        "uri": "/nonexistent/astate-fault-" + uuid.uuid4().hex[:6],
                        "world_size": 1,
                        "bytes": 10,
                        "written_at": time.time(),
                    },
                ),
            )
        ]
    if name == "recovery_plan_garbage":
        return [
            (c.key("recovery", pad20(sess.epoch + 1), pad20(0), "plan"), GARBAGE),
            (c.key("recovery", pad20(sess.epoch + 1), pad20(0), "ranks", pad20(0)), GARBAGE),
        ]
    if name == "version_key_not_utf8":
        return [((vpre + "/").encode() + b"\xff\xfe/\x80", GARBAGE)]
    if name == "manifest_key_not_utf8":  # a key inside the manifest blob's range (where its chunks live)
        return [(mkey.encode() + b"/\xff\xfe", GARBAGE)]
    if name == "layout_key_not_utf8":
        return [(lkey.encode() + b"/\xff\xfe", GARBAGE)]
    if name == "stray_key":
        return [(c.key("zzz", "stray"), GARBAGE)]
    raise ValueError(f"unknown hostile record {name!r}")


def _blob_bytes(client: Any, key: str) -> bytes:
    from astate_store.catalog.blobs import blob_from_kvs
    from astate_store.etcd.client import range_end

    kvs = list(client.raw.get_range(key, range_end(key)))
    data = blob_from_kvs(key, kvs)
    assert data is not None, key
    return data


def _attempt(
    res: list[dict[str, Any]],
    what: str,
    fn: Callable[[], Any],
    *,
    pull: Mapping[str, Any] | None = None,
    size: str = "small",
) -> Any:
    """Run one store operation; record its result (exact bytes for a pull) or its error."""
    from astate_store import AStateError

    r: dict[str, Any] = {"what": what}
    try:
        out = fn()
        r["ok"] = True
        if pull is not None:
            r.update(pull=True, step=out, bad=check_buffers(size, pull, out))
            r["exact"] = not r["bad"]
        else:
            r["result"] = (
                out if isinstance(out, (int, float, str, bool, type(None), list)) else repr(out)[:200]
            )
    except AStateError as exc:
        r.update(ok=False, typed=True, etype=type(exc).__name__, msg=str(exc)[:300])
    except Exception as exc:
        r.update(
            ok=False,
            typed=False,
            etype=type(exc).__name__,
            msg=str(exc)[:300],
            tb=traceback.format_exc()[-1500:],
        )
    res.append(r)
    return r


def op_hostile_record(state: dict[str, Any], endpoint: str, name: str) -> list[dict[str, Any]]:
    """A fresh namespace: one publisher commits step 1, a bad record is written over the catalog
    with the raw client, then fresh consumers pull, the publisher puts step 2 and 3, consumers pull
    again (and, for checkpoint and recovery records, restore / recover): each must be exact bytes
    or a typed error."""
    size = "small"
    ns = "fh-" + uuid.uuid4().hex[:10]
    res: list[dict[str, Any]] = []
    pub = _pub(endpoint, ns, "a", 0, 1, size, retire_timeout=2.0, lease_ttl=3.0)
    stores = [pub[0]]
    try:
        _put(pub, 1, True)
        pre = _store(endpoint, ns, read_timeout=5.0, lease_ttl=3.0)
        stores.append(pre)
        b0 = make_buffers(size, "whole")
        _attempt(res, "baseline pull", lambda: pre.get_into(b0, timeout=5), pull=b0)
        pairs = _bad_record(name, pub[0], pre, 1)
        for k, v in pairs:
            pub[0].catalog.client.raw.put(k, v)
        res.append(
            {"what": "wrote", "ok": True, "keys": [k if isinstance(k, str) else repr(k) for k, _ in pairs]}
        )
        con = _store(endpoint, ns, read_timeout=5.0, lease_ttl=3.0)
        stores.append(con)
        for i, lay in enumerate(("whole", "cols1")):
            bufs = make_buffers(size, lay)
            poison(bufs)
            _attempt(res, f"fresh pull {lay}", lambda: con.get_into(bufs, timeout=1.5), pull=bufs)
        _attempt(res, "latest", lambda: con.latest())
        _attempt(res, "committed_steps", lambda: con.catalog.versions.committed_steps())
        for s in (2, 3):
            _attempt(res, f"put {s}", lambda: _put(pub, s, True))
        for lay in ("whole", "cols0"):
            bufs = make_buffers(size, lay)
            poison(bufs)
            _attempt(res, f"pull after puts {lay}", lambda: con.get_into(bufs, timeout=1.5), pull=bufs)
        bufs = make_buffers(size, "whole")
        poison(bufs)
        _attempt(res, "steady consumer pull", lambda: pre.get_into(bufs, timeout=1.5), pull=bufs)
        if name.startswith("checkpoint"):
            bufs = make_buffers(size, "whole")
            poison(bufs)
            _attempt(res, "restore", lambda: con.restore(bufs), pull=bufs)
        if name.startswith("recovery") or name.startswith("epoch") or name.startswith("session"):
            # A restarted publisher session recovers (fences the old one, agrees, republishes).
            pub2 = _pub(endpoint, ns, "b", 0, 1, size, retire_timeout=2.0, lease_ttl=3.0)
            stores.append(pub2[0])
            blank = dict(pub2[1])
            poison(blank)

            def recover() -> Any:
                got = pub2[0].recover(blank, timeout=8)
                return got

            r = _attempt(res, "recover", recover)
            if r.get("ok") and r.get("result") is not None:
                bad = check_buffers(size, blank, int(r["result"]))
                r.update(pull=True, step=r["result"], bad=bad, exact=not bad)
    finally:
        _close_all(stores)
    return res


HOSTILE_API: tuple[str, ...] = (
    "get_unknown_name",
    "get_wrong_global_shape",
    "get_int_dtype",
    "get_box_out_of_bounds",
    "get_non_tensor_list",
    "get_numpy_array",
    "get_none_value",
    "get_name_not_str",
    "get_empty_mapping",
    "get_aliased_buffers",
    "get_overlapping_strides",
    "get_step_negative",
    "get_step_str",
    "get_step_float",
    "get_step_bool",
    "get_step_huge",
    "get_timeout_negative",
    "get_future_step",
    "get_bf16_conversion",
    "get_strided_view",
    "get_not_a_mapping",
    "get_shard_wrong_rank",
    "put_step_negative",
    "put_step_none",
    "put_step_huge",
    "put_stale_step",
    "put_empty",
    "put_bad_name_slashes",
    "put_bad_name_space",
    "put_name_too_long",
    "put_complex_dtype",
    "put_non_tensor",
    "put_shard_out_of_bounds",
    "put_changed_global_shape",
    "put_aliased",
    "serve_unfilled_buffers",
    "serve_wrong_step",
    "bad_namespace",
    "bad_rank",
    "retire_without_put",
    "checkpoint_uncommitted_step",
    "restore_no_checkpoint",
)


def op_hostile_api(
    state: dict[str, Any], endpoint: str, names: Sequence[str]
) -> dict[str, list[dict[str, Any]]]:
    """Bad API input, one after another on the same stores (a bad call must not poison them):
    each result is followed by a good pull that must be exact."""
    torch = _torch()
    from astate_store import Shard

    size = "small"
    ns = "fa-" + uuid.uuid4().hex[:10]
    out: dict[str, list[dict[str, Any]]] = {}
    pub = _pub(endpoint, ns, "a", 0, 1, size, retire_timeout=2.0, lease_ttl=5.0)
    con = _store(endpoint, ns, read_timeout=5.0, lease_ttl=5.0)
    stores = [pub[0], con]
    other: list[Any] = []
    step = [1]
    try:
        _put(pub, 1, True)
        good = make_buffers(size, "whole")
        shape = spec(size)["w"][0]

        def get(bufs: Any, **kw: Any) -> Any:
            kw.setdefault("timeout", 1)
            return con.get_into(bufs, **kw)

        def put(tensors: Any, s: Any = None, **kw: Any) -> Any:
            return pub[0].put(step[0] + 1 if s is None else s, tensors, **kw)

        def bad_rank() -> Any:  # rank 2 of a world of 2
            other.append(_store(endpoint, ns + "x", rank=2, world_size=2))
            return other[-1].put(1, {"b": torch.zeros(4)})

        w = torch.zeros(shape)
        cases: dict[str, tuple[Callable[[], Any], Any]] = {
            "get_unknown_name": (lambda: get({"w": w, "nope": torch.zeros(3)}), None),
            "get_wrong_global_shape": (lambda: get({"w": torch.zeros(shape[0], shape[1] - 1)}), None),
            "get_int_dtype": (lambda: get({"w": torch.zeros(shape, dtype=torch.int32)}), None),
            "get_box_out_of_bounds": (
                lambda: get({"w": Shard(torch.zeros(10, shape[1]), (shape[0] - 5, 0), shape)}),
                None,
            ),
            "get_non_tensor_list": (lambda: get({"w": [[0.0] * shape[1]] * shape[0]}), None),
            "get_numpy_array": (lambda: get({"w": w.numpy()}), None),
            "get_none_value": (lambda: get({"w": None}), None),
            "get_name_not_str": (lambda: get({7: w}), None),
            "get_empty_mapping": (lambda: get({}), None),
            "get_aliased_buffers": (lambda: get({"w": w, "b": w[0]}), None),
            "get_overlapping_strides": (
                lambda: get({"w": torch.zeros(shape[1]).as_strided(shape, (0, 1))}),
                None,
            ),
            "get_step_negative": (lambda: get(good, step=-1), good),
            "get_step_str": (lambda: get(good, step="1"), good),
            "get_step_float": (lambda: get(good, step=1.5), good),
            "get_step_bool": (lambda: get(good, step=True), good),
            "get_step_huge": (lambda: get(good, step=10**30), good),
            "get_timeout_negative": (lambda: get(good, timeout=-5), good),
            "get_future_step": (lambda: get(good, step=step[0] + 1000, timeout=0.5), good),
            "get_bf16_conversion": (lambda: get(bf16), bf16)
            if (bf16 := make_buffers(size, "bf16"))
            else (None, None),
            "get_strided_view": (lambda: get(sv), sv)
            if (sv := make_buffers(size, "strided"))
            else (None, None),
            "get_not_a_mapping": (lambda: get([("w", w)]), None),
            "get_shard_wrong_rank": (lambda: get({"w": Shard(torch.zeros(4), (0, 0), shape)}), None),
            "put_step_negative": (lambda: put(pub[1], -1), None),
            "put_step_none": (lambda: pub[0].put(None, pub[1]), None),
            "put_step_huge": (lambda: put(pub[1], 10**19), None),
            "put_stale_step": (lambda: put(pub[1], 0), None),
            "put_empty": (lambda: put({}), None),
            "put_bad_name_slashes": (lambda: put({**pub[1], "a//b": torch.zeros(2)}), None),
            "put_bad_name_space": (lambda: put({**pub[1], "a b": torch.zeros(2)}), None),
            "put_name_too_long": (lambda: put({**pub[1], "x" * 600: torch.zeros(2)}), None),
            "put_complex_dtype": (lambda: put({**pub[1], "z": torch.zeros(2, dtype=torch.complex64)}), None),
            "put_non_tensor": (lambda: put({**pub[1], "z": [1.0, 2.0]}), None),
            "put_shard_out_of_bounds": (
                lambda: put({**pub[1], "w": Shard(torch.zeros(4, 4), (shape[0] - 2, 0), shape)}),
                None,
            ),
            "put_changed_global_shape": (lambda: put({**pub[1], "b": torch.zeros(shape[1] + 1)}), None),
            "put_aliased": (lambda: put({**pub[1], "alias": _tensor_of(pub[1]["w"])[0]}), None),
            "serve_unfilled_buffers": (lambda: con.serve(step[0], make_buffers(size, "whole")), None),
            "serve_wrong_step": (lambda: con.serve(step[0] + 7, good), None),
            "bad_namespace": (lambda: other.append(_store(endpoint, "a/b")), None),
            "bad_rank": (bad_rank, None),
            "retire_without_put": (
                lambda: _pub_track(other, endpoint, ns + "y", 0, 1, size)[0].retire(timeout=1),
                None,
            ),
            "checkpoint_uncommitted_step": (
                lambda: pub[0].checkpoint(step[0] + 50, tempfile.mkdtemp(prefix="astate-fault-ckpt-")),
                None,
            ),
            "restore_no_checkpoint": (lambda: con.restore(make_buffers(size, "whole")), None),
        }
        for name in names:
            res: list[dict[str, Any]] = []
            fn, pull = cases[name]
            poison(good)
            if pull is not None and pull is not good:
                poison(pull)
            r = _attempt(res, name, fn, pull=pull)
            if name.startswith("put") and r.get("ok") and r.get("result") is not None:
                step[0] += (
                    1  # a put that was accepted published a step (good values: the next pull checks them)
                )
                res[-1]["note"] = "accepted"
            if name.startswith("put") and r.get("ok"):
                # The accepted put published tensors other than the model's: the next good put restores them.
                pass
            # The store still works: a good put and a good pull, exact.
            step[0] += 1
            _attempt(res, "good put", lambda: _put(pub, step[0], True))
            poison(good)
            _attempt(res, "good pull", lambda: con.get_into(good, step=step[0], timeout=5), pull=good)
            out[name] = res
    finally:
        for s in stores + [o[0] if isinstance(o, tuple) else o for o in other]:
            try:
                s.close()
            except Exception:
                pass
    return out


def _pub_track(other: list[Any], endpoint: str, ns: str, rank: int, world: int, size: str) -> Any:
    p = _pub(endpoint, ns, "t", rank, world, size)
    other.append(p)
    return p


# ---- fuzz ------------------------------------------------------------------------------------


def _fuzz_targets() -> tuple[str, ...]:
    from astate_store.model import codec

    return tuple(f"codec:{k}" for k in codec.KINDS) + (
        "counter",
        "blob_from_kvs",
        "manifest_from_record",
        "layout_from_record",
        "version_from_kvs",
    )


class _Meta:
    """What the catalog reads of an etcd key-value's metadata: its key (bytes)."""

    def __init__(self, key: bytes):
        self.key = key

    def __repr__(self) -> str:
        return f"meta(key={self.key!r})"


def _schema_strategy(node: Mapping[str, Any], defs: Mapping[str, Any], st: Any) -> Any:
    """Records that (mostly) satisfy a JSON schema node of the subset ``codec`` reads."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    typ = node.get("type")
    if typ == "string" and node.get("contentEncoding") == "base64":
        return st.binary(max_size=48)
    if typ == "string":
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True)
        return st.text(max_size=16)
    if typ == "integer":
        lo = node.get("minimum", -(2**63))
        return st.integers(min_value=lo, max_value=min(node.get("maximum", 2**64 - 1), 2**64 - 1))
    if typ == "number":
        return st.one_of(st.floats(allow_nan=True), st.integers(min_value=-(2**63), max_value=2**63 - 1))
    if typ == "boolean":
        return st.booleans()
    if typ == "null":
        return st.none()
    if typ == "array":
        return st.lists(_schema_strategy(node.get("items", {}), defs, st), max_size=4)
    if typ == "object":
        props = node.get("properties", {})
        req = set(node.get("required", ()))
        return st.fixed_dictionaries(
            {k: _schema_strategy(v, defs, st) for k, v in props.items() if k in req},
            optional={k: _schema_strategy(v, defs, st) for k, v in props.items() if k not in req},
        )
    return _any_value(st)


def _any_value(st: Any) -> Any:
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(),
        st.text(max_size=12),
        st.binary(max_size=24),
    )
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)
        ),
        max_leaves=12,
    )


def _record_bytes(kind: str, st: Any) -> Any:
    """msgpack bytes of ``kind`` records: valid ones, ones with a field dropped, added or
    replaced, a wrong schema tag, truncated, bit-flipped, with trailing bytes, or random."""
    import msgpack

    from astate_store.model import codec

    sch = codec.schema_of(kind)
    rec = _schema_strategy(sch, sch.get("$defs", {}), st)

    @st.composite
    def mutated(draw: Any) -> bytes:
        r = dict(draw(rec))
        how = draw(
            st.sampled_from(
                ["valid", "drop", "add", "replace", "tag", "truncate", "flip", "trail", "not_map"]
            )
        )
        if how == "drop" and r:
            r.pop(draw(st.sampled_from(sorted(r))))
        elif how == "add":
            r[draw(st.text(max_size=8))] = draw(_any_value(st))
        elif how == "replace" and r:
            r[draw(st.sampled_from(sorted(r)))] = draw(_any_value(st))
        elif how == "tag":
            r["schema"] = draw(
                st.one_of(
                    st.sampled_from([f"{k}/1" for k in codec.KINDS] + [f"{kind}/2", kind, "/"]),
                    _any_value(st),
                )
            )
        if how == "not_map":
            data = msgpack.packb(draw(_any_value(st)), use_bin_type=True)
        else:
            data = msgpack.packb(r, use_bin_type=True)
        if how == "truncate" and data:
            data = data[: draw(st.integers(0, len(data) - 1))]
        elif how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
        elif how == "trail":
            data += draw(st.binary(min_size=1, max_size=8))
        return data

    return st.one_of(mutated(), st.binary(max_size=64))


def _i64s(values: Sequence[int]) -> bytes:
    import numpy as np

    return np.asarray(values, dtype="<i8").tobytes()


def _manifest_columns(st: Any) -> Any:
    """Manifest-like column dicts whose lengths and values (mostly) fit together, so the checks
    past the schema run: dtype codes, box bounds, column lengths."""

    @st.composite
    def cols(draw: Any) -> dict[str, Any]:
        n = draw(st.integers(0, 4))
        nd = [draw(st.integers(0, 3)) for _ in range(n)]
        total = sum(nd)
        small = st.integers(-3, 40) if draw(st.booleans()) else st.integers(-(2**63), 2**63 - 1)
        gs = [draw(st.integers(0, 40)) for _ in range(total)]
        of = [draw(st.integers(0, g)) for g in gs]
        sz = [draw(st.integers(0, g - o)) for g, o in zip(gs, of)]
        if draw(st.booleans()):  # break one thing
            which = draw(st.sampled_from(["gs", "of", "sz", "nd", "dt", "len"]))
            if which == "gs" and gs:
                gs[draw(st.integers(0, len(gs) - 1))] = draw(small)
            elif which == "of" and of:
                of[draw(st.integers(0, len(of) - 1))] = draw(small)
            elif which == "sz" and sz:
                sz[draw(st.integers(0, len(sz) - 1))] = draw(small)
            elif which == "nd" and nd:
                nd[draw(st.integers(0, len(nd) - 1))] = draw(st.integers(0, 255))
            elif which == "len":
                gs = gs + [draw(st.integers(0, 9))]
        dts = bytes(draw(st.integers(0, 11 if draw(st.booleans()) else 255)) for _ in range(n))
        return {
            "names": [draw(st.from_regex(r"[a-z][a-z0-9_.]{0,6}", fullmatch=True)) for _ in range(n)],
            "dtypes": dts,
            "ndims": bytes(min(255, x) for x in nd),
            "global_shapes": _i64s(gs),
            "offsets": _i64s(of),
            "sizes": _i64s(sz),
        }

    return cols()


def _fuzz_call(target: str, data: Any, st: Any) -> Callable[[], Any]:
    """The decoder call for one drawn example (``data`` is hypothesis' interactive draw)."""
    import msgpack

    from astate_store.catalog import blobs, records
    from astate_store.model import codec
    from astate_store.model.layout import Box, ShardRecord

    if target.startswith("codec:"):
        kind = target.split(":", 1)[1]
        raw = data.draw(_record_bytes(kind, st))
        return lambda: codec.decode(kind, raw)
    if target == "counter":
        raw = data.draw(st.one_of(st.binary(max_size=24), st.from_regex(rb"[0-9]{18,22}", fullmatch=True)))
        return lambda: codec.decode_counter(raw)
    if target == "blob_from_kvs":
        key = "/astate/fz/manifests/" + "a" * 24
        payload = data.draw(st.binary(max_size=64))
        how = data.draw(st.sampled_from(["none", "zlib", "bad"]))
        import zlib

        stored = zlib.compress(payload) if how == "zlib" else payload
        chunked = data.draw(st.booleans())
        head: dict[str, Any] = {
            "size": data.draw(st.sampled_from([len(payload), len(payload) + 1, 0])),
            "codec": "zlib" if how in ("zlib", "bad") else "none",
            "digest": blobs._digest(stored) if data.draw(st.booleans()) else "0" * 16,
        }
        kvs: list[tuple[bytes, Any]] = []
        if chunked:
            parts = [stored[i : i + 8] for i in range(0, len(stored), 8)] or [b""]
            head["chunks"] = data.draw(st.sampled_from([len(parts), len(parts) + 1, max(0, len(parts) - 1)]))
            for i, part in enumerate(parts):
                if data.draw(st.integers(0, 9)) == 0:
                    continue  # a lost chunk
                kvs.append((part, _Meta(f"{key}/{i:06d}".encode())))
        else:
            head["chunks"] = 0
            head["data"] = stored
        if data.draw(st.booleans()):
            head_raw = (
                codec.encode("blob", head)
                if data.draw(st.integers(0, 4))
                else data.draw(_record_bytes("blob", st))
            )
            kvs.append((head_raw, _Meta(key.encode())))
        for _ in range(data.draw(st.integers(0, 2))):  # stray keys under the blob's range
            suffix = data.draw(st.one_of(st.text(max_size=8).map(str.encode), st.binary(max_size=8)))
            kvs.append((data.draw(st.binary(max_size=16)), _Meta(key.encode() + b"/" + suffix)))
        order = data.draw(st.permutations(list(range(len(kvs)))))
        kvs = [kvs[i] for i in order]
        return lambda: blobs.blob_from_kvs(key, kvs)
    if target == "manifest_from_record":
        cols = data.draw(_manifest_columns(st))
        try:
            mid = records._columns_id(cols)
        except Exception:
            mid = "0" * 24
        if data.draw(st.integers(0, 9)) == 0:
            mid = data.draw(st.from_regex(r"[0-9a-f]{24}", fullmatch=True))
        raw = msgpack.packb({"schema": "manifest/1", "manifest_id": mid, **cols}, use_bin_type=True)

        def go() -> Any:
            m = records.manifest_from_record(codec.decode("manifest", raw), mid)
            return m.records(0)

        return go
    if target == "layout_from_record":
        shards = [
            ShardRecord("w", "float32", (8, 6), Box((0, 0), (4, 6)), (6, 1), 0, 0, 0),
            ShardRecord("b", "bfloat16", (6,), Box((0,), (6,)), (1,), 0, 0, 96),
            ShardRecord("n", "int64", (), Box((), ()), (), 0, 1, 0),
        ]
        man_rec = records.manifest_record(shards)
        manifest = records.manifest_from_record(man_rec, man_rec["manifest_id"])
        good = records.layout_record(3, 1, manifest, shards, b"\x80")
        rec = dict(good)
        for field in data.draw(
            st.lists(
                st.sampled_from(
                    [
                        "strides",
                        "regions",
                        "byte_offsets",
                        "epoch",
                        "rank",
                        "transport",
                        "manifest_id",
                        "packed",
                    ]
                ),
                max_size=3,
            )
        ):
            if field in ("strides", "regions", "byte_offsets"):
                rec[field] = _i64s(data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6)))
            elif field in ("epoch", "rank"):
                rec[field] = data.draw(st.integers(0, 5))
            elif field == "transport":
                rec[field] = data.draw(st.binary(max_size=16))
            elif field == "manifest_id":
                rec[field] = data.draw(st.from_regex(r"[0-9a-f]{24}", fullmatch=True))
            else:
                p = data.draw(_manifest_columns(st))
                m = len(p["names"])
                p["regions"] = _i64s(data.draw(st.lists(st.integers(-2, 3), min_size=m, max_size=m + 1)))
                p["byte_offsets"] = _i64s(
                    data.draw(st.lists(st.integers(-2, 2**40), min_size=m, max_size=m + 1))
                )
                rec["packed"] = p
        rec.pop("layout_id", None)
        lid = records._layout_id(rec) if data.draw(st.integers(0, 9)) else good["layout_id"]
        rec["layout_id"] = lid
        epoch, rank = data.draw(st.sampled_from([(3, 1), (None, None), (rec["epoch"], rec["rank"]), (0, 0)]))
        raw = msgpack.packb({"schema": "layout/1", **rec}, use_bin_type=True)

        def go_layout() -> Any:
            lay = records.layout_from_record(
                codec.decode("layout", raw), manifest, key_id=lid, epoch=epoch, rank=rank
            )
            return (lay.shards, lay.packed)

        return go_layout
    if target == "version_from_kvs":
        ns, step = "fz", data.draw(st.integers(0, 3))
        pre = f"/astate/{ns}/versions/{records.pad20(step)}/"
        epoch, world = data.draw(st.integers(0, 2)), data.draw(st.integers(1, 2))
        good = {"commit": {"step": step, "epoch": epoch, "world_size": world, "committed_at": 1.0}}
        kvs = [(codec.encode("commit", good["commit"]), _Meta((pre + "commit").encode()))]
        for r in range(world):
            kvs.append(
                (
                    codec.encode(
                        "piece",
                        {
                            "step": step,
                            "epoch": epoch,
                            "rank": r,
                            "world_size": world,
                            "layout_id": "b" * 24,
                            "base_offset": 0,
                            "manifest_id": "a" * 24,
                        },
                    ),
                    _Meta((pre + f"pieces/{records.pad20(epoch)}/{records.pad20(r)}").encode()),
                )
            )
        if data.draw(st.booleans()):
            kvs.append(
                (
                    codec.encode(
                        "replica",
                        {
                            "step": step,
                            "group": "g",
                            "member": "m",
                            "layout_id": "b" * 24,
                            "manifest_id": "a" * 24,
                        },
                    ),
                    _Meta((pre + "replicas/g/m").encode()),
                )
            )
        for _ in range(data.draw(st.integers(0, 2))):  # what a hostile writer adds or overwrites
            e, r = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
            kind, suffix = data.draw(
                st.sampled_from(
                    [
                        ("commit", "commit"),
                        ("piece", f"pieces/{records.pad20(e)}/{records.pad20(r)}"),
                        ("replica", f"replicas/g{r}/m{e}"),
                        ("piece", "pieces/x/y"),
                        ("piece", f"pieces/{e}"),
                        ("piece", f"pieces/{e}/{r}/z"),
                        ("commit", "commit/extra"),
                        ("replica", "replicas/g"),
                        ("replica", "replicas/a/b/c"),
                        ("raw", None),
                        ("raw", ""),
                    ]
                )
            )
            if suffix is None:
                kb = pre.encode() + data.draw(st.binary(max_size=12))
            else:
                kb = (pre + suffix).encode()
            value = data.draw(st.binary(max_size=32)) if kind == "raw" else data.draw(_record_bytes(kind, st))
            kvs.append((value, _Meta(kb)))
        order = data.draw(st.permutations(list(range(len(kvs)))))
        kvs = [kvs[i] for i in order]
        return lambda: records.version_from_kvs(ns, step, kvs)
    raise ValueError(f"unknown fuzz target {target!r}")


def _closure_repr(fn: Callable[[], Any]) -> str:
    """The drawn input of a fuzz call (its closure's data, not modules or functions), for the report."""
    import types

    cells = getattr(fn, "__closure__", None) or ()
    vals = [
        c.cell_contents
        for c in cells
        if not isinstance(c.cell_contents, (types.ModuleType, types.FunctionType))
        and not callable(c.cell_contents)
    ]
    return repr(vals)[:700]


def op_fuzz(state: dict[str, Any], target: str, examples: int, seed: int) -> dict[str, Any]:
    """``examples`` hypothesis examples through one decoder. Each example is a trial: it decoded
    (``ok``), raised a typed error (``CodecError`` / ``AStateError``), or crashed (anything else:
    counted, with the first few inputs and tracebacks)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from astate_store import AStateError

    counts = {"trials": 0, "ok": 0, "typed": 0, "crashes": 0}
    crashes: list[dict[str, Any]] = []
    seen: set[str] = set()

    @hseed(seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @given(st.data())
    def run(data: Any) -> None:
        call = _fuzz_call(target, data, st)
        counts["trials"] += 1
        try:
            call()
            counts["ok"] += 1
        except AStateError:
            counts["typed"] += 1
        except Exception as exc:
            counts["crashes"] += 1
            tb = traceback.extract_tb(exc.__traceback__)
            where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno} {tb[-1].name}" if tb else "?"
            sig = f"{type(exc).__name__} at {where}"
            if sig not in seen and len(crashes) < 6:
                seen.add(sig)
                crashes.append({"signature": sig, "msg": str(exc)[:200], "input": _closure_repr(call)})

    run()
    return {**counts, "crash_examples": crashes}


# ------------------------------------------------------------------------------- actor main loop


def actor_main() -> None:
    # Our stdout is the protocol: anything else the store or UCX prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = proto
    import logging

    logging.basicConfig(
        level=os.environ.get("ASTATE_FAULT_LOG", "WARNING"),
        stream=sys.stderr,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # the driver asks on a hang
    _torch()
    import astate_store.store  # noqa: F401  (import cost paid before "ready")
    from astate_store import AStateError

    state: dict[str, Any] = {"held": {}, "orphans": {}}
    ops = {k[3:]: v for k, v in globals().items() if k.startswith("op_")}
    _emit({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        rid = cmd.get("id")
        try:
            fn = ops[cmd["op"]]
            result = fn(state, *cmd.get("args", []), **cmd.get("kw", {}))
            _emit({"id": rid, "ok": True, "result": result})
        except AStateError as exc:
            _emit({"id": rid, "ok": False, "typed": True, "etype": type(exc).__name__, "msg": str(exc)[:500]})
        except Exception as exc:
            _emit(
                {
                    "id": rid,
                    "ok": False,
                    "typed": False,
                    "etype": type(exc).__name__,
                    "msg": str(exc)[:500],
                    "tb": traceback.format_exc()[-2000:],
                }
            )
    for h in list(state["held"].values()):
        _close_held(h)
    if "etcd" in state:
        state["etcd"].stop()


# ============================================================================= driver-side pieces


class Hang(Exception):
    """An actor did not answer within the timeout (it has been killed)."""


class Died(Exception):
    """An actor exited (or was killed) before answering."""


class Actor:
    """One actor process. Every wait is bounded; :meth:`kill` ends it by PID."""

    def __init__(
        self, name: str, logdir: str, netns: str | None = None, env: Mapping[str, str] | None = None
    ):
        self.name = name
        self.netns = netns
        self.log_path = os.path.join(logdir, f"{name}.log")
        e = dict(os.environ)
        e.pop("ASTATE_ETCD", None)
        e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        e.setdefault("ASTATE_HOME", os.path.join(logdir, "home"))  # never the host's shared embedded etcd
        e.setdefault("UCX_LOG_LEVEL", "error")
        e.update(env or {})
        cmd = [sys.executable, "-u", "-m", "tests.support.fault_workers", "--actor"]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        # SIGTERM when the driver dies (its pipes would close too, but an actor stuck in a call never reads)
        from astate_store.etcd.embedded import tied_to_caller

        cmd = tied_to_caller(cmd)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=str(ROOT),
            env=e,
            text=True,
            bufsize=1,
        )
        self._q: queue.Queue[Any] = queue.Queue()
        self._events: queue.Queue[Any] = queue.Queue()
        self._replies: dict[int, Any] = {}
        self._next = 0
        self.pid: int | None = None
        self.dead = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "event" in msg:
                self._events.put(msg)
            else:
                self._q.put(msg)
        self._q.put(None)  # EOF: the process is gone
        self._events.put(None)

    def wait_ready(self, timeout: float = 120.0) -> Actor:
        ev = self.event(timeout)
        if ev.get("event") != "ready":
            raise Died(f"actor {self.name}: unexpected first event {ev}")
        self.pid = int(ev["pid"])
        return self

    def event(self, timeout: float) -> dict[str, Any]:
        try:
            ev = self._events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise Hang(f"actor {self.name}: no event within {timeout:.1f}s") from None
        if ev is None:
            self._events.put(None)
            raise Died(f"actor {self.name} exited ({self.exit_status()})")
        return dict(ev)

    def send(self, op: str, *args: Any, **kw: Any) -> int:
        if self.dead or self.proc.poll() is not None:
            raise Died(f"actor {self.name} is not running ({self.exit_status()})")
        self._next += 1
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(
                json.dumps({"id": self._next, "op": op, "args": list(args), "kw": kw}) + "\n"
            )
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise Died(f"actor {self.name}: {exc}") from None
        return self._next

    def result(self, rid: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while rid not in self._replies:
            try:
                msg = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise Hang(f"actor {self.name} (pid {self.pid}): no answer within {timeout:.1f}s") from None
            if msg is None:
                self._q.put(None)
                raise Died(
                    f"actor {self.name} (pid {self.pid}) exited before answering ({self.exit_status()})"
                )
            self._replies[int(msg["id"])] = msg
        return dict(self._replies.pop(rid))

    def call(self, op: str, *args: Any, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        """Run an op; the reply dict (``ok``, ``result`` or the error). Raises Hang/Died."""
        return self.result(self.send(op, *args, **kw), timeout)

    def must(self, op: str, *args: Any, timeout: float = 60.0, **kw: Any) -> Any:
        """Run an op that must succeed (set-up steps); raises RuntimeError with its error otherwise."""
        r = self.call(op, *args, timeout=timeout, **kw)
        if not r["ok"]:
            raise SetupError(f"{self.name}.{op}: {r['etype']}: {r['msg']}", r)
        return r["result"]

    def exit_status(self) -> str:
        rc = self.proc.poll()
        if rc is None:
            return "running"
        return f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"

    def log_tail(self, n: int = 1500) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stacks(self, wait: float = 1.0) -> str:
        """Ask a live actor for every thread's Python stack (faulthandler on SIGUSR1); its log tail."""
        if self.proc.poll() is not None or self.pid is None:
            return ""
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        time.sleep(wait)
        return self.log_tail(3000)

    def kill(self) -> None:
        """SIGKILL by PID and reap. Only a process not yet reaped is signalled (its pid cannot
        have been reused); ``ip netns exec`` execs the actor, so its pid is the Popen's."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.dead = True
        if not self._log.closed:
            self._log.close()

    def close(self, timeout: float = 15.0) -> None:
        if self.dead:
            return
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


class SetupError(Exception):
    """A set-up step of a trial failed (reported as a typed error when the store's error was typed)."""

    def __init__(self, msg: str, reply: Mapping[str, Any] | None = None):
        super().__init__(msg)
        self.reply = dict(reply or {})


class Pool:
    """Actors for trials: ``take`` hands out a ready one and starts its replacement at once (a
    Python + torch start takes seconds), ``give`` takes back one that is still healthy."""

    def __init__(self, logdir: str, spares: int = 2):
        self.logdir, self.nspares = logdir, spares
        self._n = 0
        self.spares: list[Actor] = []
        self.idle: list[Actor] = []
        self.all: list[Actor] = []
        self._fill()

    def _new(self, netns: str | None = None, env: Mapping[str, str] | None = None) -> Actor:
        self._n += 1
        a = Actor(f"a{self._n:03d}" + (f"-{netns}" if netns else ""), self.logdir, netns=netns, env=env)
        self.all.append(a)
        return a

    def _fill(self) -> None:
        while len(self.spares) < self.nspares:
            self.spares.append(self._new())

    def take(self, timeout: float = 120.0) -> Actor:
        a = self.idle.pop() if self.idle else self.spares.pop(0)
        self._fill()
        if a.pid is None:
            a.wait_ready(timeout)
        return a

    def take_in(self, netns: str, timeout: float = 120.0, env: Mapping[str, str] | None = None) -> Actor:
        return self._new(netns, env).wait_ready(timeout)

    def give(self, a: Actor, timeout: float = 30.0) -> None:
        """Reset a surviving actor (close its stores) for reuse; kill it if it does not answer."""
        if a.dead or a.netns or a.proc.poll() is not None:
            a.kill()
            return
        try:
            r = a.call("reset", timeout=timeout)
            if r["ok"]:
                self.idle.append(a)
                return
        except (Hang, Died):
            pass
        a.kill()

    def close(self) -> None:
        for a in self.all:
            if not a.dead:
                a.close(timeout=5.0)


# ---- etcd that can be restarted on its data dir and port --------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(endpoint: str, timeout: float = 0.5) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=timeout) as r:
            return json.loads(r.read()).get("health") in ("true", True)
    except (OSError, ValueError):
        return False


class EtcdProcess:
    """One etcd on 127.0.0.1 that keeps its data dir and ports across restarts."""

    def __init__(self, base: str):
        from astate_store.etcd.embedded import find_etcd_binary

        self.binary = find_etcd_binary()
        self.dir = tempfile.mkdtemp(prefix="etcd-", dir=base)
        self.client_port, self.peer_port = _free_port(), _free_port()
        while self.peer_port == self.client_port:
            self.peer_port = _free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> EtcdProcess:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name",
            "f",
            "--data-dir",
            os.path.join(self.dir, "data"),
            "--listen-client-urls",
            c,
            "--advertise-client-urls",
            c,
            "--listen-peer-urls",
            p,
            "--initial-advertise-peer-urls",
            p,
            "--initial-cluster",
            f"f={p}",
            "--initial-cluster-state",
            "new",
            "--log-level",
            "error",
        ]
        from astate_store.etcd.embedded import tied_to_caller

        with open(os.path.join(self.dir, "etcd.log"), "ab") as log:
            self.proc = subprocess.Popen(
                tied_to_caller(cmd), stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if _health(self.endpoint):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd did not become healthy on {self.endpoint}")

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM, wait=5.0)
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":
    if "--actor" in sys.argv:
        actor_main()

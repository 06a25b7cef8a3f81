"""The actor's store operations: its line protocol's output, the stores it holds, and the ops a
driver sends (open a publisher or consumer, put, pull, serve, checkpoint, recover, close), plus the
zombie-writes case (an old session that keeps writing after a new one opened).

An op is ``op_<name>(state, *args, **kw)``; :mod:`tests.support.faults.actor` runs them.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tests.support.data import value
from tests.support.faults.model import (
    check_buffers,
    identify,
    lazy_torch,
    make_buffers,
    poison,
    probe_process,
    publisher_boxes,
    same_bytes,
    select_box,
    spec,
    tdtype,
    tensor_of,
)


def close_all(stores: Any) -> None:
    """Close every store a trial opened; one failing close does not keep the others open."""
    for s in stores:
        try:
            s.close()
        except Exception:  # the trial's outcome is already recorded
            pass


_OUT_LOCK = threading.Lock()


def emit(obj: Mapping[str, Any]) -> None:
    line = json.dumps(obj, default=str)
    with _OUT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def emit_event(kind: str, **kw: Any) -> None:
    emit({"event": kind, **kw})


class Held:
    """One store an actor holds, with its buffers and tensors."""

    def __init__(self, store: Any, role: str, size: str, **kw: Any):
        self.store, self.role, self.size = store, role, size
        self.bufs: dict[str, dict[str, Any]] = {}  # layout -> buffers (kept: serve needs the same tensors)
        self.tensors: dict[str, Any] = {}
        self.serving = False
        self.hook: dict[str, Any] | None = None
        self.extra = kw


def open_store(endpoint: str, ns: str, **kw: Any) -> Any:
    from astate_store.store import Store

    kw.setdefault("affinity", False)
    return Store(ns, endpoint=endpoint, **kw)


def close_held(h: Held) -> None:
    try:
        h.store.close()
    except Exception:  # closing after a fault may fail; the next op reports what matters
        pass


def _install_hook(h: Held) -> None:
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
    torch = lazy_torch()
    from astate_store import Shard

    store = open_store(endpoint, ns, rank=rank, world_size=world, session_id=session or f"{ns}-s", **kw)
    h = Held(store, "pub", size, rank=rank, world=world)
    for name, (offs, sizes) in publisher_boxes(size, rank, world).items():
        shape, dt, _ = spec(size)[name]
        h.tensors[name] = (
            Shard(torch.zeros(sizes, dtype=tdtype(dt)), offs, shape)
            if shape
            else torch.zeros((), dtype=tdtype(dt))
        )
    old = state["held"].pop(key, None)
    if old is not None:
        close_held(old)
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
        tensor_of(t).copy_(select_box(value(name, shape, dt, step), boxes[name]))
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
        tensor_of(t).zero_()
    got = h.store.recover(h.tensors, timeout=timeout)
    boxes = publisher_boxes(h.size, h.extra["rank"], h.extra["world"])
    exact = got is not None and all(
        same_bytes(tensor_of(t), select_box(value(n, spec(h.size)[n][0], spec(h.size)[n][1], got), boxes[n]))
        for n, t in h.tensors.items()
    )
    return {"step": got, "exact": exact}


def op_open_close(state: dict[str, Any], endpoint: str, ns: str, **kw: Any) -> dict[str, Any]:
    """Open a store, ask for the newest step, close it (a process that opens a store every step)."""
    store = open_store(endpoint, ns, **kw)
    try:
        return {"latest": store.latest()}
    finally:
        store.close()


def op_con_open(
    state: dict[str, Any], key: str, endpoint: str, ns: str, *, size: str = "small", **kw: Any
) -> dict[str, Any]:
    old = state["held"].pop(key, None)
    if old is not None:
        close_held(old)
    state["held"][key] = Held(open_store(endpoint, ns, **kw), "con", size)
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
    close_held(h)
    if keep_buffers and h.bufs:
        state["orphans"][key] = next(iter(h.bufs.values()))
    return {"closed": True}


def op_reset(state: dict[str, Any]) -> dict[str, Any]:
    n = len(state["held"])
    for h in list(state["held"].values()):
        close_held(h)
    state["held"].clear()
    state["orphans"].clear()

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
                "lanes": info.lanes[:300],
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
    old = open_publisher(endpoint, ns, "old", 0, 1, size)
    new = None
    stores = [old[0]]
    try:
        put_step(old, 1, True)
        res.append({"what": "old put 1", "ok": True})
        if variant % 3 == 2:
            # The new session opens (epoch bumped) but never commits: world 2, rank 1 never comes.
            new = open_publisher(endpoint, ns, "new", 0, 2, size)
            stores.append(new[0])
            committed_new = put_step(new, 2, True)
            newest = 1
            res.append({"what": "new put 2 (rank 1 absent)", "ok": True, "committed": committed_new})
        else:
            new = open_publisher(endpoint, ns, "new", 0, 1, size)
            stores.append(new[0])
            put_step(new, 2, True)
            newest = 2
            res.append({"what": "new put 2", "ok": True})
        zombie_ops: list[tuple[str, Callable[[], Any]]] = [
            ("zombie put 3 (snapshot)", lambda: put_step(old, 3, True)),
            ("zombie put 4 (in place)", lambda: put_step(old, 4, False)),
        ]
        # (A zombie's retire() is not fenced on purpose: marking its memory retired protects readers.)
        if variant % 3 == 1:
            zombie_ops.insert(
                0, ("zombie put 2 (same step as the new session)", lambda: put_step(old, 2, True))
            )
        for what, fn in zombie_ops:
            r: dict[str, Any] = {"what": what, "zombie": True}
            try:
                r["result"] = fn()
                r["ok"] = True
            except AStateError as exc:
                r.update(ok=False, etype=type(exc).__name__, typed=True, msg=str(exc)[:300])
            res.append(r)
        # What consumers see: the newest commit is the new session's, exact.
        con = open_store(endpoint, ns, read_timeout=10.0)
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
        close_all(stores)
    return res


def open_publisher(
    endpoint: str, ns: str, session: str, rank: int, world: int, size: str, **kw: Any
) -> tuple[Any, Any, int, int, str]:
    torch = lazy_torch()
    from astate_store import Shard

    kw.setdefault("lease_ttl", 5.0)
    store = open_store(endpoint, ns, rank=rank, world_size=world, session_id=f"{ns}-{session}", **kw)
    tensors: dict[str, Any] = {}
    for name, (offs, sizes) in publisher_boxes(size, rank, world).items():
        shape, dt, _ = spec(size)[name]
        tensors[name] = (
            Shard(torch.zeros(sizes, dtype=tdtype(dt)), offs, shape)
            if shape
            else torch.zeros((), dtype=tdtype(dt))
        )
    return store, tensors, rank, world, size


def put_step(pub: tuple[Any, Any, int, int, str], step: int, copy: bool) -> bool:
    store, tensors, rank, world, size = pub
    if not copy:
        store.retire(timeout=1.0)
    boxes = publisher_boxes(size, rank, world)
    for name, t in tensors.items():
        shape, dt, _ = spec(size)[name]
        tensor_of(t).copy_(select_box(value(name, shape, dt, step), boxes[name]))
    return bool(store.put(step, tensors, copy=copy))

"""Publisher processes for the data-path tests, and the model specs both sides rebuild.

Every tensor's value at step s is a pure function of (name, step), so any process can
compute the expected global tensor and check a consumer's buffers byte for byte.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from tests.support.data import value

Box = tuple[tuple[int, ...], tuple[int, ...]]


def split(shape: tuple[int, ...], dim: int, parts: int, index: int, uneven: bool = False) -> Box:
    """Box ``index`` of ``parts`` along ``dim``; uneven gives the first part one extra row."""
    n = shape[dim]
    if uneven:
        cuts = [0] + [min(n, (n // parts) * (i + 1) + 1) for i in range(parts - 1)] + [n]
    else:
        cuts = [n * i // parts for i in range(parts + 1)]
    offs = [0] * len(shape)
    sizes = list(shape)
    offs[dim], sizes[dim] = cuts[index], cuts[index + 1] - cuts[index]
    return tuple(offs), tuple(sizes)


def whole(shape: tuple[int, ...]) -> Box:
    return (0,) * len(shape), shape


# name -> (global shape, dtype, trainer box for (tp_rank, tp_size))
SPECS: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype, Callable[[int, int], Box]]]] = {
    "mixed": {
        "emb": ((64, 48), torch.float32, lambda r, n: split((64, 48), 0, n, r)),  # row-parallel
        "qkv": ((96, 48), torch.bfloat16, lambda r, n: split((96, 48), 1, n, r)),  # column-parallel
        "odd": ((37, 29), torch.float32, lambda r, n: split((37, 29), 0, n, r, uneven=True)),
        "experts": ((8, 24, 16), torch.float16, lambda r, n: split((8, 24, 16), 0, n, r)),  # expert-parallel
        "norm": ((48,), torch.float32, lambda r, n: whole((48,))),  # replicated
        "step_count": ((), torch.int64, lambda r, n: whole(())),
    },
    "dim0": {  # the "mixed" tensors with every split on dim 0 (FSDP-like): one range per shard
        "emb": ((64, 48), torch.float32, lambda r, n: split((64, 48), 0, n, r)),
        "qkv": ((96, 48), torch.bfloat16, lambda r, n: split((96, 48), 0, n, r)),
        "odd": ((37, 29), torch.float32, lambda r, n: split((37, 29), 0, n, r, uneven=True)),
        "experts": ((8, 24, 16), torch.float16, lambda r, n: split((8, 24, 16), 0, n, r)),
        "norm": ((48,), torch.float32, lambda r, n: whole((48,))),
        "step_count": ((), torch.int64, lambda r, n: whole(())),
    },
    "big": {  # 128 MiB: a pull takes long enough to be killed in the middle of it
        "w": ((2048, 16384), torch.float32, lambda r, n: split((2048, 16384), 0, n, r))
    },
}


# Pipeline stages of the "mixed" model: stage r of n holds the whole tensors whose index is r mod n.
STAGES = "stages"


def stage_names(stage: int, stages: int) -> list[str]:
    return [n for i, n in enumerate(SPECS["mixed"]) if i % stages == stage]


def local_tensors(
    spec: str, step: int, tp_rank: int, tp_size: int, *, strided: bool = False
) -> dict[str, Any]:
    from astate_store import Shard

    out: dict[str, Any] = {}
    if spec == STAGES:  # rank tp_rank is pipeline stage tp_rank of tp_size (whole tensors)
        for name in stage_names(tp_rank, tp_size):
            shape, dtype, _ = SPECS["mixed"][name]
            out[name] = Shard(value(name, shape, dtype, step).clone(), (0,) * len(shape), shape)
        return out
    for name, (shape, dtype, boxer) in SPECS[spec].items():
        offs, sizes = boxer(tp_rank, tp_size)
        full = value(name, shape, dtype, step)
        piece = full[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        if strided and piece.dim() == 2:
            # A view with strides: the piece lives inside a wider buffer.
            holder = torch.zeros(piece.shape[0], piece.shape[1] + 5, dtype=dtype)
            holder[:, 2 : 2 + piece.shape[1]] = piece
            piece = holder[:, 2 : 2 + piece.shape[1]]
        else:
            piece = piece.clone()
        out[name] = Shard(piece, offs, shape)
    return out


def publisher_main(
    endpoint: str,
    ns: str,
    rank: int,
    world: int,
    tp: int,
    spec: str,
    transport: str,
    cmds: Any,
    out: Any,
    copy: bool = True,
    session: str = "pub",
) -> None:
    """A trainer rank: on ("put", step) publish that step; on ("exit",) leave."""
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
    )
    tensors = local_tensors(spec, 0, rank % tp, tp, strided=not copy)
    out.put(("ready", rank, os.getpid()))
    while True:
        cmd = cmds.get()
        if cmd[0] == "exit":
            break
        if cmd[0] == "checkpoint":
            out.put(("checkpoint", rank, store.checkpoint(cmd[1], cmd[2])))
            continue
        if cmd[0] in ("recover", "recover_misfit"):
            blank = {
                n: type(sh)(torch.zeros_like(sh.tensor), sh.offsets, sh.global_shape)
                for n, sh in tensors.items()
            }
            if cmd[0] == "recover_misfit":  # one buffer's global shape is one row longer than published
                n0, sh0 = next(iter(blank.items()))
                blank[n0] = type(sh0)(
                    sh0.tensor, sh0.offsets, (sh0.global_shape[0] + 1, *sh0.global_shape[1:])
                )
            try:
                got = store.recover(blank, timeout=20, uri=cmd[1])
                ok = got is not None and all(
                    torch.equal(blank[n].tensor, local_tensors(spec, got, rank % tp, tp)[n].tensor)
                    for n in blank
                )
                out.put(("recovered", rank, got, ok))
            except astate_store.AStateError as exc:
                out.put(("error", rank, None, f"{type(exc).__name__}: {exc}"))
            continue
        step = cmd[1]
        if cmd[0] == "die_in_put":
            _die_before_piece(store, rank, step, out)
        if not copy:
            store.retire()
        new = local_tensors(spec, step, rank % tp, tp)
        for name, sh in tensors.items():
            sh.tensor.copy_(new[name].tensor)
        try:
            committed = store.put(step, tensors, copy=copy)
            out.put(("put", rank, step, committed))
        except astate_store.AStateError as exc:
            out.put(("error", rank, step, f"{type(exc).__name__}: {exc}"))
    store.close()
    out.put(("bye", rank))
    out.close()
    out.join_thread()  # the queue's feeder thread has written every message


def _die_before_piece(store: Any, rank: int, step: int, out: Any) -> None:
    """Make the next put SIGKILL this process in its middle: after its snapshot is copied and
    its layout published, just before its piece of ``step`` reaches etcd."""
    import signal

    def die(*_a: Any, **_k: Any) -> bool:
        out.put(("dying", rank, step))
        out.close()
        out.join_thread()  # the queue's feeder thread has written the message: SIGKILL loses nothing
        os.kill(os.getpid(), signal.SIGKILL)
        return False  # not reached

    store.catalog.versions.put_piece = die


def mutating_publisher(
    endpoint: str,
    ns: str,
    transport: str,
    steps: int,
    numel: int,
    ntensors: int,
    retire_timeout: float,
    out: Any,
) -> None:
    """Zero-copy publisher that rewrites its live tensors as fast as it can: before each change it
    retires the versions it published; every element of step s holds the value s."""
    from astate_store.store import Store

    store = Store(
        ns,
        endpoint=endpoint,
        transport=transport,
        session_id=f"{ns}-zc",
        lease_ttl=5.0,
        retire_timeout=retire_timeout,
    )
    tensors = {f"t{i}": torch.zeros(numel) for i in range(ntensors)}
    store.put(0, tensors, copy=False)
    out.put(("ready", os.getpid()))
    for step in range(1, steps + 1):
        store.retire()
        for t in tensors.values():
            t.fill_(float(step))
        store.put(step, tensors, copy=False)
    out.put(("done", steps))
    time.sleep(30)  # keep the memory alive for consumers until the test ends it
    store.close()


def consumer_main(
    endpoint: str,
    ns: str,
    transport: str,
    step: int | None,
    serve: bool,
    out: Any,
    hold: float = 0.0,
    names: Any = None,
) -> None:
    """A rollout process holding the whole model (or the tensors in ``names``): pull, check every
    byte, optionally re-serve."""
    from astate_store.store import Store

    bufs = {
        n: torch.zeros(shape, dtype=dt)
        for n, (shape, dt, _) in SPECS["mixed"].items()
        if names is None or n in names
    }
    with Store(ns, endpoint=endpoint, transport=transport, lease_ttl=2.0) as store:
        try:
            got = store.get_into(bufs, step=step, timeout=30)
        except Exception as exc:  # reported to the test, which asserts on it
            out.put(("error", f"{type(exc).__name__}: {exc}"))
            return
        exact = all(torch.equal(b, value(n, tuple(b.shape), b.dtype, got)) for n, b in bufs.items())
        if serve:
            store.serve(got, bufs)
        out.put(("got", got, exact, os.getpid()))
        time.sleep(hold)


def device_publisher(endpoint: str, ns: str, device: str, numel: int, out: Any) -> None:
    """Publishes one tensor of value step + index on ``device`` (snapshot staging on that device)."""
    from astate_store.store import Store

    with Store(ns, endpoint=endpoint, transport="auto", session_id=f"{ns}-dev") as store:
        t = torch.arange(numel, dtype=torch.float32, device=device)
        store.put(1, {"w": t})
        out.put(("put", 1))
        time.sleep(60)


def looping_consumer(endpoint: str, ns: str, out: Any) -> None:
    """Pulls the 'big' model over and over, announcing each pull before it starts."""
    from astate_store.store import Store

    shape, dt, _ = SPECS["big"]["w"]
    buf = torch.empty(shape, dtype=dt)
    with Store(ns, endpoint=endpoint, transport="shm", lease_ttl=2.0) as store:
        while True:
            out.put("pulling")
            store.get_into({"w": buf}, timeout=30)

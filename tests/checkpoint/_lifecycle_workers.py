"""Child processes of the checkpoint lifecycle tests: publisher ranks driven by commands, and a
restore that pauses while it holds its reader lease."""

from __future__ import annotations

import os
import time
from typing import Any


def rank_main(endpoint: str, ns: str, rank: int, world: int, cmds: Any, out: Any) -> None:
    """A publisher rank of the "mixed" model (tests._store_workers). Commands:
    ("put", step, delay) -> sleep ``delay``, put; ("ckpt", step, uri, kwargs) -> checkpoint
    (asynchronous: the future's result); ("put_ckpt", step, delay, uri, kwargs) -> both at once;
    ("exit",). Each answers ("ok", rank, what, value) or ("err", rank, what, type, reason, missing, text)."""
    import astate_store
    from astate_store.store import Store
    from tests._store_workers import local_tensors

    store = Store(
        ns,
        endpoint=endpoint,
        rank=rank,
        world_size=world,
        transport="shm",
        session_id=f"{ns}-pub",
        lease_ttl=3.0,
    )
    out.put(("ready", rank, os.getpid()))
    while True:
        cmd = cmds.get()
        if cmd[0] == "exit":
            break
        what = cmd[0]
        try:
            value: Any = None
            if what in ("put", "put_ckpt"):
                time.sleep(cmd[2])
                value = store.put(cmd[1], local_tensors("mixed", cmd[1], rank, world))
            if what in ("ckpt", "put_ckpt"):
                uri, kw = (cmd[2], cmd[3]) if what == "ckpt" else (cmd[3], cmd[4])
                value = store.checkpoint(cmd[1], uri, **kw)
                if kw.get("asynchronous"):
                    value = value.result(timeout=120)
            out.put(("ok", rank, what, value))
        except astate_store.AStateError as exc:
            out.put(
                (
                    "err",
                    rank,
                    what,
                    type(exc).__name__,
                    getattr(exc, "reason", ""),
                    getattr(exc, "missing", None),
                    str(exc),
                )
            )
    store.close()
    out.put(("bye", rank))


def paused_restore(uri: str, step: int, lease_ttl: float, started: Any, go: Any, out: Any) -> None:
    """Restore ``step`` of the "mixed" model (whole tensors) from ``uri``; on its first bytes,
    report ``started`` and wait for ``go`` (the reader lease is held meanwhile). Reports whether
    every byte is the expected one."""
    import torch

    from astate_store import checkpoint as ckpt
    from tests._store_workers import SPECS, local_tensors

    bufs = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt, _) in SPECS["mixed"].items()}
    first = [True]

    def progress(done: int, total: int) -> None:
        if first[0] and done < total:
            first[0] = False
            started.set()
            go.wait(60)

    try:
        got = ckpt.restore(uri, bufs, step=step, progress=progress, lease_ttl=lease_ttl, threads=1)
        want = local_tensors("mixed", step, 0, 1)  # one rank: every box is the whole tensor
        ok = got == step and all(torch.equal(bufs[n], want[n].tensor) for n in SPECS["mixed"])
        out.put(("restored", got, ok))
    except Exception as exc:  # reported to the test
        out.put(("error", type(exc).__name__, str(exc)))


def paused_part(uri: str, step: int, world: int, conn: Any) -> None:
    """Write rank 0's part of ``step`` (tests._checkpoint_workers.rank_shards), pausing after its
    data file (before its part manifest) until ``conn`` says "go"; no commit."""
    from astate_store import checkpoint as ckpt
    from tests._checkpoint_workers import rank_shards

    def hook(point: str) -> None:
        if point == "data_written":
            conn.send("paused")
            assert conn.recv() == "go"

    ckpt._TEST_HOOK = hook
    ckpt.write_part(uri, step, 0, world, rank_shards(step, 0, world), checksum="crc32", fsync=False)
    conn.send("written")


def restore_oldest_loop(uri: str, stop: Any, out: Any) -> None:
    """Restore the oldest complete step of the "mixed" model (whole tensors) from ``uri`` again and
    again until ``stop``: the step retention removes next. Reports (ok, not found, anything else)."""
    import torch

    from astate_store import checkpoint as ckpt
    from astate_store.errors import CheckpointNotFound
    from tests._store_workers import SPECS, local_tensors

    bufs = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt, _) in SPECS["mixed"].items()}
    ok, gone, other = 0, 0, []
    while not stop.is_set():
        steps = ckpt.list_checkpoints(uri)
        if not steps:
            continue
        try:
            got = ckpt.restore(uri, bufs, step=steps[0], threads=1)
            want = local_tensors("mixed", got, 0, 1)
            exact = got == steps[0] and all(torch.equal(bufs[n], want[n].tensor) for n in SPECS["mixed"])
            if exact:
                ok += 1
            else:
                other.append(f"step {got}: bytes differ")
        except CheckpointNotFound:
            gone += 1  # removed before this restore saw its marker: never read
        except Exception as exc:  # a torn read: what the test must never see
            other.append(f"{type(exc).__name__}: {exc}")
    out.put((ok, gone, other[:5]))

"""Pull from whatever is alive, under torchrun with the embedded etcd (tests/get/test_live_pull.py).

    torchrun --standalone --nproc-per-node 2 tests/get/_live_pull.py

Both ranks put steps 1..3 of ``w`` (8 x 16, rank r holds rows 4r..4r+4) and ``norm`` (16,
replicated: both ranks hold all of it). Rank 0 also opens a second, consumer-only store (the
"watcher") that pulls all of ``w`` while rank 1 is alive, so it holds rank 1's layout and endpoint.
It also pulls rank 0's rows and ``norm`` then (a plan that may read ``norm`` from rank 1). Then rank
1 closes its store and exits. Rank 0, once rank 1's process is gone, pulls step 3:

- ``own``: its own rows of ``w`` and ``norm``, through its publishing store (never pulled before);
- ``watcher_own``: the same through the watcher (rank 1's layout cached there);
- ``full`` and ``watcher_full``: all of ``w`` -- rows 4..8 only rank 1 held: the typed error;
- ``straddle``: rows 2..6 of ``w`` -- the error names rows 4..6 only.

Each buffer starts as -1, so a failed pull that moved bytes would show. Environment (set by the
test): ``ASTATE_HOME`` (rendezvous dir), ``LP_OUT`` (where rank r writes ``result-<r>.json``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import astate_store
from astate_store import NoLiveSource, Shard
from astate_store.process import exited
from tests.support.waiting import wait_until

ROWS, COLS = 8, 16


def w_value(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000.0 * step


def norm_value(step: int) -> torch.Tensor:
    return torch.linspace(0.0, 1.0, COLS) + step


def rows_of(lo: int, hi: int) -> Shard:
    return Shard(torch.full((hi - lo, COLS), -1.0), (lo, 0), (ROWS, COLS))


def attempt(store: astate_store.Store, lo: int, hi: int, with_norm: bool) -> dict[str, Any]:
    """Pull rows lo..hi of ``w`` (and ``norm``) at step 3: what came back, or the error."""
    bufs: dict[str, Any] = {"w": rows_of(lo, hi)}
    if with_norm:
        bufs["norm"] = torch.full((COLS,), -1.0)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        out["step"] = store.get_into(bufs, step=3, timeout=20)
    except Exception as exc:  # the test asserts which error, and that it came at once
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
        if isinstance(exc, NoLiveSource):
            out["holes"] = [[n, list(o), list(s), list(r)] for n, o, s, r in exc.holes]
    out["seconds"] = time.monotonic() - t0
    out["w_exact"] = torch.equal(bufs["w"].tensor, w_value(3)[lo:hi])
    out["w_untouched"] = bool((bufs["w"].tensor == -1).all())
    if with_norm:
        out["norm_exact"] = torch.equal(bufs["norm"], norm_value(3))
        out["norm_untouched"] = bool((bufs["norm"] == -1).all())
    return out


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == 2, world
    out = Path(os.environ["LP_OUT"])
    rendezvous = Path(os.environ["ASTATE_HOME"]) / "embedded-etcd.json"
    if rank != 0:
        wait_until(rendezvous.exists, 60, message="waited 60 s for rank 0 to start the embedded etcd")
    store = astate_store.connect("live")
    rows = ROWS // world
    for step in (1, 2, 3):
        store.put(
            step,
            {
                "w": Shard(
                    w_value(step)[rank * rows : (rank + 1) * rows].clone(), (rank * rows, 0), (ROWS, COLS)
                ),
                "norm": norm_value(step),
            },
        )
    result: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    if rank == 1:
        wait_until(
            lambda: (out / "watched").exists(),
            60,
            message="waited 60 s for rank 0's watcher to pull while rank 1 is alive",
        )
        store.close()
        (out / "result-1.json").write_text(json.dumps(result))
        return 0

    watcher = astate_store.connect("live", rank=0, world_size=1)
    result["watcher_before"] = attempt(watcher, 0, ROWS, True)  # both ranks alive: everything
    # and its own rows with norm (norm may be read from either rank): a plan cached while rank 1
    # lived must not be reused once it is gone
    result["watcher_own_before"] = attempt(watcher, 0, rows, True)
    (out / "watched").touch()
    wait_until(
        lambda: (out / "result-1.json").exists(), 60, message="waited 60 s for rank 1 to close its store"
    )
    pid1 = int(json.loads((out / "result-1.json").read_text())["pid"])
    wait_until(lambda: exited(pid1), 60, message="waited 60 s for rank 1 to exit")
    result["own"] = attempt(store, 0, rows, True)
    result["watcher_own"] = attempt(watcher, 0, rows, True)
    result["full"] = attempt(store, 0, ROWS, False)
    result["watcher_full"] = attempt(watcher, 0, ROWS, True)
    result["straddle"] = attempt(store, 2, 6, False)
    result["own_again"] = attempt(store, 0, rows, True)  # a failed pull leaves the store usable
    watcher.close()
    store.close()
    (out / "result-0.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

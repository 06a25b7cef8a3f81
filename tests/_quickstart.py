"""The README quick start under torchrun, where the rank that started the embedded etcd exits first.

    torchrun --standalone --nproc-per-node 2 tests/_quickstart.py

Both ranks ``astate_store.connect("quickstart")`` with no etcd given, put their row block of one
tensor for step 1 and pull the whole tensor. Then the rank that started the embedded etcd exits; the
other waits until that process is gone, pulls its block of step 1 again, publishes step 2 on its own
(a new session of one rank), pulls it, and checks every byte.

Environment (set by tests/etcd/test_embedded_etcd.py): ``ASTATE_HOME`` (rendezvous dir), ``QS_OUT``
(where each rank writes ``result-<rank>.json`` and its barrier files), ``QS_STARTER`` (the rank that
connects first, so it is the one that starts the embedded etcd).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import astate_store
from astate_store import Shard
from astate_store.process import exited
from tests.support.waiting import wait_until

ROWS, COLS = 8, 16


def value(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.25 + step


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == 2, world
    out = Path(os.environ["QS_OUT"])
    starter_rank = int(os.environ["QS_STARTER"])
    rendezvous = Path(os.environ["ASTATE_HOME"]) / "embedded-etcd.json"
    assert "ASTATE_ETCD" not in os.environ
    if rank != starter_rank:
        wait_until(rendezvous.exists, 60, message="waited 60 s for the other rank to start the embedded etcd")

    store = astate_store.connect("quickstart")  # the README quick start: no etcd given
    info = json.loads(rendezvous.read_text())
    result: dict[str, object] = {
        "rank": rank,
        "pid": os.getpid(),
        "info": info,
        "starter": info["starter"] == os.getpid(),
        "endpoint": store.catalog.endpoint,
    }
    rows = ROWS // world
    box = (rank * rows, 0)
    store.put(1, {"w": Shard(value(1)[rank * rows : (rank + 1) * rows].clone(), box, (ROWS, COLS))})
    full = torch.zeros(ROWS, COLS)
    result["step1"] = store.get_into({"w": full}, step=1, timeout=30)
    result["step1_exact"] = torch.equal(full, value(1))
    (out / f"pulled-{rank}").touch()
    wait_until(
        lambda: (out / f"pulled-{1 - rank}").exists(),
        60,
        message="waited 60 s for the other rank's pull of step 1",
    )

    if result["starter"]:  # exit first, right after the commit
        (out / f"result-{rank}.json").write_text(json.dumps(result))
        store.close()
        return 0

    wait_until(
        lambda: exited(int(info["starter"])), 60, message="waited 60 s for the rank that started etcd to exit"
    )
    mine = torch.zeros(rows, COLS)
    result["own_step1"] = store.get_into({"w": Shard(mine, box, (ROWS, COLS))}, step=1, timeout=30)
    result["own_step1_exact"] = torch.equal(mine, value(1)[rank * rows : (rank + 1) * rows])
    store.close()
    # Publish on: the group is one rank now (a new session), still on the same embedded etcd.
    with astate_store.connect("quickstart", rank=0, world_size=1, session_id=f"solo-{os.getpid()}") as solo:
        result["solo_endpoint"] = solo.catalog.endpoint
        result["committed2"] = solo.put(2, {"w": value(2)})
        full.zero_()
        result["step2"] = solo.get_into({"w": full}, step=2, timeout=30)
        result["step2_exact"] = torch.equal(full, value(2))
        result["latest"] = solo.latest()
    result["info_after"] = json.loads(rendezvous.read_text())
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``Store.checkpoint`` right after ``put`` on every rank (3 publisher processes, real etcd), the
typed error for a step that cannot commit, and retention through ``Store.checkpoint``."""

from __future__ import annotations

import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from astate_store import checkpoint as ckpt
from astate_store.store import Store
from tests._procs import CTX
from tests._store_workers import SPECS, local_tensors
from tests.checkpoint._lifecycle_workers import rank_main

pytestmark = pytest.mark.timeout(120)

WORLD = 3


class Ranks:
    """``WORLD`` publisher processes of one session, driven by commands."""

    def __init__(self, endpoint: str, ns: str):
        self.out = CTX.Queue()
        self.cmds = [CTX.Queue() for _ in range(WORLD)]
        self.procs = [
            CTX.Process(target=rank_main, args=(endpoint, ns, r, WORLD, self.cmds[r], self.out), daemon=True)
            for r in range(WORLD)
        ]
        for p in self.procs:
            p.start()
        assert sorted(self.out.get(timeout=60)[1] for _ in range(WORLD)) == list(range(WORLD))

    def send(self, ranks: list[int], *cmd: Any) -> dict[int, tuple[Any, ...]]:
        for r in ranks:
            self.cmds[r].put(cmd)
        got = [self.out.get(timeout=90) for _ in ranks]
        return {m[1]: m for m in got}

    def exit(self, r: int) -> None:
        self.cmds[r].put(("exit",))
        assert self.out.get(timeout=30) == ("bye", r)
        self.procs[r].join(30)

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p.is_alive():
                self.cmds[r].put(("exit",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


def _ns() -> str:
    return "ckl-" + uuid.uuid4().hex[:10]


def _assert_restores(uri: str, step: int) -> None:
    bufs = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt, _) in SPECS["mixed"].items()}
    assert ckpt.restore(uri, bufs, step=step) == step
    want = local_tensors("mixed", step, 0, 1)  # one rank: every box is the whole tensor
    for n in SPECS["mixed"]:
        assert torch.equal(bufs[n], want[n].tensor), n


def test_checkpoint_right_after_put_on_every_rank_in_random_order(etcd: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    g = Ranks(etcd.endpoint, _ns())
    rng = random.Random()
    try:
        for step, asynchronous in ((1, False), (2, True)):
            delays = [0.0, 0.4, 0.8]
            rng.shuffle(delays)  # which rank puts last (and whose checkpoint waits) changes run to run
            res = {}
            for r in range(WORLD):
                g.cmds[r].put(
                    ("put_ckpt", step, delays[r], uri, {"asynchronous": asynchronous, "timeout": 30})
                )
            for _ in range(WORLD):
                m = g.out.get(timeout=90)
                res[m[1]] = m
            assert all(m[0] == "ok" for m in res.values()), (delays, res)
            assert any(m[3] is True for m in res.values()), res  # the last part completed it
            assert ckpt.list_checkpoints(uri)[-1] == step
            _assert_restores(uri, step)
    finally:
        g.close()


def test_step_that_cannot_commit_raises_a_typed_error_naming_missing_ranks(etcd: Any, tmp_path: Path) -> None:
    uri, ns = str(tmp_path / "ckpt"), _ns()
    g = Ranks(etcd.endpoint, ns)
    try:
        # Rank 2 never puts step 1: past the timeout, the error names it.
        assert all(m[0] == "ok" for m in g.send([0, 1], "put", 1, 0).values())
        m = g.send([0], "ckpt", 1, uri, {"timeout": 1.0})[0]
        assert m[:5] == ("err", 0, "ckpt", "CheckpointNotCommitted", "timeout") and m[5] == [2], m
        # Step 2 commits: step 1 can never commit now (stale), whatever the timeout.
        assert all(m[0] == "ok" for m in g.send([0, 1, 2], "put", 2, 0).values())
        m = g.send([1], "ckpt", 1, uri, {"timeout": 60})[1]
        assert m[3:6] == ("CheckpointNotCommitted", "stale", [2]), m
        # Rank 2 leaves the session before putting step 3: step 3 can never commit.
        assert all(m[0] == "ok" for m in g.send([0, 1], "put", 3, 0).values())
        g.exit(2)
        m = g.send([0], "ckpt", 3, uri, {"timeout": 60})[0]
        assert m[3:6] == ("CheckpointNotCommitted", "rank_gone", [2]), m
        # A new session (opened by its first put) fences this one.
        with Store(
            ns, endpoint=etcd.endpoint, rank=0, world_size=1, transport="shm", session_id=f"{ns}-new"
        ) as s:
            s.put(4, local_tensors("mixed", 4, 0, 1))
            m = g.send([1], "ckpt", 3, uri, {"timeout": 60, "asynchronous": True})[1]
            assert m[3:6] == ("CheckpointNotCommitted", "fenced", [2]), m
        assert ckpt.list_checkpoints(uri) == []
    finally:
        g.close()


def test_store_checkpoint_retention_removes_from_storage_and_catalog(etcd: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    with Store(_ns(), endpoint=etcd.endpoint, transport="shm") as s:
        for step in range(1, 10):
            s.put(step, local_tensors("mixed", step, 0, 1))
            assert s.checkpoint(step, uri, keep_last=2, keep_every=4) is True
        # the 2 newest, and the oldest of each window of 4 steps: 1 ([0, 4)), 4 ([4, 8)), 8 ([8, 12))
        assert ckpt.list_checkpoints(uri) == [1, 4, 8, 9]
        assert [e.step for e in s.catalog.checkpoints.list()] == [1, 4, 8, 9]
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
            f"step-{n:020d}" for n in (1, 4, 8, 9)
        ]
        _assert_restores(uri, 4)
        # Entries whose checkpoint is gone from storage (removed by hand, lost) are skipped by a
        # restore from the catalog: it takes the newest one still there.
        ckpt.remove_checkpoint(uri, 8)
        shutil.rmtree(tmp_path / "ckpt" / f"step-{9:020d}")
        bufs = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt, _) in SPECS["mixed"].items()}
        assert s.restore(bufs) == 4
        want = local_tensors("mixed", 4, 0, 1)
        assert all(torch.equal(bufs[n], want[n].tensor) for n in SPECS["mixed"])

"""Checkpoint retention: the policy, a restore in progress (another process) pins its step until it
ends or its lease expires, a half-written step another process is writing is never touched, and
``astate checkpoint ls`` / ``rm``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from astate_store import checkpoint as ckpt
from astate_store.errors import CheckpointError, CheckpointInUse, CheckpointNotFound
from tests._checkpoint_workers import SPEC, expected, rank_shards
from tests._procs import CTX
from tests._store_workers import SPECS, local_tensors
from tests.checkpoint._lifecycle_workers import paused_part, paused_restore, restore_oldest_loop
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "schemas" / "checkpoint_manifest.json").read_text()
)


def _write(uri: str, step: int) -> None:
    """A complete one-rank checkpoint of the "mixed" model at ``step``."""
    ckpt.write_part(uri, step, 0, 1, ckpt.local_shards(local_tensors("mixed", step, 0, 1)), fsync=False)
    assert ckpt.try_commit(uri, step, 1, fsync=False)


def test_policy_keeps_last_every_and_the_newest() -> None:
    p = ckpt.RetentionPolicy(keep_last=2, keep_every=100)
    got = ckpt.keep_reasons([50, 100, 150, 200, 250, 300, 350], p)
    assert got == {
        50: "every 100",
        100: "every 100",
        150: "remove",
        200: "every 100",
        250: "remove",
        300: "last 2",
        350: "newest",
    }
    # unaligned steps: the oldest of each window of 100
    assert ckpt.keep_reasons([7, 57, 107, 157], ckpt.RetentionPolicy(1, 100)) == {
        7: "every 100",
        57: "remove",
        107: "every 100",
        157: "newest",
    }
    # steps newer than the checkpoint just completed are someone else's: kept
    assert ckpt.keep_reasons([1, 2, 3], ckpt.RetentionPolicy(1), upto=2) == {
        1: "remove",
        2: "remove",
        3: "newest",
    }
    assert ckpt.keep_reasons([1, 2, 3, 4], ckpt.RetentionPolicy(1), upto=2)[3] == "newer"
    for bad in ((0, None), (1, 0), (True, None), ("2", None)):
        with pytest.raises(CheckpointError):
            ckpt.RetentionPolicy(*bad)
    with pytest.raises(CheckpointError, match="keep_every needs keep_last"):
        ckpt.RetentionPolicy.of(None, 10)
    assert ckpt.RetentionPolicy.of(None, None) is None


def test_newest_incomplete_and_missing_steps_are_never_removed(tmp_path: Path) -> None:
    uri = str(tmp_path / "c")
    for s in (1, 2):
        _write(uri, s)
    with pytest.raises(CheckpointInUse, match="newest"):
        ckpt.remove_checkpoint(uri, 2)
    with pytest.raises(CheckpointNotFound):
        ckpt.remove_checkpoint(uri, 5)
    ckpt.remove_checkpoint(uri, 1)
    assert ckpt.list_checkpoints(uri) == [2] and not (tmp_path / "c" / f"step-{1:020d}").exists()
    res = ckpt.apply_retention(uri, ckpt.RetentionPolicy(1))
    assert res.removed == [] and res.kept == {2: "newest"}


def test_a_tombstoned_step_is_not_restored(tmp_path: Path) -> None:
    uri = str(tmp_path / "c")
    for s in (1, 2):
        _write(uri, s)
    tomb = {"format": ckpt.FORMAT, "kind": "removing", "step": 1, "by": "a test"}
    jsonschema.validate(tomb, {"$defs": SCHEMA["$defs"], "$ref": "#/$defs/removing"})
    (tmp_path / "c" / f"step-{1:020d}" / ckpt.leases.REMOVING_NAME).write_text(json.dumps(tomb))
    bufs = {"norm": torch.zeros(48)}
    with pytest.raises(CheckpointNotFound, match="being removed"):
        ckpt.restore(uri, bufs, step=1)
    assert not list((tmp_path / "c" / f"step-{1:020d}").glob("reader-*"))  # the lease went with it
    # a remover that died after deleting COMMIT left debris: the next pass deletes it
    (tmp_path / "c" / f"step-{1:020d}" / "COMMIT").unlink()
    _write(uri, 3)
    res = ckpt.apply_retention(uri, ckpt.RetentionPolicy(2), upto=3)
    assert res.removed == [1] and not (tmp_path / "c" / f"step-{1:020d}").exists()


def _start_restore(uri: str, step: int, ttl: float) -> tuple[Any, Any, Any, Any]:
    started, go, out = CTX.Event(), CTX.Event(), CTX.Queue()
    p = CTX.Process(target=paused_restore, args=(uri, step, ttl, started, go, out), daemon=True)
    p.start()
    assert started.wait(60)
    return p, go, out, started


def test_retention_under_a_concurrent_restore(tmp_path: Path) -> None:
    uri = str(tmp_path / "c")
    for s in (1, 2, 3):
        _write(uri, s)
    p, go, out, _ = _start_restore(uri, 1, ttl=30.0)
    try:
        assert len(ckpt.live_readers(ckpt.storage.resolve(uri), 1)) == 1
        (lease,) = (tmp_path / "c" / f"step-{1:020d}").glob("reader-*.lease")
        jsonschema.validate(
            json.loads(lease.read_text()), {"$defs": SCHEMA["$defs"], "$ref": "#/$defs/reader_lease"}
        )
        assert ckpt.policy_view(uri, ckpt.RetentionPolicy(1)) == {1: "reading", 2: "remove", 3: "newest"}
        res = ckpt.apply_retention(uri, ckpt.RetentionPolicy(1))
        assert res.removed == [2] and list(res.busy) == [1], res
        with pytest.raises(CheckpointInUse, match="being restored"):
            ckpt.remove_checkpoint(uri, 1)
        assert not (tmp_path / "c" / f"step-{1:020d}" / ckpt.leases.REMOVING_NAME).exists()
        go.set()
        assert out.get(timeout=60) == ("restored", 1, True)  # every byte, though retention ran meanwhile
        p.join(30)
    finally:
        go.set()
        p.join(10)
    assert ckpt.live_readers(ckpt.storage.resolve(uri), 1) == []  # released at the end
    assert ckpt.apply_retention(uri, ckpt.RetentionPolicy(1)).removed == [1]
    assert ckpt.list_checkpoints(uri) == [3]


def test_a_dead_restorer_pins_its_step_only_until_its_lease_expires(tmp_path: Path) -> None:
    uri = str(tmp_path / "c")
    for s in (1, 2):
        _write(uri, s)
    p, go, _out, _ = _start_restore(uri, 1, ttl=1.0)
    p.kill()
    p.join(10)
    assert ckpt.apply_retention(uri, ckpt.RetentionPolicy(1)).busy.keys() == {1}

    def retained() -> bool:
        ckpt.apply_retention(uri, ckpt.RetentionPolicy(1))
        return ckpt.list_checkpoints(uri) == [2]

    wait_until(retained, 30, interval=0.5, message="the dead restorer's lease never expired")
    assert not (tmp_path / "c" / f"step-{1:020d}").exists()


def test_retention_under_a_concurrent_write(tmp_path: Path) -> None:
    """Another process writes step 4 (2 ranks): its rank 0 is paused after its data file, rank 1
    has not written. Retention after step 3 removes old complete steps, never step 4's files; step 4 then
    completes and restores exactly."""
    uri = str(tmp_path / "c")
    for s in (1, 2, 3):
        _write(uri, s)
    parent, child = CTX.Pipe()
    p = CTX.Process(target=paused_part, args=(uri, 4, 2, child), daemon=True)
    p.start()
    try:
        assert parent.recv() == "paused"
        before = sorted(x.name for x in (tmp_path / "c" / f"step-{4:020d}").iterdir())
        res = ckpt.apply_retention(uri, ckpt.RetentionPolicy(1), upto=3)
        assert res.removed == [1, 2] and ckpt.list_checkpoints(uri) == [3]
        with pytest.raises(CheckpointInUse, match="not complete"):
            ckpt.remove_checkpoint(uri, 4)
        assert sorted(x.name for x in (tmp_path / "c" / f"step-{4:020d}").iterdir()) == before
        parent.send("go")
        assert parent.recv() == "written"
        p.join(60)
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)
    ckpt.write_part(uri, 4, 1, 2, rank_shards(4, 1, 2), checksum="crc32", fsync=False)
    assert ckpt.try_commit(uri, 4, 2)
    assert ckpt.list_checkpoints(uri) == [3, 4]
    bufs = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt, _, _) in SPEC.items()}
    assert ckpt.restore(uri, bufs) == 4
    assert all(torch.equal(bufs[n], expected(n, 4)) for n in SPEC)
    assert ckpt.apply_retention(uri, ckpt.RetentionPolicy(1), upto=4).removed == [3]


def _astate(*args: str) -> Any:
    """The ``astate`` command, run in this process (the checkpoint commands need no etcd; a
    subprocess per call would mostly be spent importing torch)."""
    from typer.testing import CliRunner

    from astate_store.cli.app import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"}, catch_exceptions=False)


def test_cli_ls_shows_the_policy_and_rm_follows_its_rules(tmp_path: Path) -> None:
    uri = str(tmp_path / "c")
    for s in (100, 150, 200, 250):
        _write(uri, s)
    r = _astate("checkpoint", "ls", uri, "--keep-last", "2", "--keep-every", "200", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(x["step"], x["retention"], x["readers"]) for x in rows] == [
        (100, "every 200", 0),
        (150, "remove", 0),
        (200, "last 2", 0),
        (250, "newest", 0),
    ]
    r = _astate("checkpoint", "ls", uri, "--keep-last", "1", "--json")  # the table's width is the terminal's
    assert r.exit_code == 0, r.output
    assert [x["retention"] for x in json.loads(r.stdout)] == ["remove", "remove", "remove", "newest"]
    r = _astate("checkpoint", "rm", uri, "250")
    assert r.exit_code == 1 and "CheckpointInUse" in r.stderr and "newest" in r.stderr, r.output
    r = _astate("checkpoint", "rm", uri, "150", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["removed"] == 150, r.output
    assert ckpt.list_checkpoints(uri) == [100, 200, 250]
    bufs = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt, _) in SPECS["mixed"].items()}
    assert ckpt.restore(uri, bufs, step=100) == 100
    assert torch.equal(bufs["emb"], local_tensors("mixed", 100, 0, 1)["emb"].tensor)


def test_restores_racing_retention_are_exact_or_refused(tmp_path: Path) -> None:
    """Another process restores the oldest complete step over and over while this one writes steps
    and applies retention after each: every restore is byte-exact or refused before reading
    (CheckpointNotFound), never torn or failing on a vanished file."""
    uri = str(tmp_path / "c")
    for s in (1, 2):
        _write(uri, s)
    stop, out = CTX.Event(), CTX.Queue()
    p = CTX.Process(target=restore_oldest_loop, args=(uri, stop, out), daemon=True)
    p.start()
    busy = 0
    try:
        for s in range(3, 40):
            _write(uri, s)
            busy += len(ckpt.apply_retention(uri, ckpt.RetentionPolicy(2), upto=s).busy)
        stop.set()
        ok, gone, other = out.get(timeout=60)
    finally:
        stop.set()
        p.join(30)
    assert other == [] and ok > 0, (ok, gone, busy, other)
    assert ckpt.list_checkpoints(uri)[-2:] == [38, 39]
    # (Without the reader lease in restore, this fails with "CheckpointCorrupted: data file ... is missing".)

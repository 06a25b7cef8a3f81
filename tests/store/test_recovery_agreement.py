"""Recovery that agrees: the ranks of a restarted session settle on one step through etcd, or all
raise the same RecoveryError, before any of them republishes. Real etcd, real processes."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import msgpack
import pytest
import torch

from astate_store.catalog import Catalog
from astate_store.errors import RecoveryError, StaleSessionError, StaleStepError
from astate_store.model import codec
from astate_store.recovery.agreement import RecoveryAgreement
from astate_store.store import Store
from tests._procs import CTX
from tests._store_workers import STAGES, consumer_main, stage_names
from tests.model.test_codec import _as_json
from tests.store.test_sync import Group, assert_exact, whole_buffers
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


def _ns() -> str:
    return "agree-" + uuid.uuid4().hex[:10]


def _pad(v: int) -> str:
    return "%020d" % v


def _consumer(etcd: Any, ns: str, names: list[str] | None, *, serve: bool, hold: float) -> tuple[Any, Any]:
    out = CTX.Queue()
    p = CTX.Process(
        target=consumer_main, args=(etcd.endpoint, ns, "shm", None, serve, out, hold, names), daemon=True
    )
    p.start()
    return p, out


def _checkpoint(g: Group, step: int, uri: str) -> None:
    for q in g.cmds:
        q.put(("checkpoint", step, uri))
    done = [g.out.get(timeout=60) for _ in range(g.world)]
    assert all(m[0] == "checkpoint" for m in done) and any(m[2] for m in done), done


def _recover(g: Group, cmds: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Send one recover command per rank (rank 1's first: the ranks race); the replies by rank."""
    for r in reversed(range(g.world)):
        g.cmds[r].put(cmds[r])
    return sorted((g.out.get(timeout=120) for _ in range(g.world)), key=lambda m: m[1])


def _gone(cat: Catalog, epoch: int, timeout: float = 30.0) -> None:
    """Wait (bounded) until every rank of session ``epoch`` has lost its lease (it was killed)."""
    wait_until(
        lambda: not cat.sessions.live_ranks(epoch),
        timeout,
        interval=0.2,
        message=f"ranks of epoch {epoch} still alive after {timeout}s",
    )


def _records(
    cat: Catalog, epoch: int
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[int, dict[str, Any]]]]:
    """The recovery plans (by round) and outcomes (by round, rank) of session ``epoch``, each also
    checked against its schema by jsonschema."""
    pre = cat.client.key("recovery", _pad(epoch)) + "/"
    kvs, _ = cat.client.get_prefix_rev(pre)
    plans: dict[int, dict[str, Any]] = {}
    outcomes: dict[int, dict[int, dict[str, Any]]] = {}
    for value, kv in kvs:
        parts = kv.key.decode()[len(pre) :].split("/")
        kind = "recovery_plan" if parts[1] == "plan" else "recovery_outcome"
        jsonschema.Draft202012Validator(codec.schema_of(kind)).validate(
            _as_json(msgpack.unpackb(value, raw=False))
        )
        rec = codec.decode(kind, value)
        if kind == "recovery_plan":
            plans[int(parts[0])] = rec
        else:
            outcomes.setdefault(int(parts[0]), {})[int(parts[2])] = rec
    return plans, outcomes


def _pieces_of(cat: Catalog, epoch: int) -> list[str]:
    """Keys of pieces session ``epoch`` wrote (of any step)."""
    kvs, _ = cat.client.get_prefix_rev(cat.client.key("versions") + "/")
    return [kv.key.decode() for _v, kv in kvs if f"/pieces/{_pad(epoch)}/" in kv.key.decode()]


def _errors(rec: list[tuple[Any, ...]]) -> str:
    """The one error every rank raised: all ranks failed, all with the same RecoveryError."""
    assert [m[0] for m in rec] == ["error"] * len(rec), rec
    texts = {m[3] for m in rec}
    assert len(texts) == 1, f"ranks raised different errors: {rec}"
    text = texts.pop()
    assert text.startswith("RecoveryError: "), text
    return text


def test_ranks_with_different_views_agree_on_one_step(etcd: Any, tmp_path: Path) -> None:
    """Pipeline stages: a rollout re-serves stage 0's tensors of the newest step (a live source for
    rank 0 only), and rank 1 is pointed at an older checkpoint. Alone, rank 0 would republish step
    2 and rank 1 step 1; together they agree on the newest complete checkpoint, step 2."""
    ns, old_uri, uri = _ns(), str(tmp_path / "old"), str(tmp_path / "ckpt")
    g = Group(etcd.endpoint, ns, 2, 2, "shm", spec=STAGES)
    server = None
    with Catalog(etcd.endpoint, ns) as cat:
        try:
            g.put(1)
            _checkpoint(g, 1, old_uri)
            g.put(2)
            _checkpoint(g, 2, uri)
            old_epoch = cat.sessions.epoch()
            assert old_epoch is not None
            server, sout = _consumer(etcd, ns, stage_names(0, 2), serve=True, hold=120)
            assert sout.get(timeout=60)[:3] == ("got", 2, True)
            g.kill(0)
            g.kill(1)
            _gone(cat, old_epoch)
            g2 = Group(etcd.endpoint, ns, 2, 2, "shm", spec=STAGES)
            try:
                rec = _recover(g2, [("recover", None), ("recover", old_uri)])
                assert [m[:3] for m in rec] == [("recovered", 0, 2), ("recovered", 1, 2)], rec
                assert all(m[3] for m in rec), rec  # bytes exact in both ranks' tensors
                epoch = cat.sessions.epoch()
                assert epoch is not None and epoch > old_epoch
                plans, outcomes = _records(cat, epoch)
                # Round 0: rank 0's plan, the live sources of step 2; only rank 0 could fetch them.
                assert (plans[0]["action"], plans[0]["step"], plans[0]["source"], plans[0]["rank"]) == (
                    "fetch",
                    2,
                    "live",
                    0,
                ), plans
                assert outcomes[0][0]["status"] == "ok" and outcomes[0][0]["step"] == 2, outcomes
                assert outcomes[0][1]["status"] == "failed", outcomes
                assert any(f"'{n}'" in outcomes[0][1]["error"] for n in stage_names(1, 2)), outcomes
                # Round 1: every rank restores the checkpoint rank 0 chose (not rank 1's older one).
                assert (plans[1]["action"], plans[1]["step"], plans[1]["source"], plans[1]["uri"]) == (
                    "fetch",
                    2,
                    "checkpoint",
                    uri,
                ), plans
                assert {r: o["status"] for r, o in outcomes[1].items()} == {0: "ok", 1: "ok"}, outcomes
                assert (plans[2]["action"], plans[2]["step"]) == ("publish", 2) and sorted(plans) == [0, 1, 2]
                # The republished step commits in the new session; consumers read it byte for byte.
                with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
                    bufs = whole_buffers()
                    assert cons.get_into(bufs, step=2, timeout=30) == 2
                    assert_exact(bufs, 2)
                    assert cons.catalog.versions.read_version(2).epoch == epoch
            finally:
                g2.close()
            # The records hung on the session's leases: they left with it.
            assert _records(cat, epoch) == ({}, {})
        finally:
            if server is not None:
                server.kill()
            g.close()


def test_no_common_step_every_rank_raises_the_same_error(etcd: Any) -> None:
    """The newest step has a live source for some tensors only and there is no checkpoint: every
    rank raises the same RecoveryError saying which step, what is missing and what was tried;
    nothing is republished and nobody waits for the timeout."""
    ns = _ns()
    g = Group(etcd.endpoint, ns, 2, 2, "shm")
    server = None
    with Catalog(etcd.endpoint, ns) as cat:
        try:
            g.put(1)
            old_epoch = cat.sessions.epoch()
            assert old_epoch is not None
            server, sout = _consumer(etcd, ns, ["emb", "norm"], serve=True, hold=120)
            assert sout.get(timeout=60)[:3] == ("got", 1, True)
            g.kill(0)
            g.kill(1)
            _gone(cat, old_epoch)
            g2 = Group(etcd.endpoint, ns, 2, 2, "shm")
            try:
                rec = _recover(g2, [("recover", None), ("recover", None)])
                text = _errors(rec)
                assert "newest committed step is 1" in text and "the catalog knows no checkpoint" in text, (
                    text
                )
                # the tensors only the gone ranks held are named, with their boxes and ranks
                assert "rank 0: NoLiveSource" in text and "rank 1: NoLiveSource" in text, text
                assert any(f"'{n}' box" in text for n in ("qkv", "odd", "experts", "step_count")), text
                assert "held by ranks [0, 1]" in text, text
                epoch = cat.sessions.epoch()
                assert epoch is not None
                plans, outcomes = _records(cat, epoch)
                assert [p["action"] for _r, p in sorted(plans.items())] == ["fetch", "fail"], plans
                assert sorted(f["rank"] for f in plans[1]["failures"]) == [0, 1], plans
                assert _pieces_of(cat, epoch) == [] and cat.versions.latest() == 1
            finally:
                g2.close()
        finally:
            if server is not None:
                server.kill()
            g.close()


def test_one_rank_with_a_corrupted_checkpoint_part_fails_them_all(etcd: Any, tmp_path: Path) -> None:
    """No live source; the checkpoint's data file of rank 1's shards is damaged: rank 0 restores
    its shards, rank 1 cannot, and both raise naming rank 1; neither republishes."""
    ns, uri = _ns(), str(tmp_path / "ckpt")
    g = Group(etcd.endpoint, ns, 2, 2, "shm")
    with Catalog(etcd.endpoint, ns) as cat:
        try:
            g.put(1)
            _checkpoint(g, 1, uri)
            old_epoch = cat.sessions.epoch()
            assert old_epoch is not None
            g.kill(0)
            g.kill(1)
            _gone(cat, old_epoch)
            parts = sorted((tmp_path / "ckpt").glob("step-*/rank-00001-*.bin"))
            assert parts, list((tmp_path / "ckpt").rglob("*"))
            for p in parts:
                raw = bytearray(p.read_bytes())
                raw[:64] = bytes(b ^ 0xFF for b in raw[:64])
                p.write_bytes(bytes(raw))
            g2 = Group(etcd.endpoint, ns, 2, 2, "shm")
            try:
                rec = _recover(g2, [("recover", None), ("recover", None)])
                text = _errors(rec)
                assert f"checkpoint step 1 at {uri} failed on rank 1: CheckpointCorrupted" in text, text
                epoch = cat.sessions.epoch()
                assert epoch is not None
                plans, outcomes = _records(cat, epoch)
                assert [(p["action"], p.get("source")) for _r, p in sorted(plans.items())] == [
                    ("fetch", "live"),
                    ("fetch", "checkpoint"),
                    ("fail", None),
                ], plans
                assert outcomes[1][0]["status"] == "ok" and outcomes[1][1]["status"] == "failed", outcomes
                assert [f["rank"] for f in plans[2]["failures"]] == [1], plans
                assert _pieces_of(cat, epoch) == [] and cat.versions.latest() == 1
            finally:
                g2.close()
        finally:
            g.close()


def test_one_rank_whose_buffers_do_not_fit_fails_them_all(etcd: Any) -> None:
    """The old session is fenced but alive (a live source for every rank); rank 1's buffers name
    another global shape: every rank raises naming rank 1, nothing is republished, and consumers
    still read the old session's step."""
    ns = _ns()
    g = Group(etcd.endpoint, ns, 2, 2, "shm")
    with Catalog(etcd.endpoint, ns) as cat:
        try:
            g.put(1)
            g2 = Group(etcd.endpoint, ns, 2, 2, "shm")
            try:
                rec = _recover(g2, [("recover", None), ("recover_misfit", None)])
                text = _errors(rec)
                assert "rank 1: LayoutError" in text and "rank 0:" not in text, text
                epoch = cat.sessions.epoch()
                assert epoch is not None
                plans, outcomes = _records(cat, epoch)
                assert outcomes[0][0]["status"] == "ok" and outcomes[0][1]["status"] == "failed", outcomes
                assert [f["rank"] for f in plans[1]["failures"]] == [1], plans
                assert _pieces_of(cat, epoch) == [] and cat.versions.latest() == 1
                with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
                    bufs = whole_buffers()
                    assert cons.get_into(bufs, timeout=30) == 1
                    assert_exact(bufs, 1)
            finally:
                g2.close()
        finally:
            g.close()


def test_a_rank_that_never_reports_fails_the_others_in_bounded_time(etcd: Any) -> None:
    """Rank 0 of a two-rank session recovers alone: it raises once the timeout passed, naming
    rank 1, instead of republishing or waiting for ever. A rank 1 whose rank 0 never plans gives
    up the same way, and the failure it wrote is what a late rank 0 then gets."""
    ns = _ns()
    w = torch.arange(4096, dtype=torch.float32)
    with Store(ns, endpoint=etcd.endpoint, transport="shm", session_id=f"{ns}-old") as old:
        old.put(1, {"w": w})
        with Store(
            ns, endpoint=etcd.endpoint, rank=0, world_size=2, transport="shm", session_id=f"{ns}-a"
        ) as r0:
            with pytest.raises(RecoveryError, match="rank 1: did not report within 2s") as info:
                r0.recover({"w": torch.zeros(4096)}, timeout=2)
            assert info.value.step == 1 and set(info.value.failures) == {1}
            epoch = r0.catalog.session.epoch
            assert _pieces_of(r0.catalog, epoch) == []
        with Catalog(etcd.endpoint, ns) as c0:
            c0.sessions.open(
                rank=0, world_size=2, session_id=f"{ns}-b"
            )  # a rank 0 that does not recover (yet)
            with Store(
                ns, endpoint=etcd.endpoint, rank=1, world_size=2, transport="shm", session_id=f"{ns}-b"
            ) as r1:
                with pytest.raises(RecoveryError, match="rank 0 wrote no recovery plan for round 0"):
                    r1.recover({"w": torch.zeros(4096)}, timeout=1)
                late = RecoveryAgreement(c0.client, c0.sessions).decide(
                    0, "fetch", "too late", step=1, source="live"
                )
                assert (late.action, late.rank) == ("fail", 1)


def test_agreement_records_once_per_round_skip_bad_records_and_fence(
    catalog_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    c0, c1 = catalog_factory(), catalog_factory()
    s0 = c0.sessions.open(rank=0, world_size=2, session_id="s")
    c1.sessions.open(rank=1, world_size=2, session_id="s")
    a0, a1 = RecoveryAgreement(c0.client, c0.sessions), RecoveryAgreement(c1.client, c1.sessions)
    assert a0.next_round() == 0
    plan = a0.decide(0, "fetch", "newest", step=5, source="live")
    # Create-if-absent: a later writer of the round gets the plan that holds.
    other = a1.decide(0, "fail", "gave up")
    assert (other.action, other.rank, other.step, other.source) == ("fetch", 0, 5, "live") and other == plan
    assert a1.wait_plan(0, time.monotonic() + 5) == plan
    # Undecodable records, and records whose epoch/round/rank disagree with their key, are skipped.
    raw = c0.client.raw
    raw.put(a0.outcome_key(s0.epoch, 0, 1), b"\x00not msgpack")
    raw.put(
        a0.outcome_key(s0.epoch, 0, 0),
        codec.encode(
            "recovery_outcome", {"epoch": s0.epoch, "round": 0, "rank": 1, "status": "ok", "step": 5}
        ),
    )
    raw.put(
        a0.plan_key(s0.epoch, 1),
        codec.encode(
            "recovery_plan",
            {
                "epoch": s0.epoch + 7,
                "round": 1,
                "rank": 0,
                "action": "publish",
                "step": 5,
                "reason": "forged",
                "decided_at": 0.0,
            },
        ),
    )
    with caplog.at_level(logging.WARNING, logger="astate_store.catalog"):
        got, nxt, gone = a0.wait_outcomes(0, 2, time.monotonic() + 0.5)
    assert (got, nxt, gone) == ({}, None, set())
    skipped = [r.getMessage() for r in caplog.records if "skipping recovery record" in r.getMessage()]
    assert len(skipped) == 3, skipped
    assert a1.wait_plan(1, time.monotonic() + 0.3) is None
    # Real outcomes replace them; the round is complete once every rank reported.
    a0.report(0, True, step=5)
    a1.report(0, False, error="PeerUnreachable: gone")
    got, nxt, gone = a0.wait_outcomes(0, 2, time.monotonic() + 5)
    assert {r: (o.ok, o.step, o.error) for r, o in got.items()} == {
        0: (True, 5, ""),
        1: (False, None, "PeerUnreachable: gone"),
    }
    # The forged plan of round 1 is replaced, atomically, by the real one.
    done = a0.decide(1, "fail", "rank 1 failed", step=5, failures={1: "PeerUnreachable: gone"})
    assert a1.wait_plan(1, time.monotonic() + 5) == done and dict(done.failures) == {
        1: "PeerUnreachable: gone"
    }
    assert a0.next_round() == 2  # a later recover call in this session starts afresh
    # A newer session fences this one's plans and outcomes.
    c2 = catalog_factory()
    c2.sessions.open(rank=0, world_size=1, session_id="t")
    with pytest.raises(StaleSessionError):
        a0.decide(2, "fetch", "newest", step=5, source="live")
    with pytest.raises(StaleSessionError):
        a1.report(2, True, step=5)
    # Records are on the session's leases: they vanish with it.
    c0.close()
    c1.close()
    assert c2.client.get_prefix_rev(a0.prefix(s0.epoch))[0] == []


def test_a_checkpoint_older_than_latest_is_restored_not_republished(etcd: Any, tmp_path: Path) -> None:
    """The only copy left is a checkpoint of step 1 while step 2 was committed: recover fills the
    tensors with step 1 and does not republish it (it can never commit again); a put of an old
    step is a clear error, and the trainer goes on from latest + 1."""
    ns, uri = _ns(), str(tmp_path / "ckpt")
    w = torch.arange(64, dtype=torch.float32)
    with Store(ns, endpoint=etcd.endpoint, transport="shm", session_id="first") as pub:
        pub.put(1, {"w": w})
        assert pub.checkpoint(1, uri) is True
        pub.put(2, {"w": w + 1})  # committed, never checkpointed; its only source leaves below
    with Store(ns, endpoint=etcd.endpoint, transport="shm", session_id="second", read_timeout=5) as again:
        back = torch.zeros(64)
        assert again.recover({"w": back}, timeout=30, uri=uri) == 1
        assert torch.equal(back, w)
        assert again.latest() == 2  # nothing older was committed over it
        with pytest.raises(StaleStepError, match="step 1 can never commit: step 2"):
            again.put(1, {"w": back})
        assert again.put(3, {"w": back}) is True
        with Store(ns, endpoint=etcd.endpoint, transport="shm") as cons:
            got = torch.zeros(64)
            assert cons.get_into({"w": got}, timeout=30) == 3
            assert torch.equal(got, w)

"""Recovery agreement: the ranks of a restarted publisher session settle on one step in etcd.

``Store.recover`` runs in rounds; each round has one plan and one outcome per rank, all under the
session's epoch (a later session never reads them) and on leases (they vanish with the session):

    recovery/<epoch>/<round>/plan          recovery_plan: what every rank does this round, on the
                                           writer's lease (rank 0; or a rank that gave up waiting)
    recovery/<epoch>/<round>/ranks/<rank>  recovery_outcome: that rank's result, on its lease

A plan is written once (create-if-absent, fenced on the epoch and the writer's member key), so
every rank acts on the same one: fetch a step from one source, publish the step all ranks
fetched, nothing to do, or fail (every rank raises the plan's reason). Rank 0 decides; any rank
that gives up waiting writes a failure instead, and whichever plan got there first holds.
Records that do not decode, or whose epoch, round or rank disagree with their key, are skipped
and logged once; they never stop the other ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyetcd import transactions as tx

from astate_store.catalog.records import Skips, counter_value, pad20, parse_pad20
from astate_store.catalog.sessions import Sessions
from astate_store.errors import CodecError
from astate_store.etcd.client import EtcdClient
from astate_store.model import codec

__all__ = ["RecoveryAgreement", "RecoveryPlan", "RecoveryOutcome", "ACTIONS", "TERMINAL"]

log = logging.getLogger("astate_store.catalog")

ACTIONS = ("fetch", "publish", "nothing", "fail")
TERMINAL = ("publish", "nothing", "fail")  # a recover call ends on one of these


@dataclass(frozen=True)
class RecoveryPlan:
    """What every rank does in one round. ``fetch``: get ``step`` from ``source`` ("live", or
    "checkpoint" at ``uri``); ``publish``: every rank holds ``step``, put it; ``nothing``: nothing
    was ever committed or checkpointed; ``fail``: raise ``reason`` (``failures``: rank -> why)."""

    epoch: int
    round: int
    rank: int
    action: str
    reason: str
    step: int | None = None
    source: str | None = None
    uri: str | None = None
    failures: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RecoveryOutcome:
    """One rank's result of a ``fetch`` round: ``ok`` with the ``step`` it holds, or ``error``."""

    epoch: int
    round: int
    rank: int
    ok: bool
    step: int | None = None
    error: str = ""


class RecoveryAgreement:
    """The ``recovery/`` records of one namespace, for the session in ``sessions``."""

    def __init__(self, client: EtcdClient, sessions: Sessions):
        self.client, self.sessions = client, sessions
        self.skips = Skips(client.namespace, "recovery")  # counted; logged once per (key, revision)

    # ---- keys -----------------------------------------------------------------------------

    def prefix(self, epoch: int) -> str:
        """Every recovery record of session ``epoch`` is under this prefix."""
        return self.client.key("recovery", pad20(epoch)) + "/"

    def plan_key(self, epoch: int, rnd: int) -> str:
        return self.client.key("recovery", pad20(epoch), pad20(rnd), "plan")

    def outcome_key(self, epoch: int, rnd: int, rank: int) -> str:
        return self.client.key("recovery", pad20(epoch), pad20(rnd), "ranks", pad20(rank))

    # ---- writing --------------------------------------------------------------------------

    def decide(
        self,
        rnd: int,
        action: str,
        reason: str,
        *,
        step: int | None = None,
        source: str | None = None,
        uri: str | None = None,
        failures: Mapping[int, str] | None = None,
    ) -> RecoveryPlan:
        """Write the plan of round ``rnd`` unless one exists; returns the plan that holds (ours,
        or the one another rank wrote first). On this rank's lease, fenced on the session.

        Raises:
            StaleSessionError: a newer session fenced this one, or this rank's lease expired.
            CodecError: a plan that does not match its schema (a bug).
        """
        s = self.sessions.require()
        key = self.plan_key(s.epoch, rnd)
        rec: dict[str, Any] = {
            "epoch": s.epoch,
            "round": rnd,
            "rank": s.rank,
            "action": action,
            "reason": reason,
            "decided_at": time.time(),
        }
        for name, v in (("step", step), ("source", source), ("uri", uri)):
            if v is not None:
                rec[name] = v
        if failures:
            rec["failures"] = [{"rank": r, "error": e} for r, e in sorted(failures.items())]
        value = codec.encode("recovery_plan", rec)
        mine = RecoveryPlan(s.epoch, rnd, s.rank, action, reason, step, source, uri, dict(failures or {}))
        absent: Any = tx.Version(key) == 0
        while True:
            ok, resp = self.client.txn(
                f"recovery plan {rnd}",
                [*self.sessions.fence(), absent],
                [tx.Put(key, value, lease=s.lease_id)],
                [tx.Get(self.client.key("epoch")), tx.Get(key)],
            )
            if ok:
                log.info(
                    "namespace %s: recovery round %d of epoch %d: %s (rank %d)",
                    self.client.namespace,
                    rnd,
                    s.epoch,
                    action,
                    s.rank,
                )
                return mine
            epoch_now = counter_value(self.client.key("epoch"), resp[0][0][0]) if resp[0] else None
            if epoch_now != s.epoch or not resp[1]:
                # Fenced by a newer session, or (the plan being absent) this rank's member key is gone.
                raise self.sessions.fenced_error(f"recovery plan of round {rnd}")
            raw, meta = resp[1][0]
            held = self._plan(key, raw, meta.mod_revision, s.epoch, rnd)
            if held is not None:
                return held
            # An unreadable record occupies the key: replace it, atomically against its revision.
            absent = tx.Mod(key) == meta.mod_revision

    def report(self, rnd: int, ok: bool, *, step: int | None = None, error: str = "") -> None:
        """Write this rank's outcome of round ``rnd`` (on its lease, fenced on the session).

        Raises:
            StaleSessionError: a newer session fenced this one, or this rank's lease expired.
        """
        s = self.sessions.require()
        rec: dict[str, Any] = {
            "epoch": s.epoch,
            "round": rnd,
            "rank": s.rank,
            "status": "ok" if ok else "failed",
        }
        if step is not None:
            rec["step"] = step
        if error:
            rec["error"] = error
        ok_txn, _ = self.client.txn(
            f"recovery outcome {rnd}",
            self.sessions.fence(),
            [
                tx.Put(
                    self.outcome_key(s.epoch, rnd, s.rank),
                    codec.encode("recovery_outcome", rec),
                    lease=s.lease_id,
                )
            ],
        )
        if not ok_txn:
            raise self.sessions.fenced_error(f"recovery outcome of round {rnd}")

    # ---- reading --------------------------------------------------------------------------

    def plans(self) -> dict[int, RecoveryPlan]:
        """The plans of this session by round (bad records skipped)."""
        s = self.sessions.require()
        kvs, _ = self.client.get_prefix_rev(self.prefix(s.epoch))
        return self._parse(s.epoch, kvs)[0]

    def next_round(self) -> int:
        """The first round of a new ``recover`` call in this session: after the last one that ended."""
        done = [r for r, p in self.plans().items() if p.action in TERMINAL]
        return max(done) + 1 if done else 0

    def wait_plan(self, rnd: int, deadline: float) -> RecoveryPlan | None:
        """The plan of round ``rnd``, waiting for it (an etcd watch) until ``deadline``
        (``time.monotonic()``); None when none appeared in time."""
        s = self.sessions.require()
        key = self.plan_key(s.epoch, rnd)
        while True:
            resp = self.client.call("get recovery plan", lambda: self.client.raw.get_response(key))
            if resp.kvs:
                kv = resp.kvs[0]
                plan = self._plan(key, kv.value, kv.mod_revision, s.epoch, rnd)
                if plan is not None:
                    return plan
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # From just after the read: a plan written in between is not missed.
            self.client.wait_change(key, remaining, start_revision=int(resp.header.revision) + 1)

    def wait_outcomes(
        self, rnd: int, world_size: int, deadline: float
    ) -> tuple[dict[int, RecoveryOutcome], RecoveryPlan | None, set[int]]:
        """Wait (an etcd watch on the session's records) until every rank reported round ``rnd``,
        the plan of the next round exists (another rank decided), a rank that was alive during
        the wait left the session (its lease expired), or ``deadline``. Returns (outcomes by
        rank, the next round's plan or None, ranks that left without reporting)."""
        s = self.sessions.require()
        pre = self.prefix(s.epoch)
        seen_alive: set[int] = set()
        while True:
            kvs, rev = self.client.get_prefix_rev(pre)
            plans, outcomes = self._parse(s.epoch, kvs)
            got = outcomes.get(rnd, {})
            nxt = plans.get(rnd + 1)
            alive = self.sessions.live_ranks(s.epoch)
            seen_alive |= alive
            gone = {r for r in seen_alive - alive if r not in got}
            if len(got) >= world_size or nxt is not None or gone:
                return got, nxt, gone
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return got, None, set()
            self.client.wait_change(pre, remaining, prefix=True, start_revision=rev + 1)

    # ---- decoding -------------------------------------------------------------------------

    def _parse(
        self, epoch: int, kvs: Sequence[tuple[bytes, Any]]
    ) -> tuple[dict[int, RecoveryPlan], dict[int, dict[int, RecoveryOutcome]]]:
        pre = self.prefix(epoch)
        plans: dict[int, RecoveryPlan] = {}
        outcomes: dict[int, dict[int, RecoveryOutcome]] = {}
        for value, kv in kvs:
            key = kv.key.decode("utf-8", "replace")
            parts = key[len(pre) :].split("/")
            rnd = parse_pad20(parts[0])
            rank = parse_pad20(parts[2]) if len(parts) == 3 and parts[1] == "ranks" else None
            if rnd is None:
                self._skip(key, kv.mod_revision, "not a recovery key")
                continue
            if parts[1:] == ["plan"]:
                plan = self._plan(key, value, kv.mod_revision, epoch, rnd)
                if plan is not None:
                    plans[rnd] = plan
            elif rank is not None:
                out = self._outcome(key, value, kv.mod_revision, epoch, rnd, rank)
                if out is not None:
                    outcomes.setdefault(rnd, {})[out.rank] = out
            else:
                self._skip(key, kv.mod_revision, "not a recovery key")
        return plans, outcomes

    def _plan(self, key: str, value: bytes, mod_revision: int, epoch: int, rnd: int) -> RecoveryPlan | None:
        try:
            d = codec.decode("recovery_plan", value)
        except CodecError as exc:
            self._skip(key, mod_revision, str(exc))
            return None
        if d["epoch"] != epoch or d["round"] != rnd:
            self._skip(key, mod_revision, f"record of epoch {d['epoch']} round {d['round']} under this key")
            return None
        return RecoveryPlan(
            epoch,
            rnd,
            d["rank"],
            d["action"],
            d["reason"],
            d.get("step"),
            d.get("source"),
            d.get("uri"),
            {f["rank"]: f["error"] for f in d.get("failures", ())},
        )

    def _outcome(
        self, key: str, value: bytes, mod_revision: int, epoch: int, rnd: int, rank: int
    ) -> RecoveryOutcome | None:
        try:
            d = codec.decode("recovery_outcome", value)
        except CodecError as exc:
            self._skip(key, mod_revision, str(exc))
            return None
        if (d["epoch"], d["round"], d["rank"]) != (epoch, rnd, rank):
            self._skip(
                key,
                mod_revision,
                f"record of epoch {d['epoch']} round {d['round']} rank {d['rank']} under this key",
            )
            return None
        return RecoveryOutcome(epoch, rnd, rank, d["status"] == "ok", d.get("step"), d.get("error", ""))

    def _skip(self, key: str, mod_revision: int, why: str) -> None:
        self.skips(key, why, mod_revision)

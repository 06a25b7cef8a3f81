"""Recovery of a restarted publisher session: the ``Store.recover`` role.

A restarted rank finds the newest state its whole group can hold: live sources first
(surviving publishers, replica servers, re-serving consumers), else the newest complete
checkpoint; the ranks agree on it through etcd (``agreement``), fetch it and republish it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from astate_store import checkpoint as ckpt
from astate_store.context import StoreContext
from astate_store.errors import RecoveryError
from astate_store.model.layout import TensorLike
from astate_store.pulls import Pulls
from astate_store.put.publisher import Publisher
from astate_store.recovery.agreement import RecoveryAgreement, RecoveryPlan
from astate_store.recovery.checkpointing import Checkpointing

__all__ = ["Recovery"]

log = logging.getLogger("astate_store")


class Recovery:
    """Session recovery: every rank of a restarted group fills its tensors with one agreed step
    and republishes it.

    Args:
        ctx: the store's context (catalog, namespace, rank).
        publisher: fences the old session (``begin``) and republishes the agreed step.
        pulls: fetches a step from its live sources.
        agreement: the ``recovery/`` records of the namespace (plans and outcomes).
        checkpointing: notes a step fetched from a checkpoint (``Store.meta`` reads it there).
    """

    def __init__(
        self,
        ctx: StoreContext,
        publisher: Publisher,
        pulls: Pulls,
        agreement: RecoveryAgreement,
        checkpointing: Checkpointing,
    ):
        self.ctx, self.publisher, self.pulls = ctx, publisher, pulls
        self.agreement, self.checkpointing = agreement, checkpointing
        self._fetched_meta: bytes | None = None  # this rank's meta of the step recover() fetched

    def recover(self, tensors: Mapping[str, TensorLike], timeout: float, uri: str | None) -> int | None:
        """Fill ``tensors`` with the newest committed state and republish it; see ``Store.recover``.

        Every rank of the restarted group calls it. ``begin`` fences the old session (rank 0
        opens a new epoch; the others join it); then the ranks agree through etcd
        (``recovery.agreement``, docs/protocol.md "Session model") on one step and one source, in rounds:

        1. Rank 0 plans the first round: fetch the newest committed step from its live sources
           (``get_into``: surviving publishers, re-serving consumers); with nothing committed,
           the newest complete checkpoint (at rank 0's ``uri``, else the catalog's); with
           neither, every rank returns None.
        2. Every rank fetches what the plan names and reports ok, or failed and why.
        3. Rank 0 waits for every report (bounded by ``timeout``; a rank whose lease expires
           counts as failed) and plans the next round: all ok -> every rank publishes the step;
           a failed live round -> every rank fetches the newest complete checkpoint, or, with
           none, fails; a failed checkpoint round -> fails.
        4. Publish: every rank ``put``s the agreed step — unless it is a checkpoint older than
           ``latest``, which can never commit again: then the tensors hold it, nothing is
           republished, and the trainer's next step must be > ``latest``. Fail: every rank raises the same
           :class:`RecoveryError` (the step, which ranks failed and why, what was tried), and
           none republishes anything.

        A rank that gives up waiting for a plan writes the failure itself; a plan is written
        once per round, so whichever got there first is what every rank does. A later call in
        the same session starts a fresh round.

        Raises:
            RecoveryError: no step every rank could fetch, or a rank did not report in time.
            StaleSessionError: a newer session fenced this one meanwhile.
        """
        entries = self.publisher.begin(tensors, "recover(tensors)")
        agree = self.agreement
        s = self.ctx.catalog.sessions.require()
        deadline = time.monotonic() + timeout
        rnd = agree.next_round()
        if s.rank == 0:
            plan = self._first_plan(rnd, uri)
        else:
            plan = self._await_plan(rnd, deadline, timeout)
        mine: Exception | None = None  # this rank's own failure in the last fetch round
        while plan.action == "fetch":
            mine = self._fetch(tensors, plan, deadline)
            agree.report(
                plan.round,
                mine is None,
                step=plan.step if mine is None else None,
                error="" if mine is None else _why(mine),
            )
            if s.rank == 0:
                plan = self._next_plan(plan, deadline, timeout, uri)
            else:
                plan = self._await_plan(plan.round + 1, deadline, timeout)
        if plan.action == "nothing":
            log.info("rank %d: nothing to recover (%s)", s.rank, plan.reason)
            return None
        if plan.action == "fail":
            raise RecoveryError(plan.reason, step=plan.step, failures=dict(plan.failures)) from mine
        assert plan.step is not None  # a publish plan names its step
        latest = self.ctx.catalog.versions.latest()
        if latest is not None and plan.step < latest:
            # Steps only move forward: a checkpoint older than the newest commit cannot be
            # committed again. The tensors hold it; the trainer goes on with steps > latest.
            log.warning(
                "rank %d: recovered step %d from a checkpoint older than the newest committed step %d; "
                "not republished (number the next step from %d)",
                s.rank,
                plan.step,
                latest,
                latest + 1,
            )
            return plan.step
        self.publisher.put(plan.step, entries, copy=True, meta=self._fetched_meta)
        return plan.step

    # ---- recovery rounds (helpers of ``recover``) ----------------------------------------

    def _first_plan(self, rnd: int, uri: str | None) -> RecoveryPlan:
        """Rank 0: the newest committed step from live sources, else the newest checkpoint."""
        agree, ns = self.agreement, self.ctx.namespace
        latest = self.ctx.catalog.versions.latest()
        if latest is not None:
            return agree.decide(
                rnd,
                "fetch",
                f"namespace {ns!r}: step {latest} is the newest committed step; "
                "fetching it from its live sources",
                step=latest,
                source="live",
            )
        found, where = self._newest_checkpoint(uri)
        if found is None:
            return agree.decide(rnd, "nothing", f"namespace {ns!r}: nothing was ever committed, and {where}")
        return agree.decide(
            rnd,
            "fetch",
            f"namespace {ns!r}: nothing is committed; the newest complete checkpoint "
            f"is step {found[0]} at {found[1]}",
            step=found[0],
            source="checkpoint",
            uri=found[1],
        )

    def _next_plan(
        self, plan: RecoveryPlan, deadline: float, timeout: float, uri: str | None
    ) -> RecoveryPlan:
        """Rank 0, after a fetch round: once every rank reported, what all of them do next."""
        agree, s, ns = self.agreement, self.ctx.catalog.sessions.require(), self.ctx.namespace
        rnd, what = plan.round + 1, _source_text(plan)
        outcomes, decided, gone = agree.wait_outcomes(plan.round, s.world_size, deadline)
        if decided is not None:
            return decided  # another rank gave up waiting and wrote the plan first
        missing = {
            r: (
                "left the session before reporting (its lease expired)"
                if r in gone
                else f"did not report within {timeout:g}s"
            )
            for r in range(s.world_size)
            if r not in outcomes
        }
        if missing:
            return agree.decide(
                rnd,
                "fail",
                f"namespace {ns!r}: recovery of step {plan.step} (session epoch "
                f"{s.epoch}) from {what} did not finish: {_ranks_text(missing)}",
                step=plan.step,
                failures=missing,
            )
        failed = {r: o.error for r, o in sorted(outcomes.items()) if not o.ok}
        if not failed:
            return agree.decide(
                rnd, "publish", f"every rank holds step {plan.step} from {what}", step=plan.step
            )
        tried = f"{what} failed on {_ranks_text(failed)}"
        if plan.source == "live":
            found, where = self._newest_checkpoint(uri)
            if found is not None:
                return agree.decide(
                    rnd,
                    "fetch",
                    f"namespace {ns!r}: {tried}; fetching the newest complete "
                    f"checkpoint, step {found[0]} at {found[1]}",
                    step=found[0],
                    source="checkpoint",
                    uri=found[1],
                )
            return agree.decide(
                rnd,
                "fail",
                f"namespace {ns!r}: no step can be recovered by every rank of session "
                f"epoch {s.epoch}: the newest committed step is {plan.step}, {tried}, and {where}",
                step=plan.step,
                failures=failed,
            )
        return agree.decide(
            rnd,
            "fail",
            f"namespace {ns!r}: step {plan.step} cannot be recovered by every rank of "
            f"session epoch {s.epoch}: {tried} (before: {plan.reason})",
            step=plan.step,
            failures=failed,
        )

    def _await_plan(self, rnd: int, deadline: float, timeout: float) -> RecoveryPlan:
        """Ranks > 0: the plan of round ``rnd``; past the deadline, this rank writes a failure
        (unless a plan got there first), so that no rank goes on without it."""
        agree, s = self.agreement, self.ctx.catalog.sessions.require()
        plan = agree.wait_plan(rnd, deadline)
        if plan is not None:
            return plan
        why = f"wrote no recovery plan for round {rnd} within {timeout:g}s (rank {s.rank} gave up waiting)"
        return agree.decide(
            rnd,
            "fail",
            f"namespace {self.ctx.namespace!r}: recovery of session epoch {s.epoch} "
            f"did not finish: rank 0 {why}",
            failures={0: why},
        )

    def _fetch(
        self, tensors: Mapping[str, TensorLike], plan: RecoveryPlan, deadline: float
    ) -> Exception | None:
        """Fill the tensors with the plan's step from its source; the error, or None when done."""
        try:
            if plan.source == "live":
                assert plan.step is not None
                got = self.pulls.get_into(tensors, plan.step, max(0.0, deadline - time.monotonic()))
            else:
                got = int(ckpt.restore(str(plan.uri), tensors, step=plan.step))
            if got != plan.step:
                raise RecoveryError(f"fetched step {got} instead of step {plan.step}")
            self._fetched_meta = self._meta_of_fetched(plan)
        except Exception as exc:  # reported to the other ranks; raised (as RecoveryError) by all of them
            log.warning(
                "rank %d: recovery round %d: step %s from %s failed: %s",
                self.ctx.rank,
                plan.round,
                plan.step,
                _source_text(plan),
                _why(exc),
            )
            return exc
        log.info(
            "rank %d: recovery round %d: holds step %d from %s",
            self.ctx.rank,
            plan.round,
            got,
            _source_text(plan),
        )
        return None

    def _meta_of_fetched(self, plan: RecoveryPlan) -> bytes | None:
        """This rank's meta of the fetched step, republished with it (from the same source)."""
        assert plan.step is not None
        if plan.source == "live":
            return self.ctx.catalog.versions.read_meta(plan.step, self.ctx.rank)
        self.checkpointing.restored_from(plan.step, str(plan.uri))
        return ckpt.read_meta(str(plan.uri), plan.step, self.ctx.rank)[1]

    def _newest_checkpoint(self, uri: str | None) -> tuple[tuple[int, str] | None, str]:
        """(step, uri) of the newest complete checkpoint (under ``uri``, else in the catalog), or
        None and a phrase saying where none was found."""
        try:
            if uri is not None:
                steps = ckpt.list_checkpoints(uri)
                return (
                    (steps[-1], str(uri)) if steps else None
                ), f"no complete checkpoint exists under {uri}"
            known = self.ctx.catalog.checkpoints.list()
            return ((known[-1].step, known[-1].uri) if known else None), "the catalog knows no checkpoint"
        except Exception as exc:  # the plan says why instead: the other ranks must not wait for it
            return None, f"looking for checkpoints failed ({_why(exc)})"


_ERROR_CHARS = 600  # of one rank's error in a plan record


def _why(exc: BaseException) -> str:
    """``<type>: <message>`` of a rank's failure, bounded in length."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 3] + "..."


def _ranks_text(why: Mapping[int, str]) -> str:
    return "; ".join(f"rank {r}: {e}" for r, e in sorted(why.items()))


def _source_text(plan: RecoveryPlan) -> str:
    if plan.source == "live":
        return f"live sources of step {plan.step}"
    return f"checkpoint step {plan.step} at {plan.uri}"

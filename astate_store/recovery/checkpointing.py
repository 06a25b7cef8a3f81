"""Checkpoints of a store's shards: one role of a ``Store``, beside ``recovery.Recovery``.

Writing waits for the step to commit, writes this rank's part, records a complete checkpoint in
the catalog and applies retention; restoring fills buffers from a checkpoint and remembers which
one, so :meth:`Checkpointing.meta` reads a restored step's meta from it (the catalog may have
dropped the step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from astate_store import checkpoint as ckpt
from astate_store.catalog import CheckpointEntry
from astate_store.catalog.checkpoints import commit_epoch, pieces_present
from astate_store.catalog.records import Version
from astate_store.checkpoint.storage import resolve as resolve_uri
from astate_store.context import StoreContext
from astate_store.errors import (
    CheckpointError,
    CheckpointNotCommitted,
    CheckpointNotFound,
    VersionNotFound,
    WaitTimeout,
)
from astate_store.model.layout import TensorLike, check_step, group_layouts
from astate_store.model.progress import Progress
from astate_store.put.publisher import Publisher

__all__ = ["Checkpointing"]

log = logging.getLogger("astate_store")


class Checkpointing:
    """Checkpoint and restore of this rank's shards, and the meta of the steps they hold.

    Args:
        ctx: the store's context (catalog, namespace, rank, world size).
        publisher: the store's publisher: a checkpoint writes the shards it still holds.
    """

    def __init__(self, ctx: StoreContext, publisher: Publisher):
        self.ctx, self.publisher = ctx, publisher
        self._async: Any = (
            None  # the background writer (ckpt.AsyncCheckpointer), made at the first asynchronous call
        )
        self._restored: dict[int, str] = {}  # step -> checkpoint uri this store restored it from

    def meta(self, step: int | None, rank: int, uri: str | None) -> bytes | None:
        """The meta bytes ``rank`` put with ``step``: from checkpoint ``uri`` when given, else the
        catalog (the newest committed step by default), else the checkpoint this store restored
        that step from (the catalog may have dropped it); see ``Store.meta``.

        Raises:
            VersionNotFound: no such committed step, and none was restored here.
            CheckpointNotFound / CheckpointCorrupted: from ``uri``.
        """
        if uri is not None:
            return ckpt.read_meta(uri, step, rank)[1]
        if step is None:
            step = self.ctx.catalog.versions.latest()
            if step is None and self._restored:
                step = max(self._restored)
            if step is None:
                raise VersionNotFound(f"namespace {self.ctx.namespace!r}: nothing is committed yet")
        try:
            return self.ctx.catalog.versions.read_meta(step, rank)
        except VersionNotFound:
            if step not in self._restored:
                raise
            return ckpt.read_meta(self._restored[step], step, rank)[1]

    def restored_from(self, step: int, uri: str) -> None:
        """Remember that the buffers were filled with ``step`` from checkpoint ``uri`` (by
        :meth:`restore`, or by ``Recovery.recover`` fetching a checkpoint): :meth:`meta` reads
        that step's meta there once the catalog no longer holds it."""
        self._restored[step] = uri

    def checkpoint(
        self,
        step: int,
        uri: str,
        asynchronous: bool,
        progress: Progress | None = None,
        timeout: float = 60.0,
        keep_last: int | None = None,
        keep_every: int | None = None,
    ) -> Any:
        """Write this rank's shards of ``step`` once it commits; see ``Store.checkpoint``.

        1. Wait (bounded by ``timeout``) for ``step`` to commit: right after ``put`` on a rank
           whose piece was not the last, the other ranks' pieces are still on their way.
        2. This rank's part: its shards, replicas written by the lowest rank holding them
           (synchronously, or snapshotted now and written by the background writer).
        3. ``try_commit``; the rank that completes the checkpoint records it in the catalog
           and, with a policy, applies retention under ``uri`` (older steps only).
        """
        policy = ckpt.RetentionPolicy.of(keep_last, keep_every)  # bad arguments fail before any wait
        cat = self.ctx.catalog
        s = cat.session
        if s is None:
            raise CheckpointError(f"checkpoint of step {step}: this store has no publisher session")
        version = _await_commit(self.ctx, check_step(step, CheckpointError), timeout)
        if version.epoch != s.epoch:
            raise CheckpointError(
                f"step {step} was committed by session epoch {version.epoch}, not by this store's "
                f"session (epoch {s.epoch})"
            )
        # Every rank's boxes from the version's manifests (leaseless): replicas are written once
        # whichever ranks are still alive.
        manifests = cat.versions.manifests_of(version)
        layouts = group_layouts(x for r, m in sorted(manifests.items()) for x in m.records(r))
        shards = ckpt.owned_shards(self.publisher.held(step), layouts, self.ctx.rank)
        world = self.ctx.world_size
        meta = cat.versions.read_meta(step, self.ctx.rank)  # put(meta=...) travels with the part

        def finish() -> bool:
            done = ckpt.try_commit(uri, step, world, attempt=s.session_id)
            if done:
                cat.checkpoints.record(
                    CheckpointEntry(
                        step, str(uri), world, sum(t.nbytes for t in layouts.values()), time.time()
                    )
                )
                if policy is not None:
                    self._retain(uri, step, policy)
            return done

        if not asynchronous:
            ckpt.write_part(
                uri, step, self.ctx.rank, world, shards, attempt=s.session_id, progress=progress, meta=meta
            )
            return finish()
        if self._async is None:
            self._async = ckpt.AsyncCheckpointer()
        part = self._async.save(
            uri, step, self.ctx.rank, world, shards, attempt=s.session_id, progress=progress, meta=meta
        )
        return _then(part, finish)

    def _retain(self, uri: str, step: int, policy: ckpt.RetentionPolicy) -> None:
        """Retention after checkpoint ``step`` completed: remove what ``policy`` does not keep under
        ``uri`` (storage first, then the catalog entries). Never fails the checkpoint: a step that
        could not go (a restore reads it, a storage error) is logged and left to the next pass."""
        who = f"retention of namespace {self.ctx.namespace} rank {self.ctx.rank} after step {step}"
        try:
            res = ckpt.apply_retention(uri, policy, upto=step, by=who)
            if res.removed:
                root = resolve_uri(uri).uri
                self.ctx.catalog.checkpoints.forget(res.removed, lambda u: _same_root(u, root))
                log.info("%s: removed checkpoints %s under %s", who, res.removed, uri)
            for s, why in sorted(res.busy.items()):
                log.info("%s: kept step %d for now: %s", who, s, why)
        except Exception as exc:  # the checkpoint itself is complete; the next one retries
            log.warning("%s under %s failed: %s", who, uri, exc)

    def restore(
        self,
        buffers: Mapping[str, TensorLike],
        uri: str | None,
        step: int | None,
        progress: Progress | None = None,
    ) -> int:
        """Fill buffers from ``uri``, or the newest checkpoint the catalog knows; see ``Store.restore``.

        From the catalog, an entry whose checkpoint is gone from storage (retention elsewhere, a
        hand ``rm``) is skipped for the next newest one, unless ``step`` was asked for."""
        if uri is not None:
            got = int(ckpt.restore(uri, buffers, step=step, progress=progress))
            self.restored_from(got, str(uri))
            return got
        known = [c for c in self.ctx.catalog.checkpoints.list() if step is None or c.step == step]
        if not known:
            raise CheckpointNotFound(
                f"namespace {self.ctx.namespace!r}: the catalog knows no checkpoint"
                + ("" if step is None else f" of step {step}")
            )
        for i, entry in enumerate(reversed(known)):
            try:
                got = int(ckpt.restore(entry.uri, buffers, step=entry.step, progress=progress))
            except CheckpointNotFound as exc:  # raised before any byte is copied
                if i == len(known) - 1:
                    raise
                log.info(
                    "restore: catalog entry step %d at %s: %s; trying an older one",
                    entry.step,
                    entry.uri,
                    exc,
                )
                continue
            self.restored_from(got, str(entry.uri))
            return got
        raise AssertionError("unreachable")  # the loop returns or raises

    def close(self) -> None:
        """Stop the background writer (after the writes it was given)."""
        if self._async is not None:
            self._async.close()


def _await_commit(ctx: StoreContext, step: int, timeout: float) -> Version:
    """The committed version of ``step``, waiting up to ``timeout`` seconds for it to commit.

    While it has not, each round (at most every 0.5 s; the ``latest`` watch wakes it at a commit)
    asks the catalog whether it still can: this session not fenced, no newer step committed, and
    every rank whose piece is missing still a live member (once it was one: a step of this
    session committed).

    Raises:
        CheckpointNotCommitted: it cannot commit, or did not within ``timeout`` (names the ranks
            whose pieces are missing).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise CheckpointError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    cat, ns = ctx.catalog, ctx.namespace
    s = cat.sessions.require()
    deadline = time.monotonic() + timeout
    while True:
        try:
            return cat.versions.read_version(step)
        except VersionNotFound:
            pass
        missing = sorted(set(range(s.world_size)) - pieces_present(cat.client, step, s.epoch))
        what = (
            f"namespace {ns!r}: step {step} is not committed and cannot be checkpointed: pieces of ranks "
            f"{missing} (of {s.world_size}) are missing"
        )
        now_epoch, latest = cat.sessions.epoch(), cat.versions.latest()
        if now_epoch != s.epoch:
            raise CheckpointNotCommitted(
                f"{what}, and session epoch {s.epoch} was fenced by epoch {now_epoch}",
                step=step,
                missing=missing,
                reason="fenced",
            )
        if latest is not None and latest > step:
            raise CheckpointNotCommitted(
                f"{what}, and step {latest} is already committed (steps only move "
                "forward: it can never commit; or it did, and the catalog's version "
                "retention dropped it)",
                step=step,
                missing=missing,
                reason="stale",
            )
        # A rank that is no live member either has not joined yet (sessions open at the first
        # put) or has left; once a step of this epoch committed, every rank had joined.
        gone = sorted(set(missing) - cat.sessions.live_ranks(s.epoch) - {s.rank})
        if gone and latest is not None and commit_epoch(cat.client, latest) == s.epoch:
            raise CheckpointNotCommitted(
                f"{what}, and ranks {gone} left the session (their leases expired)",
                step=step,
                missing=missing,
                reason="rank_gone",
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise CheckpointNotCommitted(
                f"{what} after waiting {timeout:g}s", step=step, missing=missing, reason="timeout"
            )
        try:
            cat.versions.wait_for(step, min(left, 0.5))
        except WaitTimeout:
            pass


def _same_root(a: str, root: str) -> bool:
    """Whether checkpoint uri ``a`` (a catalog entry's) is the root ``root`` (resolved)."""
    try:
        return resolve_uri(a).uri == root
    except CheckpointError:
        return False


def _then(part: Future[Any], finish: Callable[[], bool]) -> Future[bool]:
    """A future of ``finish()`` once ``part`` completed; errors of either reach the caller."""
    done: Future[bool] = Future()

    def chain(f: Future[Any]) -> None:
        try:
            f.result()
            done.set_result(finish())
        except BaseException as exc:  # delivered to the caller through the future
            done.set_exception(exc)

    part.add_done_callback(chain)
    return done

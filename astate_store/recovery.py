"""Checkpoint, restore and recover: the glue between a store and ``astate_store.checkpoint``.

The checkpoint package knows no etcd; this module gives it the shards a rank still holds and
records complete checkpoints in the catalog, and lets a restarted rank find the newest state:
live sources first (surviving replicas, re-serving consumers), else the newest checkpoint.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any, Callable, Mapping

from . import checkpoint as ckpt
from .catalog import CheckpointEntry
from .context import StoreContext
from .errors import CheckpointError, CheckpointNotFound, PeerUnreachable, TornReadError, VersionNotFound, WaitTimeout
from .layout import TensorLike, group_layouts
from .publisher import Publisher

__all__ = ["Recovery"]

log = logging.getLogger("astate_store")

GetInto = Callable[[Mapping[str, TensorLike], int, float], int]


class Recovery:
    """Checkpoints of this rank's shards, restores into any layout, and session recovery."""

    def __init__(self, ctx: StoreContext, publisher: Publisher, get_into: GetInto):
        self.ctx, self.publisher, self._get_into = ctx, publisher, get_into
        self._async: Any = None

    def checkpoint(self, step: int, uri: str, asynchronous: bool) -> Any:
        """Write this rank's shards of committed ``step``; see ``Store.checkpoint``."""
        cat = self.ctx.catalog
        s = cat.session
        version = cat.versions.layouts_of(cat.versions.read_version(step))
        if s is None or version.epoch != s.epoch:
            raise CheckpointError(f"step {step} was not committed by this store's session")
        layouts = group_layouts(x for lay in version.layouts.values() for x in lay.shards)
        shards = ckpt.owned_shards(self.publisher.held(step), layouts, self.ctx.rank)
        world = self.ctx.world_size

        def finish() -> bool:
            done = ckpt.try_commit(uri, step, world, attempt=s.session_id)
            if done:
                cat.checkpoints.record(CheckpointEntry(step, str(uri), world,
                                                       sum(t.nbytes for t in layouts.values()), time.time()))
            return done

        if not asynchronous:
            ckpt.write_part(uri, step, self.ctx.rank, world, shards, attempt=s.session_id)
            return finish()
        if self._async is None:
            self._async = ckpt.AsyncCheckpointer()
        part = self._async.save(uri, step, self.ctx.rank, world, shards, attempt=s.session_id)
        return _then(part, finish)

    def restore(self, buffers: Mapping[str, TensorLike], uri: str | None, step: int | None) -> int:
        """Fill buffers from ``uri``, or the newest checkpoint the catalog knows; see ``Store.restore``."""
        if uri is None:
            known = [c for c in self.ctx.catalog.checkpoints.list() if step is None or c.step == step]
            if not known:
                raise CheckpointNotFound(f"namespace {self.ctx.namespace!r}: the catalog knows no checkpoint"
                                         + ("" if step is None else f" of step {step}"))
            uri, step = known[-1].uri, known[-1].step
        return int(ckpt.restore(uri, buffers, step=step))

    def recover(self, tensors: Mapping[str, TensorLike], timeout: float, uri: str | None) -> int | None:
        """Fill ``tensors`` with the newest committed state and republish it; see ``Store.recover``."""
        entries = self.publisher.begin(tensors, "recover(tensors)")
        rank = self.ctx.rank
        got: int | None = None
        latest = self.ctx.catalog.versions.latest()
        if latest is not None:
            try:
                got = self._get_into(tensors, latest, timeout)
                log.info("rank %d recovered step %d from live sources", rank, got)
            except (PeerUnreachable, VersionNotFound, TornReadError, WaitTimeout) as exc:
                log.warning("rank %d: step %d has no live source (%s); trying checkpoints", rank, latest, exc)
        if got is None:
            try:
                got = self.restore(tensors, uri, None)
                log.info("rank %d recovered step %d from a checkpoint", rank, got)
            except CheckpointNotFound:
                if latest is not None:
                    raise PeerUnreachable(f"namespace {self.ctx.namespace!r}: step {latest} has no live source "
                                          "and no checkpoint exists") from None
                return None
        self.publisher.put(got, entries, copy=True)
        return got

    def close(self) -> None:
        if self._async is not None:
            self._async.close()


def _then(part: "Future[Any]", finish: Callable[[], bool]) -> "Future[bool]":
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

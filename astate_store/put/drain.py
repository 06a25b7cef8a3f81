"""Waiting for consumers to read what this rank put: ``drain`` before the rank exits, and the
wait of a streamed put (published from the caller's tensors) for every consumer to pull it.

Both are used by ``publisher.Publisher``; they read the catalog only and hold no state.
"""

from __future__ import annotations

import logging
import time

from astate_store.context import StoreContext
from astate_store.errors import WaitTimeout

__all__ = ["drain", "wait_pulled"]

log = logging.getLogger("astate_store")


def drain(ctx: StoreContext, step: int | None, timeout: float) -> int:
    """Before this rank exits: wait, bounded by ``timeout``, until every live consumer of the
    namespace has finished reading the newest version this rank put, or has left. Returns
    how many had done neither (0 when this rank never put: ``step`` None).

    1. Wait for the step this rank put last to commit (the other ranks' pieces), or a newer one.
    2. Wait until each consumer with a consumer record — those that have not started that
       read yet included; this store's own consumer left out — has a good read of it on
       record, or its record is gone (closed; or dead, once its lease ends).
    """
    cat = ctx.catalog
    if step is None:
        return 0
    deadline = time.monotonic() + timeout
    try:
        newest = cat.versions.wait_for(step, timeout=timeout)
    except WaitTimeout:
        left = cat.consumers.ids() - {ctx.reader_id}
        log.warning(
            "rank %d: drain: step %d did not commit within %.1fs (other ranks' pieces missing); "
            "%d consumers could not read it",
            ctx.rank,
            step,
            timeout,
            len(left),
        )
        return len(left)
    left = cat.readers.wait_drained(newest, max(0.0, deadline - time.monotonic()), exclude={ctx.reader_id})
    if left:
        log.warning(
            "rank %d: drain: %d consumers had not read step %d within %.1fs: %s",
            ctx.rank,
            len(left),
            newest,
            timeout,
            ", ".join(sorted(left)[:4]) + (", ..." if len(left) > 4 else ""),
        )
    else:
        log.info("rank %d: drained: every live consumer read step %d", ctx.rank, newest)
    return len(left)


def wait_pulled(ctx: StoreContext, step: int, consumers: set[str]) -> None:
    """A streamed put of ``step``, after its piece: wait (bounded by ``retire_timeout``) until
    ``consumers`` have pulled it, then retire it, so the caller may change its tensors."""
    cat, timeout = ctx.catalog, ctx.options.retire_timeout
    late = cat.readers.wait_delivered(step, consumers, timeout=timeout)
    if late:
        log.warning(
            "rank %d: %d consumers did not pull step %d within %.0fs", ctx.rank, len(late), step, timeout
        )
    cat.readers.retire(step, timeout=timeout)
    ctx.stats.streamed_puts += 1

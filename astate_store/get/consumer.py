"""The consuming side of a store: ``get_into``, its torn-read retry loop and its timing.

get_into: catalog (wait for a commit, begin_read: register as a reader and read the version in
one transaction, with which publisher ranks are alive) -> sources (which groups can serve it,
which serves each buffer) -> plan (the byte ranges, cached while layouts and buffers stay the
same) -> transport (one batched get) -> buffers -> step words (``step_words``: the sources'
staging slots unchanged since the commit, read with one more small get) -> catalog (end_read,
in the background when the words told; else it decides: succeeds only if no source retired the
memory meanwhile).

The roles are split by module: this one runs the pulls (the retry loop over versions, failover
over source sets, the transfer and its figures); ``batches`` holds the plans and ready-made
batches; ``links`` the connections to peers and prefaulting; ``sources`` (pure) chooses them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import numpy as np

from astate_store.catalog import Version
from astate_store.context import StoreContext
from astate_store.errors import (
    CatalogCorrupted,
    PeerUnreachable,
    TornReadError,
    TransportError,
    VersionNotFound,
    WaitTimeout,
)
from astate_store.get.batches import Batches, Work, conversion_nbytes
from astate_store.get.conversion import Converter
from astate_store.get.delta import DeltaPulls
from astate_store.get.links import Links
from astate_store.get.sources import PUBLISHERS, SourceGroup
from astate_store.get.step_words import StepWords
from astate_store.metrics import PullTimes
from astate_store.model.layout import GCPaused, TensorLike
from astate_store.model.progress import Progress, ProgressCounter
from astate_store.model.validated import ValidatedTensors
from astate_store.model.validation import Entry

__all__ = ["Consumer", "Work"]

log = logging.getLogger("astate_store")

_MAX_TORN_RETRIES = 8
_PROGRESS_BATCH = 64 << 20  # with a progress callback, the batched reads go in parts of this many bytes
_now = time.perf_counter


class Consumer:
    """One process's pulls: the retry loop over versions and source sets, and its figures; the
    plans and batches live in :class:`~astate_store.get.batches.Batches`, the connections in
    :class:`~astate_store.get.links.Links`."""

    def __init__(self, ctx: StoreContext, converter: Converter):
        self.ctx, self.converter = ctx, converter
        self.buffers = ValidatedTensors("get_into(buffers)")
        self.delivered_step: int | None = None  # the step self.buffers.entries hold
        self.links = Links(ctx)
        self.batches = Batches(ctx, converter, self.links, self.buffers)
        self.delta = DeltaPulls(ctx, self.links, self.batches)  # what the buffers hold; delta pulls
        self.words = StepWords()
        self._last: Work | None = None  # the batch the last good attempt ran
        # (the tries of Batches.tries, those whose sources' processes live): see _live_tries
        self._live: tuple[list[dict[str, SourceGroup]], list[dict[str, SourceGroup]]] | None = None

    def close(self) -> None:
        """Drop the caches that refer to the caller's buffers (entries, batches, plans): a closed
        store is freed by the cycle collector, which may come ~100 stores later, and must not keep
        those buffers alive until then."""
        self.buffers = ValidatedTensors("get_into(buffers)")
        self.delivered_step = None
        self.links = Links(self.ctx)
        self.batches = Batches(self.ctx, self.converter, self.links, self.buffers)
        self.delta = DeltaPulls(self.ctx, self.links, self.batches)
        self._last = None

    def get_into(
        self,
        buffers: Mapping[str, TensorLike],
        step: int | None,
        timeout: float | None,
        progress: Progress | None = None,
        *,
        begun: Version | None = None,
    ) -> int:
        """Pull the newest committed version >= ``step`` into the buffers; see ``Store.get_into``.
        ``begun``: a read the caller began with :meth:`begin` (``Store.get`` lists the tensors
        from it): the first attempt reads that version, without asking for the newest step or
        registering again (a one-shot read is then 4 etcd requests: latest, begin, blobs, end).
        It is ended here whatever happens."""
        try:
            with GCPaused():  # a first pull builds objects per tensor (see ``_read``)
                dests = self.buffers.validate(buffers)
            self.ctx.ensure_transport(dests[0].tensor.device)
        except BaseException:
            if begun is not None:
                self.end(begun.step)
            raise
        if begun is None:
            # Registered before the wait: a publisher draining counts a consumer waiting for its
            # next version. A begun read registered in begin_read's transaction.
            self.ctx.catalog.consumers.ensure_registered(self.ctx.reader_id)
        return self._timed(dests, step, timeout, progress, begun)

    def forget(self, buffers: Mapping[str, TensorLike] | None) -> None:
        """``Store.forget``: the next pull into ``buffers`` (None: the last pull's) is whole. Other
        buffers than the last pull's hold no known step anyway."""
        if buffers is None or self.buffers.validate(buffers) is self.buffers.entries:
            self.delta.forget()

    def begin(self, step: int) -> Version:
        """Register as a reader of committed ``step`` and read it (``Readers.begin_read``, which
        registers this consumer too), for a ``get_into(begun=...)`` of it; :meth:`end` if none
        follows.

        Raises:
            VersionNotFound: not committed, retired or dropped.
        """
        return self.ctx.catalog.readers.begin_read(step, self.ctx.reader_id)

    def end(self, step: int) -> None:
        """End a read begun with :meth:`begin` that no pull follows."""
        self.ctx.catalog.readers.end_read(step, self.ctx.reader_id)

    def _timed(
        self,
        dests: list[Entry],
        step: int | None,
        timeout: float | None,
        progress: Progress | None,
        begun: Version | None,
    ) -> int:
        """The pull, counted once (not per tensor) in the store's figures: outcome, bytes, phases."""
        t, start = PullTimes(progress), _now()
        try:
            s = self._pull_newest(dests, step, timeout, t, begun)
        except BaseException as exc:
            self.ctx.stats.pull_failed(_outcome(exc))
            raise
        work = self._last
        assert work is not None
        if t.counter is not None:
            t.counter.finish()
        seconds = _now() - start
        self.ctx.stats.pulled(t, s, work.nbytes, work.reads, len(work.conversions), seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "namespace %s: pulled step %d: %d bytes in %d reads, %.4fs (wait %.4f, metadata %.4f, "
                "plan %.4f, transfer %.4f, convert %.4f)",
                self.ctx.namespace,
                s,
                work.nbytes,
                work.reads,
                seconds,
                t.wait,
                t.metadata,
                t.plan,
                t.transfer,
                t.convert,
            )
        return s

    def _pull_newest(
        self, dests: list[Entry], step: int | None, timeout: float | None, t: PullTimes, begun: Version | None
    ) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        want, torn = step, 0
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            t0 = _now()
            if begun is not None:
                s = begun.step  # the caller's begun read: no wait, no begin_read
            else:
                s = self.ctx.catalog.versions.wait_for(want, timeout=remaining)
            t.wait += _now() - t0
            self.ctx.stats.saw_step(s)
            got, begun = self._read(s, dests, t, begun), None
            if got:
                self.delivered_step = s
                self.delta.delivered(dests, s)
                return s
            want = s + 1  # retired, dropped or torn: only a newer version can serve
            if got is None:
                continue
            torn += 1
            t.torn += 1
            self.ctx.stats.torn_retries += 1
            log.info(
                "namespace %s: step %d was retired while being read (torn); its bytes are discarded, "
                "retrying on a newer version",
                self.ctx.namespace,
                s,
            )
            if torn > _MAX_TORN_RETRIES:
                raise TornReadError(
                    f"namespace {self.ctx.namespace!r}: step {s} and {torn - 1} newer ones "
                    "were retired while being read; the publisher changes memory faster "
                    "than it can be read"
                )

    def _read(self, step: int, dests: list[Entry], t: PullTimes, begun: Version | None) -> bool | None:
        """One attempt at ``step``: True when the buffers hold it, False when a source retired
        its memory during the read (the bytes are discarded), None when the version was retired
        or dropped before the read could start.

        The cyclic GC is paused for the attempt (not the wait before it): a first pull of 10^4
        tensors builds ~10^5 records, and the collections those allocations set off each walk every
        live object (a cost that grows with the heap, not the pull); a steady pull allocates almost
        nothing."""
        with GCPaused():
            return self._read_once(step, dests, t, begun)

    def _read_once(self, step: int, dests: list[Entry], t: PullTimes, begun: Version | None) -> bool | None:
        readers = self.ctx.catalog.readers
        t0 = _now()
        try:
            version = begun if begun is not None else readers.begin_read(step, self.ctx.reader_id)
        except VersionNotFound:
            t.metadata += _now() - t0
            return None
        try:
            version = self.ctx.catalog.versions.layouts_of(version)
            t.metadata += _now() - t0
            warm = self.delta.held(dests) is not None  # these buffers took the last pull
            if self.ctx.options.delta and warm:
                got = self._delta(version, dests, t)
                if got is not None:
                    return got
            self.delta.forget()  # the buffers are written whole from here: no base until it succeeds
            check = self.delta.verify_rows(version, dests) if self.ctx.options.verify else None
            t1 = _now()
            sources = self._pull(version, dests, t)
            self.delta.pulled_whole(dests, _now() - t1, warm)
        except BaseException:
            readers.end_read(step, self.ctx.reader_id)
            raise
        t0 = _now()
        # The sources' step words tell whether the bytes are untorn without a round trip; the
        # reader then unregisters in the background. Else etcd decides: only the torn markers
        # of the sources actually read from count.
        ok = self.words.check(self.ctx.transport, version, sources, self.ctx.options.read_timeout)
        if ok is None:
            ok = readers.end_read(step, self.ctx.reader_id, sources)
        else:
            readers.end_read_later(step, self.ctx.reader_id, sources)
        t.metadata += _now() - t0
        if ok and check is not None and set(version.pieces) <= sources:
            # the digests were read from the publishers' slots, which the words just proved unchanged
            self.delta.verify(check, dests)  # DeltaMismatch names the tensors
        return ok

    def _delta(self, version: Version, dests: list[Entry], t: PullTimes) -> bool | None:
        """A delta pull of ``version`` (``get/delta.py``): True when the buffers hold it, False
        when N's slot changed under the read (the buffers still hold the older step: retried on
        a newer version), None when it must go whole. Its own step-word check replaced
        ``StepWords.check``; the reader ends in the background either way."""
        t0 = _now()
        out = self.delta.pull(version, dests)
        t.transfer += _now() - t0
        if out.failed:  # a read failed before any byte was applied: the whole pull fails over
            self._afresh()
        if not out.done and not out.torn:
            log.debug("namespace %s: step %d pulled whole: %s", self.ctx.namespace, version.step, out.why)
            return None
        self.ctx.catalog.readers.end_read_later(version.step, self.ctx.reader_id, out.sources)
        if out.done:
            assert out.work is not None
            self._last = out.work
            self.ctx.stats.delta_pulled(out.elements)
            if t.progress is not None:
                _report(t, out.work.nbytes, out.work.nbytes)
        return out.done

    # ---- one pull -------------------------------------------------------------------------

    def _pull(self, version: Version, dests: list[Entry], t: PullTimes) -> frozenset[object]:
        """Read every buffer from one set of sources; a source may have died without its lease
        expiring yet, so a failed read falls back to the other sets before it raises. Returns
        the sources read from."""
        t0 = _now()
        self._warm(version, dests)
        if not version.missing and not version.replica_layouts:
            # The publishers are the only source: a ready-made batch, or one planned from their
            # layouts' columns, needs no source groups (merging every rank's records is
            # Python work per shard).
            t.plan += _now() - t0
            try:
                return self._pull_from(version, None, None, dests, t)
            except TransportError:
                self._afresh()
                raise
        groups = self.batches.groups(version)
        tries = self._live_tries(self.batches.tries(version, groups, dests), groups)
        t.plan += _now() - t0  # choosing and connecting sources counts with planning
        for i, gs in enumerate(tries):
            try:
                return self._pull_from(version, gs, groups, dests, t)
            except TransportError as exc:
                self._afresh()
                if i == len(tries) - 1:
                    raise
                t.failovers += 1
                self.ctx.stats.failovers += 1
                log.warning(
                    "namespace %s: step %d: reading from %s failed (%s); failing over to %s",
                    self.ctx.namespace,
                    version.step,
                    "+".join(sorted(gs)),
                    exc,
                    "+".join(sorted(tries[i + 1])),
                )
        raise AssertionError("failover_order gives at least one set")  # pragma: no cover

    def _live_tries(
        self, tries: list[dict[str, SourceGroup]], groups: Mapping[str, SourceGroup]
    ) -> list[dict[str, SourceGroup]]:
        """``tries`` without the sets holding a source whose process has exited (a writer killed
        on this host, its lease not expired yet): no plan, connect and failover for it. All of
        them when every set holds one: the pull then fails as before, naming the source."""
        if len(tries) < 2:
            return tries
        if self._live is None or self._live[0] is not tries:
            # Once per set of tries (``Batches.tries`` keeps one list per sources and buffers) and
            # again after a failed read: a steady pull asks no process about its sources.
            gone = self.links.exited(groups)
            live = [gs for gs in tries if gone.isdisjoint(gs)] if gone else tries
            self._live = (tries, live or tries)
        return self._live[1]

    def _afresh(self) -> None:
        """After a failed read: its endpoints may be closed, so connect and plan afresh next time
        (and ask again which sources' processes have exited)."""
        self._live = None
        self.links.forget()
        self.batches.clear()

    def _warm(self, version: Version, dests: list[Entry]) -> None:
        """Before planning a pull from the publishers, map the pages it will read (``Links.warm``).
        Only for a batch not built yet (new layouts, buffers or slots): a ready-made one read
        these pages before. With re-serving groups or gone ranks, sources are chosen per buffer:
        nothing to guess ahead."""
        if (
            version.missing
            or version.replica_layouts
            or not self.batches.host_buffers(dests)
            or self.batches.ready(self.batches.key(version, (PUBLISHERS,)))
        ):
            return
        self.links.warm(version, self.batches.wanted, self.buffers.fingerprint)

    def _pull_from(
        self,
        version: Version,
        groups: Mapping[str, SourceGroup] | None,
        every: Mapping[str, SourceGroup] | None,
        dests: list[Entry],
        t: PullTimes,
    ) -> frozenset[object]:
        """One pull from ``groups``, a set of the version's source groups ``every`` (both None:
        the version's publishers, its only source, whose groups are never merged)."""
        t0 = _now()
        work, built = self.batches.lookup(version, groups, dests)
        t1 = _now()
        t.plan += t1 - t0
        done = self._transfer(work, t)
        t2 = _now()
        t.transfer += t2 - t1
        for conv in work.conversions:
            self.converter.run(conv)
            if t.progress is not None:
                done += conversion_nbytes(conv)
                _report(t, done, work.nbytes)
        t3 = _now()
        t.convert += t3 - t2
        if self.links.disconnect_departed(version, every):
            self.batches.clear()  # ready-made batches may name the departed peers' indices
        if (
            built
            and (groups is None or PUBLISHERS in groups)
            and not version.replica_layouts
            and self.batches.host_buffers(dests)
        ):
            self.links.prefault_ahead(version, work.ops)
        t.plan += _now() - t3  # connection upkeep counts with planning
        self._last = work
        return work.sources

    def _transfer(self, work: Work, t: PullTimes) -> int:
        """Every same-dtype read in one batched call; with a progress callback, in parts of
        ``_PROGRESS_BATCH`` bytes, reporting after each. Returns the bytes read."""
        ops, tr, timeout = work.ops, self.ctx.transport, self.ctx.options.read_timeout
        if t.progress is None:
            if len(ops):
                tr.get(ops, timeout=timeout)
            return 0
        _report(t, 0, work.nbytes)
        done = 0
        for part in _parts(ops, _PROGRESS_BATCH):
            tr.get(part, timeout=timeout)
            done += int(part[:, 4].sum())
            _report(t, done, work.nbytes)
        return done


def _report(t: PullTimes, done: int, total: int) -> None:
    """Bytes done in this attempt, to the pull's progress callback: first ``(0, total)``; an
    attempt retried after a torn read counts only past what the torn one reached (``done``
    never goes down; see ``progress``)."""
    if t.counter is None:
        t.counter = ProgressCounter(t.progress, total)
    t.counter.add(done - t.counter.done)


def _parts(ops: np.ndarray, nbytes: int) -> list[np.ndarray]:
    """The rows cut into consecutive parts of about ``nbytes`` each (a larger row is a part alone)."""
    if not len(ops):
        return []
    ends = np.cumsum(ops[:, 4])
    cuts = np.unique(np.searchsorted(ends, np.arange(nbytes, int(ends[-1]), nbytes), side="right"))
    return [p for p in np.split(ops, cuts) if len(p)]


def _outcome(exc: BaseException) -> str:
    """A failed pull's ``outcome`` label (astate_pulls_total)."""
    if isinstance(exc, WaitTimeout):
        return "timeout"
    if isinstance(exc, TornReadError):
        return "torn"
    if isinstance(exc, (PeerUnreachable, TransportError)):
        return "unreachable"
    if isinstance(exc, CatalogCorrupted):
        return "corrupted"
    return "error"

"""The consuming side of a store: ``get_into``.

get_into: catalog (wait for a commit, begin_read: register as a reader and read the version in
one transaction) -> sources (which groups can serve it, which serves each buffer) -> plan (the
byte ranges, cached while layouts and buffers stay the same) -> transport (one batched get)
-> buffers -> catalog (end_read: succeeds only if no source retired the memory meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from operator import attrgetter, eq
from dataclasses import replace
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from astate_store.model import codec
from astate_store import plan as planner
from astate_store.catalog import Version
from astate_store.context import StoreContext
from astate_store.get.conversion import Conversion, Converter
from astate_store.errors import (
    CatalogCorrupted,
    PeerUnreachable,
    TornReadError,
    TransportError,
    VersionNotFound,
    WaitTimeout,
)
from astate_store.metrics import PullTimes
from astate_store.model.progress import Progress, ProgressCounter
from astate_store.model.layout import DTYPE_CODES, Box, Entry, GCPaused, ShardRecord, TensorLike
from astate_store.plan.columns import whole_buffer_reads
from astate_store.plan.prepack import consumer_requests
from astate_store.model.validated import ValidatedTensors
from astate_store.get.sources import (
    PUBLISHERS,
    SourceGroup,
    Wanted,
    assign,
    bases,
    byte_spans,
    converted_layout,
    dest_records,
    failover_order,
    publisher_peer,
    read_spans,
    source_groups,
    to_transport_ops,
)

__all__ = ["Consumer"]

log = logging.getLogger("astate_store")

_MAX_TORN_RETRIES = 8
_CACHE = 8  # source-group sets and ready-made batches kept (consumers and re-servers come and go)
_KEEP_PEERS = 4  # pulls a peer stays connected after its last appearance in a version's sources

_PROGRESS_BATCH = 64 << 20  # with a progress callback, the batched reads go in parts of this many bytes
_now = time.perf_counter


class Work(NamedTuple):
    """A ready-made pull: the batched ops, the local conversions, the sources the ops read from
    (publisher ranks, or ``r-<member>`` of re-serving consumers: the torn markers end_read
    checks), and its size — computed once, so a steady pull does no per-tensor accounting."""

    ops: np.ndarray
    conversions: list[Conversion]
    sources: frozenset[object]
    nbytes: int  # over the transport: same-dtype reads plus the conversions' staged reads
    reads: int  # transport read operations


class Consumer:
    """One process's pulls: caches of source groups, connections and ready-made batches."""

    def __init__(self, ctx: StoreContext, converter: Converter):
        self.ctx, self.converter = ctx, converter
        self.buffers = ValidatedTensors("get_into(buffers)")
        self.delivered_step: int | None = None  # the step self.buffers.entries hold
        self._planner = planner.Planner()
        self._connected: dict[Any, str] = {}  # peer -> layout id its rkeys come from
        self._groups_cache: OrderedDict[object, dict[str, SourceGroup]] = OrderedDict()
        self._ops_cache: OrderedDict[object, Work] = OrderedDict()
        self._pack_key: object = None
        self._registered = False
        self._last: Work | None = None  # the batch the last good attempt ran
        self._spans: dict[object, list[tuple[int, int, int]]] = {}  # (layout id, buffers) -> byte spans
        self._wanted: tuple[object, Wanted, bool] = (None, {}, False)  # buffers: (box, dtype) per name, all host
        self._whole: tuple[object, bool] = (None, False)  # buffers: all whole contiguous host tensors

    def close(self) -> None:
        """Drop the caches that refer to the caller's buffers (entries, batches, plans): a closed
        store is freed by the cycle collector, which may come ~100 stores later, and must not keep
        those buffers alive until then."""
        self.buffers = ValidatedTensors("get_into(buffers)")
        self.delivered_step = None
        self._planner = planner.Planner()
        self._connected.clear()
        self._groups_cache.clear()
        self._ops_cache.clear()
        self._pack_key, self._last, self._wanted, self._whole = None, None, (None, {}, False), (None, False)
        self._spans.clear()

    def get_into(self, buffers: Mapping[str, TensorLike], step: int | None, timeout: float | None,
                 progress: Progress | None = None) -> int:
        """Pull the newest committed version >= ``step`` into the buffers; see ``Store.get_into``."""
        with GCPaused():  # a first pull builds objects per tensor (see ``_read``)
            dests = self.buffers.validate(buffers)
        self.ctx.ensure_transport(dests[0].tensor.device)
        self._register()
        return self._timed(dests, step, timeout, progress)

    def _timed(self, dests: list[Entry], step: int | None, timeout: float | None, progress: Progress | None) -> int:
        """The pull, counted once (not per tensor) in the store's figures: outcome, bytes, phases."""
        t, start = PullTimes(progress), _now()
        try:
            s = self._pull_newest(dests, step, timeout, t)
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
            log.debug("namespace %s: pulled step %d: %d bytes in %d reads, %.4fs (wait %.4f, metadata %.4f, "
                      "plan %.4f, transfer %.4f, convert %.4f)", self.ctx.namespace, s, work.nbytes, work.reads,
                      seconds, t.wait, t.metadata, t.plan, t.transfer, t.convert)
        return s

    def _pull_newest(self, dests: list[Entry], step: int | None, timeout: float | None, t: PullTimes) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        want, torn = step, 0
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            t0 = _now()
            s = self.ctx.catalog.versions.wait_for(want, timeout=remaining)
            t.wait += _now() - t0
            self.ctx.stats.saw_step(s)
            got = self._read(s, dests, t)
            if got:
                self.delivered_step = s
                return s
            want = s + 1  # retired, dropped or torn: only a newer version can serve
            if got is None:
                continue
            torn += 1
            t.torn += 1
            self.ctx.stats.torn_retries += 1
            log.info("namespace %s: step %d was retired while being read (torn); its bytes are discarded, "
                     "retrying on a newer version", self.ctx.namespace, s)
            if torn > _MAX_TORN_RETRIES:
                raise TornReadError(f"namespace {self.ctx.namespace!r}: step {s} and {torn - 1} newer ones "
                                    "were retired while being read; the publisher changes memory faster "
                                    "than it can be read")

    def _register(self) -> None:
        """Register as a consumer (publishers that stream oversized snapshots wait for known
        consumers), and register again — with the pre-pack requests last sent — when the reader
        lease the record hung on was lost and re-created (the record went with the old lease).
        A steady call makes no etcd request."""
        self.ctx.catalog.consumers.ensure_registered(self.ctx.reader_id)
        self._registered = True

    def _read(self, step: int, dests: list[Entry], t: PullTimes) -> bool | None:
        """One attempt at ``step``: True when the buffers hold it, False when a source retired
        its memory during the read (the bytes are discarded), None when the version was retired
        or dropped before the read could start.

        The cyclic GC is paused for the attempt (not the wait before it): a first pull of 10^4
        tensors builds ~10^5 records, and the collections those allocations set off each walk
        every live object (~0.1 s of a 0.7 s first step); a steady pull allocates almost nothing."""
        with GCPaused():
            return self._read_once(step, dests, t)

    def _read_once(self, step: int, dests: list[Entry], t: PullTimes) -> bool | None:
        readers = self.ctx.catalog.readers
        t0 = _now()
        try:
            version = readers.begin_read(step, self.ctx.reader_id)
        except VersionNotFound:
            t.metadata += _now() - t0
            return None
        try:
            version = self.ctx.catalog.versions.layouts_of(version)
            t.metadata += _now() - t0
            sources = self._pull(version, dests, t)
        except BaseException:
            readers.end_read(step, self.ctx.reader_id)
            raise
        # Only the torn markers of the sources actually read from count.
        t0 = _now()
        ok = readers.end_read(step, self.ctx.reader_id, sources)
        t.metadata += _now() - t0
        return ok

    # ---- one pull -------------------------------------------------------------------------

    def _groups(self, version: Version) -> dict[str, SourceGroup]:
        key = (version.layout_key, version.missing)
        hit = self._groups_cache.get(key)
        if hit is None:
            hit = self._groups_cache[key] = source_groups(version)
            while len(self._groups_cache) > _CACHE:
                self._groups_cache.popitem(last=False)
        else:
            self._groups_cache.move_to_end(key)
        return hit

    def _pull(self, version: Version, dests: list[Entry], t: PullTimes) -> frozenset[object]:
        """Read every buffer from one set of sources; a source may have died without its lease
        expiring yet, so a failed read falls back to the other sets before it raises. Returns
        the sources read from."""
        t0 = _now()
        self._warm(version, dests)
        if not version.missing and not version.replica_layouts:
            # The publishers are the only source: a ready-made batch, or one planned from their
            # layouts' columns, needs no source groups (10^4 tensors merged: ~0.2 s).
            t.plan += _now() - t0
            try:
                return self._pull_from(version, None, dests, t)
            except TransportError:
                self._connected.clear()  # endpoints of a failed read may be closed: afresh next time
                self._ops_cache.clear()
                raise
        groups = self._groups(version)
        t.plan += _now() - t0  # choosing and connecting sources counts with planning
        if not groups:
            raise PeerUnreachable(
                f"namespace {self.ctx.namespace!r}: step {version.step}: publisher ranks {sorted(version.missing)} "
                "are gone (their leases expired) and no consumer re-serves the version")
        tries = failover_order(groups, dests)
        for i, gs in enumerate(tries):
            try:
                return self._pull_from(version, gs, dests, t)
            except TransportError as exc:
                # Endpoints of a failed read may be closed: connect and plan afresh next time.
                self._connected.clear()
                self._ops_cache.clear()
                if i == len(tries) - 1:
                    raise
                t.failovers += 1
                self.ctx.stats.failovers += 1
                log.warning("namespace %s: step %d: reading from %s failed (%s); failing over to %s",
                            self.ctx.namespace, version.step, "+".join(sorted(gs)), exc,
                            "+".join(sorted(tries[i + 1])))

    def _warm(self, version: Version, dests: list[Entry]) -> None:
        """Before planning a pull from the publishers: connect them and tell the transport which
        of their bytes the buffers' tensors occupy, so that a mapped same-host source has the
        kernel map those pages on another core while this thread plans (~0.1 s per GiB, about
        a third of a first pull). A hint: a failure here is left to the pull, which connects
        and reports it itself. Only for a batch not built yet (new layouts, buffers or slots):
        a ready-made one read these pages before."""
        if version.missing or version.replica_layouts or not self._host_buffers(dests) or \
                self._batch_key(version, (PUBLISHERS,)) in self._ops_cache:
            return  # with re-serving groups, sources are chosen per buffer: nothing to guess ahead
        for r, lay in version.layouts.items():
            peer = publisher_peer(r, lay)
            if not self._connect_peer(peer, lay, report=False):
                continue
            key = (lay.layout_id, self.buffers.fingerprint)
            spans = self._spans.get(key)
            if spans is None:
                if len(self._spans) >= 4 * _CACHE:
                    self._spans.clear()
                # pre-packed copies too: a plan reads those instead of the strided shards
                spans = self._spans[key] = byte_spans(lay.shards, lay.packed, self._wanted[1], lay.columns)
            self.ctx.transport.prefault(peer, _shifted(spans, version.pieces[r].base_offset))

    def _prefault_ahead(self, version: Version, work: Work) -> None:
        """After the first good pull of a new batch: the byte ranges it read from each
        publisher's slot, in that publisher's other staging slots (its piece lists them), mapped
        in the background before a step first reads them — a slot's first read otherwise waits
        for that with nothing left to overlap (the plan is cached by then)."""
        spans, tr = read_spans(work.ops), self.ctx.transport
        for r, lay in version.layouts.items():
            piece, peer = version.pieces[r], publisher_peer(r, lay)
            if len(piece.slot_bases) < 2 or self._connected.get(peer) != lay.layout_id:
                continue
            try:
                index, base = tr.peer_index(peer), piece.base_offset
            except KeyError:  # dropped meanwhile: a hint is not worth failing a good pull over
                continue
            mine = [(region, lo - base, hi - base) for region, lo, hi in spans.get(index, ()) if lo >= base]
            for b in piece.slot_bases:
                if b != base and mine:
                    tr.prefault(peer, _shifted(mine, b))

    def _host_buffers(self, dests: list[Entry]) -> bool:
        """Whether every buffer is host memory (rows into device memory never read a mapping:
        prefaulting one for them would be wasted); caches each tensor name's boxes too."""
        fp = self.buffers.fingerprint
        if self._wanted[0] is not fp:
            wanted: dict[str, list[tuple[Box, str]]] = {}
            for e in dests:
                for n in (e.name, *e.aliases):
                    wanted.setdefault(n, []).append((e.box, e.dtype))
            self._wanted = (fp, wanted, all(e.tensor.is_cpu for e in dests))
        return self._wanted[2]

    def _batch_key(self, version: Version, gids: tuple[str, ...]) -> tuple[object, ...]:
        """What a ready-made batch is cached under: sources, buffers and this step's slots."""
        slots = tuple(p.base_offset for _r, p in sorted(version.pieces.items()))
        return (version.layout_key, version.missing, gids, self.buffers.fingerprint, slots)

    def _pull_from(self, version: Version, groups: Mapping[str, SourceGroup] | None, dests: list[Entry],
                   t: PullTimes) -> frozenset[object]:
        """One pull from ``groups`` (None: the version's publishers, its only source)."""
        t0 = _now()
        # Steady state: same sources, same buffers, same staging slots -> the ready-made batch.
        key = self._batch_key(version, (PUBLISHERS,) if groups is None else tuple(sorted(groups)))
        work = self._ops_cache.get(key)
        built = work is None
        if built:
            work = self._rebased(version, key)
            if work is None:
                work = self._build_columns(version, dests) if groups is None else None
                if work is None:
                    work = self._build_pull(version, self._groups(version) if groups is None else groups, dests)
            else:
                built = False  # its first build hinted every slot ahead
            self._ops_cache[key] = work
            while len(self._ops_cache) > _CACHE:
                self._ops_cache.popitem(last=False)
        else:
            self._ops_cache.move_to_end(key)
            self.ctx.stats.plan_hits += 1
        t1 = _now()
        t.plan += t1 - t0
        done = self._transfer(work, t)
        t2 = _now()
        t.transfer += t2 - t1
        for conv in work.conversions:
            self.converter.run(conv)
            if t.progress is not None:
                done += _nbytes(conv)
                _report(t, done, work.nbytes)
        t3 = _now()
        t.convert += t3 - t2
        self._disconnect_departed(version)
        if built and (groups is None or PUBLISHERS in groups) and not version.replica_layouts and \
                self._host_buffers(dests):
            self._prefault_ahead(version, work)
        t.plan += _now() - t3  # connection upkeep counts with planning
        self._last = work
        return work.sources

    def _rebased(self, version: Version, key: tuple[object, ...]) -> Work | None:
        """The ready-made batch of the same sources and buffers in other staging slots, if one
        is cached: each publisher's rows moved by the distance between its two slots (the same
        layout, so every offset inside a slot is the same; the transport still checks each row).
        A 10^4-tensor model's first read of its second slot otherwise re-planned (~0.2 s).
        None when there is no such batch, or it converts locally (its chunks hold offsets too)."""
        stem, slots = key[:-1], key[-1]
        old = next(((k, w) for k, w in reversed(self._ops_cache.items())
                    if k[:-1] == stem and not w.conversions), None)
        if old is None or not len(old[1].ops) or len(old[0][-1]) != len(slots):  # type: ignore[arg-type]
            return None
        ops = old[1].ops.copy()
        shift = np.zeros(int(ops[:, 0].max()) + 1, dtype=np.int64)
        for r, was, now in zip(sorted(version.pieces), old[0][-1], slots):  # type: ignore[call-overload]
            lay = version.layouts.get(r)
            if was != now and lay is not None:
                try:
                    i = self.ctx.transport.peer_index(publisher_peer(r, lay))
                except KeyError:  # not connected (dropped meanwhile): plan afresh
                    return None
                if i < len(shift):
                    shift[i] = now - was
        ops[:, 2] += shift[ops[:, 0]]
        self.ctx.stats.plan_hits += 1
        return old[1]._replace(ops=ops)

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

    def _disconnect_departed(self, version: Version) -> None:
        """After a good pull: close the endpoints (rkeys, pidfds) of peers that no source group
        of the last ``_KEEP_PEERS`` pulled versions names (publishers that left or restarted,
        withdrawn re-servers), so connections and ``_connected`` stay bounded. A steady state
        (the same sources pull after pull) costs one comparison."""
        key = (version.layout_key, version.missing)
        st = self.__dict__.get("_departed")
        if st is None:  # [sources key, pulls with it in a row, peers of the last pulls]
            st = self.__dict__["_departed"] = [None, 0, deque(maxlen=_KEEP_PEERS)]
        if st[0] == key:
            st[1] += 1
            if st[1] > _KEEP_PEERS:
                return  # every peer that left was disconnected when the window filled
            peers = st[2][-1]
        else:
            peers = frozenset(publisher_peer(r, lay) for r, lay in version.layouts.items()) \
                if not version.missing and not version.replica_layouts else \
                frozenset(peer for g in self._groups(version).values() for peer, _r, _l in g.sources.values())
            st[0], st[1] = key, 1
        st[2].append(peers)
        live = frozenset().union(*st[2])
        tr = self.ctx.transport
        gone = [p for p in tr.peers if p not in live]
        for p in gone:
            try:
                tr.disconnect(p)
            except Exception as exc:  # the pull succeeded: a failed close must not undo it
                log.warning("disconnecting departed peer %s failed: %s", p, exc)
        for p in [p for p in self._connected if p not in live]:
            del self._connected[p]
        if gone:
            self._ops_cache.clear()  # ready-made batches may name the departed peers' indices
            log.info("step %d: disconnected %d peers no recent version lists (%s)", version.step, len(gone),
                     ", ".join(map(str, gone[:4])) + (", ..." if len(gone) > 4 else ""))

    def _build_pull(self, version: Version, groups: Mapping[str, SourceGroup], dests: list[Entry]) -> Work:
        """Plan every buffer against its source group: same-dtype reads into one batch; other
        dtypes from publisher-converted copies when they exist, else a local conversion."""
        batches, conversions = [], []
        for gid, items in assign(groups, dests, self.ctx.rotation).items():
            g = groups[gid]
            self._connect(g)
            base = bases(version, g)
            same = [e for e in items if e.dtype == g.layouts[e.name].dtype]
            convert = [e for e in items if e.dtype != g.layouts[e.name].dtype]
            cp, same_recs = None, dest_records(same)
            if same:
                cp = self._plan(g, same_recs)
                batches.append(self._ops(g, base, cp.reads, same))
            for e in convert:
                ready = converted_layout(g, e)
                if ready is not None:  # the publisher already converted this buffer's pieces
                    cg = replace(g, layouts={e.name: ready}, packed=(), key=(g.key, "conv", e.name, e.dtype))
                    batches.append(self._ops(cg, base, self._plan(cg, dest_records([e])).reads, [e]))
                else:
                    conversions.append(self.converter.plan(g, base, e, lambda gg, recs: self._plan(gg, recs).reads))
            if self.ctx.options.prepack and gid == PUBLISHERS:
                self._request_packs(g, same_recs, cp, convert)
        ops = np.concatenate(batches) if batches else np.empty((0, 5), dtype=np.int64)
        reads = len(ops) + sum(len(c[0]) for conv in conversions for c in conv.chunks)
        nbytes = int(ops[:, 4].sum()) + sum(_nbytes(conv) for conv in conversions)
        return Work(ops, conversions, self._sources_read(groups, ops, conversions), nbytes, reads)

    def _build_columns(self, version: Version, dests: list[Entry]) -> Work | None:
        """The first pull of whole-tensor host buffers from publishers whose shards tile each
        tensor along one dim: one read per shard, planned from the layouts' columns
        (``plan.columns``) without a record or layout object per tensor. None for anything else
        (the general planner's, which also names bad buffers)."""
        fp = self.buffers.fingerprint
        if self._whole[0] is not fp:
            self._whole = (fp, self._host_buffers(dests) and _whole_contiguous(dests))
        ranks = sorted(version.layouts)
        lays = [version.layouts[r] for r in ranks]
        if not self._whole[1] or any(lay.columns is None or lay.packed for lay in lays):
            return None
        reads = whole_buffer_reads([lay.columns for lay in lays], list(map(_NAME, dests)),  # type: ignore[misc]
                                   np.fromiter(map(DTYPE_CODES.__getitem__, map(_DTYPE, dests)), np.int64, len(dests)),
                                   list(map(_SHAPE, dests)), self.ctx.rotation)
        if reads is None:
            return None
        peers = [publisher_peer(r, lay) for r, lay in zip(ranks, lays)]
        for peer, lay in zip(peers, lays):
            self._connect_peer(peer, lay)
        ptrs = np.fromiter(map(_DATA_PTR, map(_TENSOR, dests)), np.int64, len(dests))
        index = np.array([self.ctx.transport.peer_index(p) for p in peers], dtype=np.int64)
        base = np.array([version.pieces[r].base_offset for r in ranks], dtype=np.int64)
        ops = np.empty((len(reads), 5), dtype=np.int64)
        ops[:, 0] = index[reads[:, 0]]
        ops[:, 1] = reads[:, 1]
        ops[:, 2] = reads[:, 2] + base[reads[:, 0]]
        ops[:, 3] = ptrs[reads[:, 3]] + reads[:, 4]
        ops[:, 4] = reads[:, 5]
        self.ctx.stats.plans += 1
        if self.ctx.options.prepack and self._pack_key != ("columns", version.layout_key, fp):
            # one range per shard: no pre-packed copy would save a read (withdraw any asked before)
            self.ctx.catalog.consumers.register(self.ctx.reader_id, [])
            self._pack_key = ("columns", version.layout_key, fp)
        used = frozenset(ranks[i] for i in np.unique(reads[:, 0]).tolist())
        return Work(ops, [], used, int(reads[:, 5].sum()), len(ops))

    def _sources_read(self, groups: Mapping[str, SourceGroup], ops: np.ndarray, conversions: list[Conversion]
                      ) -> frozenset[object]:
        """The sources whose memory these ops read: their torn markers decide whether the bytes
        are good (a source that did not serve this pull cannot tear it)."""
        from astate_store.catalog.readers import replica_source

        used = set(np.unique(ops[:, 0]).tolist())
        for conv in conversions:
            for chunk_ops, _src, _dst in conv.chunks:
                used.update(np.unique(chunk_ops[:, 0]).tolist())
        out: set[object] = set()
        for g in groups.values():
            for peer, rank, _lay in g.sources.values():
                if peer in self._connected and self.ctx.transport.peer_index(peer) in used:
                    out.add(rank if rank is not None else replica_source(peer[1]))
        return frozenset(out)

    def _ops(self, g: SourceGroup, base: Mapping[int, int], reads: np.ndarray, dests: Sequence[Entry]
             ) -> np.ndarray:
        ptrs = np.asarray([e.tensor.data_ptr() for e in dests], dtype=np.int64)
        return to_transport_ops(g, self.ctx.transport.peer_index, base, reads, ptrs)

    def _connect(self, g: SourceGroup) -> None:
        for peer, _rank, lay in g.sources.values():
            self._connect_peer(peer, lay)

    def _connect_peer(self, peer: Any, lay: Any, *, report: bool = True) -> bool:
        """Connect ``peer`` with its layout's descriptor unless already done. Raises
        ``PeerUnreachable`` (a bad descriptor counted as a skipped record) when ``report``;
        else returns False, leaving the report to the pull's own connect."""
        from astate_store.errors import CodecError

        if self._connected.get(peer) == lay.layout_id:
            return True
        try:
            desc = codec.decode("ucx_descriptor", lay.transport)
        except CodecError as exc:
            if not report:
                return False
            # A bad descriptor makes this source unreachable; the pull fails over to the others.
            self.ctx.catalog.versions.skips(f"transport descriptor of layout {lay.layout_id}", str(exc))
            raise PeerUnreachable(f"source {peer}: its layout's transport descriptor is bad: {exc}") from None
        try:
            self.ctx.transport.connect(peer, desc)
        except TransportError as exc:
            if not report:
                return False
            raise PeerUnreachable(f"cannot connect to source {peer}: {exc}") from exc
        self._connected[peer] = lay.layout_id
        return True

    def _plan(self, g: SourceGroup, dests: tuple[ShardRecord, ...]) -> Any:
        before = self._planner.misses
        packed = {self.ctx.reader_id: g.packed} if g.packed else None
        cp = self._planner.plan_consumer(g.layouts, dests, consumer=self.ctx.reader_id, rotation=self.ctx.rotation,
                                         packed=packed, key=(g.key, dests))
        if self._planner.misses != before:
            self.ctx.stats.plans += 1
        else:
            self.ctx.stats.plan_hits += 1
        return cp

    def _request_packs(self, g: SourceGroup, dests: tuple[ShardRecord, ...], cp: Any, convert: list[Entry]) -> None:
        """Tell the publishers which pieces to build for this consumer (see ``prepack``); ``dests``
        are the same-dtype buffers' records. Sent only when the shard layout or the buffers change."""
        key = (g.shards_key, dests, dest_records(convert))
        if key == self._pack_key:
            return
        items: Sequence[Any] = ()
        if cp is not None:
            # With copies already built, plan without them to see which are still wanted.
            items = cp.pack_items if not g.packed else self._planner.plan_consumer(
                g.layouts, dests, consumer=self.ctx.reader_id, rotation=self.ctx.rotation).pack_items
        packs = consumer_requests(items, g.layouts, convert, self.ctx.rotation)
        self.ctx.catalog.consumers.register(self.ctx.reader_id, packs)
        self._pack_key = key
        if packs:
            log.info("asked publishers for %d pre-packed pieces", len(packs))


_NAME, _DTYPE, _SHAPE, _TENSOR = (attrgetter(a) for a in ("name", "dtype", "global_shape", "tensor"))
_DATA_PTR = torch.Tensor.data_ptr


def _whole_contiguous(dests: list[Entry]) -> bool:
    """Every buffer a whole tensor in contiguous memory, under one name (no tied aliases)."""
    return all(map(eq, map(_SHAPE, dests), map(attrgetter("box.sizes"), dests))) and \
        not any(map(attrgetter("aliases"), dests)) and all(map(torch.Tensor.is_contiguous, map(_TENSOR, dests)))


def _shifted(spans: list[tuple[int, int, int]], base: int) -> list[tuple[int, int, int]]:
    return [(region, lo + base, hi + base) for region, lo, hi in spans]


def _report(t: PullTimes, done: int, total: int) -> None:
    """Bytes done in this attempt, to the pull's progress callback: first ``(0, total)``; an
    attempt retried after a torn read counts only past what the torn one reached (``done``
    never goes down; see ``progress``)."""
    if t.counter is None:
        t.counter = ProgressCounter(t.progress, total)
    t.counter.add(done - t.counter.done)


def _nbytes(conv: Conversion) -> int:
    """Bytes one conversion reads over the transport (into its staging)."""
    return sum(int(ops[:, 4].sum()) for ops, _src, _dst in conv.chunks)


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

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
from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np
from . import codec, plan as planner
from .catalog import Version
from .context import StoreContext
from .conversion import Conversion, Converter
from .errors import PeerUnreachable, TornReadError, TransportError, VersionNotFound
from .layout import Entry, ShardRecord, TensorLike
from .prepack import consumer_requests
from .validated import ValidatedTensors
from .sources import (
    PUBLISHERS,
    SourceGroup,
    assign,
    bases,
    converted_layout,
    dest_records,
    failover_order,
    source_groups,
    to_transport_ops,
)

__all__ = ["Consumer"]

log = logging.getLogger("astate_store")

_MAX_TORN_RETRIES = 8
_CACHE = 8  # source-group sets and ready-made batches kept (consumers and re-servers come and go)
_KEEP_PEERS = 4  # pulls a peer stays connected after its last appearance in a version's sources

# A ready-made pull: the batched ops, the local conversions, and the sources the ops read from
# (publisher ranks, or ``r-<member>`` of re-serving consumers: the torn markers end_read checks).
Work = tuple[np.ndarray, list[Conversion], frozenset[object]]


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

    def get_into(self, buffers: Mapping[str, TensorLike], step: int | None, timeout: float | None) -> int:
        """Pull the newest committed version >= ``step`` into the buffers; see ``Store.get_into``."""
        dests = self.buffers.validate(buffers)
        self.ctx.ensure_transport(dests[0].tensor.device)
        self._register()
        deadline = None if timeout is None else time.monotonic() + timeout
        want, torn = step, 0
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            s = self.ctx.catalog.versions.wait_for(want, timeout=remaining)
            got = self._read(s, dests)
            if got:
                self.delivered_step = s
                return s
            want = s + 1  # retired, dropped or torn: only a newer version can serve
            if got is None:
                continue
            torn += 1
            self.ctx.stats["torn_retries"] += 1
            log.info("step %d was retired while being read; retrying on a newer version", s)
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

    def _read(self, step: int, dests: list[Entry]) -> bool | None:
        """One attempt at ``step``: True when the buffers hold it, False when a source retired
        its memory during the read (the bytes are discarded), None when the version was retired
        or dropped before the read could start."""
        readers = self.ctx.catalog.readers
        try:
            version = readers.begin_read(step, self.ctx.reader_id)
        except VersionNotFound:
            return None
        try:
            sources = self._pull(self.ctx.catalog.versions.layouts_of(version), dests)
        except BaseException:
            readers.end_read(step, self.ctx.reader_id)
            raise
        # Only the torn markers of the sources actually read from count.
        return readers.end_read(step, self.ctx.reader_id, sources)

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

    def _pull(self, version: Version, dests: list[Entry]) -> frozenset[object]:
        """Read every buffer from one set of sources; a source may have died without its lease
        expiring yet, so a failed read falls back to the other sets before it raises. Returns
        the sources read from."""
        groups = self._groups(version)
        if not groups:
            raise PeerUnreachable(
                f"namespace {self.ctx.namespace!r}: step {version.step}: publisher ranks {sorted(version.missing)} "
                "are gone (their leases expired) and no consumer re-serves the version")
        tries = failover_order(groups, dests)
        for i, gs in enumerate(tries):
            try:
                return self._pull_from(version, gs, dests)
            except TransportError:
                # Endpoints of a failed read may be closed: connect and plan afresh next time.
                self._connected.clear()
                self._ops_cache.clear()
                if i == len(tries) - 1:
                    raise
                log.info("step %d: a source failed; retrying with other sources", version.step)

    def _pull_from(self, version: Version, groups: Mapping[str, SourceGroup], dests: list[Entry]
                   ) -> frozenset[object]:
        # Steady state: same sources, same buffers, same staging slots -> the ready-made batch.
        slots = tuple(p.base_offset for _r, p in sorted(version.pieces.items()))
        key = (version.layout_key, version.missing, tuple(sorted(groups)), self.buffers.fingerprint, slots)
        work = self._ops_cache.get(key)
        if work is None:
            work = self._ops_cache[key] = self._build_pull(version, groups, dests)
            while len(self._ops_cache) > _CACHE:
                self._ops_cache.popitem(last=False)
        else:
            self._ops_cache.move_to_end(key)
            self.ctx.stats["plan_hits"] += 1
        ops, conversions, sources = work
        self.ctx.stats["reads"] = len(ops) + sum(len(c[0]) for conv in conversions for c in conv.chunks)
        self.ctx.stats["local_conversions"] = len(conversions)
        if len(ops):
            self.ctx.transport.get(ops, timeout=self.ctx.options.read_timeout)  # every same-dtype read in one call
        for conv in conversions:
            self.converter.run(conv)
        self._disconnect_departed(version)
        return sources

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
            peers = frozenset(peer for g in self._groups(version).values() for peer, _r, _l in g.sources.values())
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
            cp = None
            if same:
                cp = self._plan(g, dest_records(same))
                batches.append(self._ops(g, base, cp.reads, same))
            for e in convert:
                ready = converted_layout(g, e)
                if ready is not None:  # the publisher already converted this buffer's pieces
                    cg = replace(g, layouts={e.name: ready}, packed=(), key=(g.key, "conv", e.name, e.dtype))
                    batches.append(self._ops(cg, base, self._plan(cg, dest_records([e])).reads, [e]))
                else:
                    conversions.append(self.converter.plan(g, base, e, lambda gg, recs: self._plan(gg, recs).reads))
            if self.ctx.options.prepack and gid == PUBLISHERS:
                self._request_packs(g, same, cp, convert)
        ops = np.concatenate(batches) if batches else np.empty((0, 5), dtype=np.int64)
        return ops, conversions, self._sources_read(groups, ops, conversions)

    def _sources_read(self, groups: Mapping[str, SourceGroup], ops: np.ndarray, conversions: list[Conversion]
                      ) -> frozenset[object]:
        """The sources whose memory these ops read: their torn markers decide whether the bytes
        are good (a source that did not serve this pull cannot tear it)."""
        from .catalog.readers import replica_source

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
        from .errors import CodecError

        for peer, _rank, lay in g.sources.values():
            if self._connected.get(peer) == lay.layout_id:
                continue
            try:
                desc = codec.decode("ucx_descriptor", lay.transport)
            except CodecError as exc:
                # A bad descriptor makes this source unreachable; the pull fails over to the others.
                self.ctx.catalog.versions.skips(f"transport descriptor of layout {lay.layout_id}", str(exc))
                raise PeerUnreachable(f"source {peer}: its layout's transport descriptor is bad: {exc}") from None
            try:
                self.ctx.transport.connect(peer, desc)
            except TransportError as exc:
                raise PeerUnreachable(f"cannot connect to source {peer}: {exc}") from exc
            self._connected[peer] = lay.layout_id

    def _plan(self, g: SourceGroup, dests: tuple[ShardRecord, ...]) -> Any:
        before = self._planner.misses
        packed = {self.ctx.reader_id: g.packed} if g.packed else None
        cp = self._planner.plan_consumer(g.layouts, dests, consumer=self.ctx.reader_id, rotation=self.ctx.rotation,
                                         packed=packed, key=(g.key, dests))
        self.ctx.stats["plans" if self._planner.misses != before else "plan_hits"] += 1
        return cp

    def _request_packs(self, g: SourceGroup, same: list[Entry], cp: Any, convert: list[Entry]) -> None:
        """Tell the publishers which pieces to build for this consumer (see ``prepack``). Sent
        only when the shard layout or the buffers change."""
        dests = dest_records(same)
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

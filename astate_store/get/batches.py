"""Batches: a consumer's plans and ready-made pulls, cached while sources, buffers and staging
slots stay the same, so a steady pull does no per-tensor work.

For one version and one set of source groups, :meth:`Batches.lookup` gives the batch to run:

1. the ready-made batch of the same sources, buffers and slots (the steady state);
2. else the one of the same sources and buffers in other staging slots, rebased (each
   publisher's rows moved by the distance between its slots);
3. else one planned from the publishers' layout columns (whole host buffers, row-split shards);
4. else one planned by the general planner against each buffer's source group, with local
   dtype conversions where no publisher-converted copy covers a buffer.

The source groups of a version (``sources.source_groups``) and the order of group sets to fail
over through (``sources.failover_order``, after ``sources.uncovered`` and ``check_live`` when
publishers are gone) are cached here too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from operator import attrgetter, eq
from typing import Any, NamedTuple

import numpy as np
import torch

from astate_store import plan as planner
from astate_store.catalog import Manifest, Version
from astate_store.context import StoreContext
from astate_store.errors import PeerUnreachable
from astate_store.get.conversion import Conversion, Converter
from astate_store.get.links import Links
from astate_store.get.sources import (
    PUBLISHERS,
    SourceGroup,
    Wanted,
    assign,
    bases,
    check_live,
    converted_layout,
    dest_records,
    failover_order,
    publisher_peer,
    source_groups,
    to_transport_ops,
    uncovered,
)
from astate_store.model.dtypes import DTYPE_CODES
from astate_store.model.layout import Box, ShardRecord
from astate_store.model.validated import ValidatedTensors
from astate_store.model.validation import Entry

__all__ = ["Batches", "Work"]

log = logging.getLogger("astate_store")

_CACHE = 8  # source-group sets and ready-made batches kept (consumers and re-servers come and go)


class Work(NamedTuple):
    """A ready-made pull: the batched ops, the local conversions, the sources the ops read from
    (publisher ranks, or ``r-<member>`` of re-serving consumers: the torn markers end_read
    checks), and its size — computed once, so a steady pull does no per-tensor accounting."""

    ops: np.ndarray
    conversions: list[Conversion]
    sources: frozenset[object]
    nbytes: int  # over the transport: same-dtype reads plus the conversions' staged reads
    reads: int  # transport read operations


class Batches:
    """One consumer's caches of source groups, failover orders, plans and ready-made batches."""

    def __init__(self, ctx: StoreContext, converter: Converter, links: Links, buffers: ValidatedTensors):
        self.ctx, self.converter, self.links, self.buffers = ctx, converter, links, buffers
        self._planner = planner.Planner()
        self._groups: OrderedDict[object, dict[str, SourceGroup]] = OrderedDict()
        self._ready: OrderedDict[object, Work] = OrderedDict()
        self._tries: tuple[object, list[dict[str, SourceGroup]]] = (None, [])  # (sources, buffers) -> sets
        self._pack_key: object = None
        self._wanted: tuple[object, Wanted, bool] = (
            None,
            {},
            False,
        )  # buffers: (box, dtype) per name, all host
        self._whole: tuple[object, bool] = (None, False)  # buffers: all whole contiguous host tensors

    # ---- sources ------------------------------------------------------------------------------

    def groups(self, version: Version) -> dict[str, SourceGroup]:
        """The version's source groups, cached by its sources (layouts and missing ranks)."""
        key = (version.layout_key, version.missing)
        hit = self._groups.get(key)
        if hit is None:
            hit = self._groups[key] = source_groups(version)
            while len(self._groups) > _CACHE:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(key)
        return hit

    def tries(
        self, version: Version, groups: dict[str, SourceGroup], dests: list[Entry]
    ) -> list[dict[str, SourceGroup]]:
        """The group sets to try in turn (``failover_order``), once per sources and buffers.
        With publisher ranks gone, first check (before any byte moves) that live sources hold
        every byte asked for (``check_live``), else raise ``NoLiveSource`` naming what is lost."""
        key = (version.layout_key, version.missing, self.buffers.fingerprint)
        if self._tries[0] != key:
            short = uncovered(groups, dests) if version.missing else []
            if short:  # the gone ranks' manifests are read only to name what is lost
                check_live(version, groups, short, self._gone_manifests(version))
            if not groups:
                raise PeerUnreachable(
                    f"namespace {self.ctx.namespace!r}: step {version.step}: publisher ranks "
                    f"{sorted(version.missing)} are gone (their leases ended) and no consumer re-serves "
                    "the version"
                )
            self._tries = (key, failover_order(groups, dests))
        return self._tries[1]

    def _gone_manifests(self, version: Version) -> dict[int, Manifest]:
        """The manifests (leaseless: what each rank held) of the version's gone publisher ranks."""
        return {
            r: m for r, m in self.ctx.catalog.versions.manifests_of(version).items() if r in version.missing
        }

    # ---- buffers ------------------------------------------------------------------------------

    def host_buffers(self, dests: list[Entry]) -> bool:
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

    @property
    def wanted(self) -> Wanted:
        """Per tensor name, the (box, dtype) of each buffer of it (after :meth:`host_buffers`)."""
        return self._wanted[1]

    # ---- ready-made batches -------------------------------------------------------------------

    def key(self, version: Version, gids: tuple[str, ...]) -> tuple[object, ...]:
        """What a ready-made batch is cached under: sources, buffers and this step's slots."""
        slots = tuple(p.base_offset for _r, p in sorted(version.pieces.items()))
        return (version.layout_key, version.missing, gids, self.buffers.fingerprint, slots)

    def ready(self, key: tuple[object, ...]) -> bool:
        return key in self._ready

    def clear(self) -> None:
        """Drop the ready-made batches (they name peer indices that may be gone)."""
        self._ready.clear()

    def lookup(
        self, version: Version, groups: Mapping[str, SourceGroup] | None, dests: list[Entry]
    ) -> tuple[Work, bool]:
        """The batch that pulls ``dests`` from ``groups`` (None: the version's publishers, its
        only source), and whether it was planned just now (a rebased one counts as not)."""
        # Steady state: same sources, same buffers, same staging slots -> the ready-made batch.
        key = self.key(version, (PUBLISHERS,) if groups is None else tuple(sorted(groups)))
        work = self._ready.get(key)
        if work is not None:
            self._ready.move_to_end(key)
            self.ctx.stats.plan_hits += 1
            return work, False
        built = True
        work = self._rebased(version, key)
        if work is None:
            work = self._build_columns(version, dests) if groups is None else None
            if work is None:
                work = self._build_pull(version, self.groups(version) if groups is None else groups, dests)
        else:
            built = False  # its first build hinted every slot ahead
        self._ready[key] = work
        while len(self._ready) > _CACHE:
            self._ready.popitem(last=False)
        return work, built

    def _rebased(self, version: Version, key: tuple[object, ...]) -> Work | None:
        """The ready-made batch of the same sources and buffers in other staging slots, if one
        is cached: each publisher's rows moved by the distance between its two slots (the same
        layout, so every offset inside a slot is the same; the transport still checks each row).
        Otherwise a large model's first read of its second slot would plan everything again.
        None when there is no such batch, or it converts locally (its chunks hold offsets too)."""
        stem, slots = key[:-1], key[-1]
        old = next(
            ((k, w) for k, w in reversed(self._ready.items()) if k[:-1] == stem and not w.conversions), None
        )
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

    # ---- planning -----------------------------------------------------------------------------

    def _build_pull(self, version: Version, groups: Mapping[str, SourceGroup], dests: list[Entry]) -> Work:
        """Plan every buffer against its source group: same-dtype reads into one batch; other
        dtypes from publisher-converted copies when they exist, else a local conversion."""
        batches, conversions = [], []
        for gid, items in assign(groups, dests, self.ctx.rotation).items():
            g = groups[gid]
            self.links.connect(g)
            base = bases(version, g)
            same = [e for e in items if e.dtype == g.layouts[e.name].dtype]
            convert = [e for e in items if e.dtype != g.layouts[e.name].dtype]
            cp, same_recs = None, dest_records(same)
            whole = self._whole_copies(g, base, same) if gid != PUBLISHERS else None
            if whole is not None:
                batches.append(whole)
            elif same:
                cp = self._plan(g, same_recs)
                batches.append(self._rows(g, base, cp.reads, same))
            for e in convert:
                ready = converted_layout(g, e)
                if ready is not None:  # the publisher already converted this buffer's pieces
                    cg = replace(g, layouts={e.name: ready}, packed=(), key=(g.key, "conv", e.name, e.dtype))
                    batches.append(self._rows(cg, base, self._plan(cg, dest_records([e])).reads, [e]))
                else:
                    recs = self.converter.chunk_records(g, e)  # every chunk in one planning call
                    conversions.append(self.converter.plan(g, base, e, recs, self._plan(g, recs).reads))
            if self.ctx.options.prepack and gid == PUBLISHERS:
                self._request_packs(g, same_recs, cp, convert)
        ops = np.concatenate(batches) if batches else np.empty((0, 5), dtype=np.int64)
        reads = len(ops) + sum(len(c[0]) for conv in conversions for c in conv.chunks)
        nbytes = int(ops[:, 4].sum()) + sum(conversion_nbytes(conv) for conv in conversions)
        return Work(ops, conversions, self.links.sources_read(groups, ops, conversions), nbytes, reads)

    def _whole_copies(self, g: SourceGroup, base: Mapping[int, int], dests: list[Entry]) -> np.ndarray | None:
        """The rows of whole contiguous buffers from a re-serving group holding each of their
        tensors as one whole contiguous copy (a replica server's): one read per buffer, which is the
        plan; the planner's fixed cost (every stage runs, whatever the size) would otherwise be most
        of a small session's first pull. None for anything else (then the planner plans, and names
        what does not fit)."""
        if not dests or not _whole_contiguous(dests):
            return None
        rows = np.empty((len(dests), 5), dtype=np.int64)
        peers: dict[int, int] = {}
        for i, e in enumerate(dests):
            lay = g.layouts.get(e.name)
            if lay is None or len(lay.shards) != 1 or lay.global_shape != e.global_shape:
                return None
            s = lay.shards[0]
            if s.box.sizes != lay.global_shape or not s.contiguous or s.dtype != e.dtype or not s.nbytes:
                return None
            if s.rank not in peers:
                peers[s.rank] = self.ctx.transport.peer_index(g.sources[s.rank][0])
            rows[i] = (peers[s.rank], s.region, s.byte_offset + base[s.rank], e.tensor.data_ptr(), s.nbytes)
        self.ctx.stats.plans += 1
        return rows

    def _build_columns(self, version: Version, dests: list[Entry]) -> Work | None:
        """The first pull of whole-tensor host buffers from publishers whose shards tile each
        tensor along one dim: one read per shard, planned from the layouts' columns
        (``plan.whole_buffer_reads``) without a record or layout object per tensor. None for anything else
        (the general planner's, which also names bad buffers)."""
        fp = self.buffers.fingerprint
        if self._whole[0] is not fp:
            self._whole = (fp, self.host_buffers(dests) and _whole_contiguous(dests))
        ranks = sorted(version.layouts)
        lays = [version.layouts[r] for r in ranks]
        if not self._whole[1] or any(lay.columns is None or lay.packed for lay in lays):
            return None
        reads = planner.whole_buffer_reads(
            [lay.columns for lay in lays],
            list(map(_NAME, dests)),  # type: ignore[misc]
            np.fromiter(map(DTYPE_CODES.__getitem__, map(_DTYPE, dests)), np.int64, len(dests)),
            list(map(_SHAPE, dests)),
            self.ctx.rotation,
        )
        if reads is None:
            return None
        peers = [publisher_peer(r, lay) for r, lay in zip(ranks, lays)]
        for peer, lay in zip(peers, lays):
            self.links.connect_peer(peer, lay)
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

    def _rows(
        self, g: SourceGroup, base: Mapping[int, int], reads: np.ndarray, dests: Sequence[Entry]
    ) -> np.ndarray:
        ptrs = np.asarray([e.tensor.data_ptr() for e in dests], dtype=np.int64)
        return to_transport_ops(g, self.ctx.transport.peer_index, base, reads, ptrs)

    def _plan(self, g: SourceGroup, dests: tuple[ShardRecord, ...]) -> Any:
        before = self._planner.misses
        packed = {self.ctx.reader_id: g.packed} if g.packed else None
        cp = self._planner.plan_consumer(
            g.layouts,
            dests,
            consumer=self.ctx.reader_id,
            rotation=self.ctx.rotation,
            packed=packed,
            key=(g.key, dests),
        )
        if self._planner.misses != before:
            self.ctx.stats.plans += 1
        else:
            self.ctx.stats.plan_hits += 1
        return cp

    def _request_packs(
        self, g: SourceGroup, dests: tuple[ShardRecord, ...], cp: Any, convert: list[Entry]
    ) -> None:
        """Tell the publishers which pieces to build for this consumer (see ``prepack``); ``dests``
        are the same-dtype buffers' records. Sent only when the shard layout or the buffers change."""
        key = (g.shards_key, dests, dest_records(convert))
        if key == self._pack_key:
            return
        items: Sequence[Any] = ()
        if cp is not None:
            # With copies already built, plan without them to see which are still wanted.
            items = (
                cp.pack_items
                if not g.packed
                else self._planner.plan_consumer(
                    g.layouts, dests, consumer=self.ctx.reader_id, rotation=self.ctx.rotation
                ).pack_items
            )
        packs = planner.consumer_requests(items, g.layouts, convert, self.ctx.rotation)
        self.ctx.catalog.consumers.register(self.ctx.reader_id, packs)
        self._pack_key = key
        if packs:
            log.info("asked publishers for %d pre-packed pieces", len(packs))


def conversion_nbytes(conv: Conversion) -> int:
    """Bytes one conversion reads over the transport (into its staging)."""
    return sum(int(ops[:, 4].sum()) for ops, _src, _dst in conv.chunks)


_NAME, _DTYPE, _SHAPE, _TENSOR = (attrgetter(a) for a in ("name", "dtype", "global_shape", "tensor"))
_DATA_PTR = torch.Tensor.data_ptr


def _whole_contiguous(dests: list[Entry]) -> bool:
    """Every buffer a whole tensor in contiguous memory, under one name (no tied aliases)."""
    return (
        all(map(eq, map(_SHAPE, dests), map(attrgetter("box.sizes"), dests)))
        and not any(map(attrgetter("aliases"), dests))
        and all(map(torch.Tensor.is_contiguous, map(_TENSOR, dests)))
    )

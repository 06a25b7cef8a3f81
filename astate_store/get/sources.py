"""Source selection: which sets of peers can serve a committed version, and which one serves
each buffer. Pure (no etcd, no transport): it works on the catalog's ``Version`` records.

A *source group* holds tensors: the publishers of the version, or one group of re-serving
consumers (which holds whole tensors). When publisher ranks are gone (their leases ended), the
publishers' group holds only what the live ranks hold: a tensor some dead rank held a part of
is *partial* there, and serves only the buffers whose boxes its live shards cover. Each buffer
is read from exactly one group that covers it, chosen per consumer by a stable rotation so that
independent consumers spread over the groups; a buffer no group covers is named, with the dead
ranks that held its bytes, before any byte moves (:func:`uncovered`, :func:`check_live`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np

from astate_store.catalog import Layout, Manifest, Version
from astate_store.errors import LayoutError, NoLiveSource
from astate_store.model.layout import (
    Box,
    ShardColumns,
    ShardRecord,
    TensorLayout,
    group_layouts,
    merge_tensor_layout,
)
from astate_store.model.spans import span_runs
from astate_store.model.validation import Entry, check_fit

__all__ = [
    "PUBLISHERS",
    "SourceGroup",
    "source_groups",
    "assign",
    "failover_order",
    "bases",
    "dest_records",
    "converted_layout",
    "to_transport_ops",
    "publisher_peer",
    "byte_spans",
    "read_spans",
    "Wanted",
    "covers",
    "uncovered",
    "check_live",
]

PUBLISHERS = "pub"  # the group id of the version's publisher ranks


@dataclass(frozen=True)
class SourceGroup:
    """One set of sources that together hold whole tensors: the publishers, or a re-serving group.
    ``sources`` maps the planner's source id to (transport peer key, publisher rank or None, layout);
    a publisher's base offset (its staging slot) changes every step and is looked up per version."""

    gid: str
    layouts: Mapping[str, TensorLayout]
    sources: Mapping[int, tuple[Hashable, int | None, Layout]]
    key: object
    packed: tuple[ShardRecord, ...] = ()  # contiguous copies publishers built (for any consumer)
    shards_key: object = None  # the shard layout alone (packed copies left out)
    converted: tuple[ShardRecord, ...] = ()  # copies built in another dtype (converted on the publisher)
    partial: frozenset[str] = frozenset()  # tensors held only in part here (some holder rank is gone)


def publisher_peer(rank: int, lay: Layout) -> Hashable:
    """The transport peer key of publisher ``rank`` (its layout names the session epoch)."""
    return ("pub", lay.epoch, rank)


def _publisher_group(version: Version) -> SourceGroup:
    """The version's live publisher ranks (all of them unless ``version.missing``)."""
    src = {r: (publisher_peer(r, version.layouts[r]), r, version.layouts[r]) for r in version.layouts}
    shards = (s for lay in version.layouts.values() for s in lay.shards)
    layouts, partial = (group_layouts(shards), frozenset()) if not version.missing else _live_layouts(shards)
    # One copy per (tensor, box, dtype) serves every consumer: the planner uses a copy only where
    # it equals a piece this consumer reads.
    mine = [rec for lay in version.layouts.values() for rec in lay.packed]
    # The plan cache key: the same layouts with fewer live ranks are other sources (a plan made
    # while all lived may read a rank that is gone now).
    key = version.layout_key if not version.missing else (version.layout_key, version.missing)
    return SourceGroup(
        PUBLISHERS,
        layouts,
        src,
        key,
        tuple(r for r in mine if r.dtype == layouts[r.name].dtype),
        tuple(version.layouts[r].shards for r in sorted(version.layouts)),
        tuple(r for r in mine if r.dtype != layouts[r.name].dtype),
        partial,
    )


def _live_layouts(shards: Iterable[ShardRecord]) -> tuple[dict[str, TensorLayout], frozenset[str]]:
    """Per tensor, the layout of the shards live ranks hold, and the tensors those do not tile
    (a dead rank held the rest): those are kept as partial layouts, which the planner serves
    only for boxes they cover (it checks every destination's coverage). A tensor whose live
    shards disagree on dtype or global shape is no source of it."""
    by_name: dict[str, list[ShardRecord]] = {}
    for r in shards:
        by_name.setdefault(r.name, []).append(r)
    layouts: dict[str, TensorLayout] = {}
    partial: set[str] = set()
    for n, recs in sorted(by_name.items()):
        try:
            layouts[n] = merge_tensor_layout(n, recs)
        except LayoutError:
            first = recs[0]
            if any((r.dtype, r.global_shape) != (first.dtype, first.global_shape) for r in recs):
                continue
            recs.sort(key=_MERGE_KEY)
            layouts[n] = TensorLayout(n, first.dtype, first.global_shape, tuple(recs))
            partial.add(n)
    return layouts, frozenset(partial)


_MERGE_KEY = attrgetter("box.offsets", "box.sizes", "rank", "region")


def _replica_group(version: Version, name: str, members: Sequence[str]) -> SourceGroup | None:
    """A re-serving group, with the tensors its members hold whole between them."""
    src, by_name = {}, {}
    for i, m in enumerate(members):
        lay = version.replica_layouts[m]
        src[i] = (("replica", m), None, lay)
        for s in lay.shards:
            by_name.setdefault(s.name, []).append(replace(s, rank=i))
    layouts = {}
    for n, recs in sorted(by_name.items()):
        try:
            layouts[n] = merge_tensor_layout(n, recs)
        except LayoutError:
            continue  # the group holds only part of this tensor: not a source of it
    if not layouts:
        return None
    return SourceGroup(
        "g:" + name, layouts, src, tuple((m, version.replica_layouts[m].layout_id) for m in members)
    )


def source_groups(version: Version) -> dict[str, SourceGroup]:
    """The alternative sources of a version (with its layouts resolved): its live publishers
    (partial when some ranks are gone) and each re-serving group."""
    groups: dict[str, SourceGroup] = {}
    if version.layouts:
        groups[PUBLISHERS] = _publisher_group(version)
    by_group: dict[str, list[str]] = {}
    for m in sorted(version.replica_layouts):
        by_group.setdefault(version.replicas[m].group, []).append(m)
    for name, members in sorted(by_group.items()):
        g = _replica_group(version, name, members)
        if g is not None:
            groups[g.gid] = g
    return groups


def assign(
    groups: Mapping[str, SourceGroup], dests: Sequence[Entry], rotation: int
) -> dict[str, list[Entry]]:
    """One source group per buffer: every buffer is checked to fit first (before any byte moves),
    then consumers spread over the groups that hold the tensor, deterministically per consumer.

    Raises:
        LayoutError: a name no group publishes, or a global shape / dtype that does not fit.
    """
    out: dict[str, list[Entry]] = {}
    order = sorted(groups)
    for i, e in enumerate(dests):
        cands = [g for g in order if covers(groups[g], e)]
        if not cands and e.aliases:  # a tied buffer: fill it from whichever of its names is published
            e = _published_alias(groups, order, e)
            cands = [g for g in order if covers(groups[g], e)]
        if not cands:
            names = sorted({n for g in groups.values() for n in g.layouts})
            raise LayoutError(
                f"tensor {e.name!r} is not in step's published tensors ({', '.join(names[:8])}"
                f"{', ...' if len(names) > 8 else ''})"
            )
        check_fit(e, groups[cands[0]].layouts[e.name], "the published tensor")
        out.setdefault(cands[(rotation + i) % len(cands)], []).append(e)
    return out


def _published_alias(groups: Mapping[str, SourceGroup], order: list[str], e: Entry) -> Entry:
    """``e`` under the first of its aliases some group covers (``e`` itself when none is)."""
    for a in e.aliases:
        other = replace(e, name=a, aliases=tuple(n for n in (e.name, *e.aliases) if n != a))
        if any(covers(groups[g], other) for g in order):
            return other
    return e


def covers(g: SourceGroup, e: Entry) -> bool:
    """Whether group ``g`` holds every element of buffer ``e`` under its name: any tensor it
    holds whole; a partial one when its distinct live boxes (disjoint in a valid layout) hold
    all of the buffer's box."""
    lay = g.layouts.get(e.name)
    if lay is None:
        return False
    if e.name not in g.partial:
        return True
    return _covered(lay.shards, e.box) == e.box.numel


def _covered(shards: Sequence[ShardRecord], box: Box) -> int:
    """Elements of ``box`` the distinct boxes of ``shards`` hold (replicas counted once)."""
    n = 0
    for b in {s.box for s in shards}:
        piece = b.intersect(box)
        if piece is not None:
            n += piece.numel
    return n


def uncovered(groups: Mapping[str, SourceGroup], dests: Sequence[Entry]) -> list[Entry]:
    """The buffers no live group covers (under any of their names): what :func:`check_live`
    checks against the gone ranks. Empty in the common case, where nothing more is read."""
    order = sorted(groups)
    return [e for e in dests if not any(covers(groups[g], x) for g in order for x in _names_of(e))]


def check_live(
    version: Version, groups: Mapping[str, SourceGroup], short: Sequence[Entry], gone: Mapping[int, Manifest]
) -> None:
    """Before any byte moves: raise naming each tensor and box of the buffers no live group
    covers (``short``, from :func:`uncovered`) and the gone ranks that held them. ``gone``: the
    manifests (leaseless) of the ranks in ``version.missing``. A buffer whose tensor no one,
    live or gone, ever published is left to :func:`assign` (its ``LayoutError``).

    Raises:
        NoLiveSource: naming (tensor, box, ranks) of every piece without a live source.
    """
    if not short:
        return
    held = _held_by(gone, {n for e in short for n in (e.name, *e.aliases)})
    holes: dict[tuple[str, Box], set[int]] = {}
    for e in short:
        names = [n for n in (e.name, *e.aliases) if n in held]
        if not names:
            continue  # never published under any of its names: assign's LayoutError
        live = groups[PUBLISHERS].layouts.get(names[0]) if PUBLISHERS in groups else None
        live_boxes = {s.box for s in live.shards} if live is not None else set()
        found = False
        for box, rank in held[names[0]]:
            piece = box.intersect(e.box)
            if piece is not None and box not in live_boxes:
                holes.setdefault((names[0], piece), set()).add(rank)
                found = True
        if not found:  # the gone ranks' boxes do not explain it (an inconsistent layout): the buffer
            holes.setdefault((names[0], e.box), set())
    if not holes:
        return
    items = sorted(holes.items(), key=lambda kv: (kv[0][0], kv[0][1].offsets))
    text = "; ".join(
        f"{n!r} box {b.offsets}+{b.sizes} (held by ranks {sorted(r)})" for (n, b), r in items[:8]
    )
    raise NoLiveSource(
        f"step {version.step}: publisher ranks {sorted(version.missing)} are gone (their leases ended) "
        f"and no live publisher, replica or re-serving consumer holds {len(items)} pieces of the "
        f"buffers asked for: {text}"
        f"{'; ...' if len(items) > 8 else ''}",
        step=version.step,
        holes=[(n, b.offsets, b.sizes, tuple(sorted(r))) for (n, b), r in items],
    )


def _names_of(e: Entry) -> list[Entry]:
    """The buffer under its own name and under each alias (a tied buffer is filled by any)."""
    return [e] + [
        replace(e, name=a, aliases=tuple(n for n in (e.name, *e.aliases) if n != a)) for a in e.aliases
    ]


def _held_by(manifests: Mapping[int, Manifest], names: set[str]) -> dict[str, list[tuple[Box, int]]]:
    """Per tensor of ``names``, the (box, rank) of each shard the manifests' ranks held."""
    out: dict[str, list[tuple[Box, int]]] = {}
    for rank, m in sorted(manifests.items()):
        st, of, sz = m.starts.tolist(), m.offsets.tolist(), m.sizes.tolist()
        for i, n in enumerate(m.names):
            if n in names:
                out.setdefault(n, []).append(
                    (Box(tuple(of[st[i] : st[i + 1]]), tuple(sz[st[i] : st[i + 1]])), rank)
                )
    return out


def failover_order(groups: Mapping[str, SourceGroup], dests: Sequence[Entry]) -> list[dict[str, SourceGroup]]:
    """The group sets to try in turn: all of them, then without the publishers, then the
    publishers alone, then (with several re-serving groups) each of those alone — a dead
    replica server whose lease has not expired yet must not fail a pull another one can
    serve; sets that cannot serve every buffer are left out."""
    tries = [dict(groups)]
    if PUBLISHERS in groups and len(groups) > 1:
        tries += [{k: v for k, v in groups.items() if k != PUBLISHERS}, {PUBLISHERS: groups[PUBLISHERS]}]
    replicas = sorted(k for k in groups if k != PUBLISHERS)
    if len(replicas) > 1:
        tries += [{k: groups[k]} for k in replicas]
    return [
        gs
        for i, gs in enumerate(tries)
        if i == 0 or all(any(covers(g, x) for g in gs.values() for x in _names_of(e)) for e in dests)
    ]


def bases(version: Version, g: SourceGroup) -> dict[int, int]:
    """Per source id, the byte offset of this step's bytes in its regions (a publisher's
    staging slot; 0 for in-place and re-served memory)."""
    return {
        sid: (0 if r is None else version.pieces[r].base_offset) for sid, (_p, r, _l) in g.sources.items()
    }


Wanted = Mapping[str, Sequence[tuple[Box, str]]]  # tensor name -> (box, dtype) of each buffer of it


def byte_spans(
    shards: Sequence[ShardRecord],
    packed: Sequence[ShardRecord],
    wanted: Wanted,
    columns: ShardColumns | None = None,
) -> list[tuple[int, int, int]]:
    """``(region, lo, hi)`` runs (``spans.span_runs``) of the bytes a plan for the ``wanted``
    buffers may read in one source, relative to its base offset: each buffer's piece of each
    shard, and its pre-packed copies. A piece that a copy holds whole (of the buffer's or the
    shard's dtype) is left out of the shard: the planner reads the copy; a copy of a third dtype
    is left out. A superset of what a plan reads, without the other consumers' copies or the
    shard bytes next to the piece. ``columns``: the same shards column-wise (``Layout.columns``):
    a shard a whole-tensor buffer wants takes its byte range from them, and no record is built
    unless some buffer wants part of a shard.

    1. the wanted tensors' pre-packed copies are gathered by name;
    2. a shard that one whole-tensor buffer wants, and no copy of, is taken whole: its span comes
       from :class:`_ShardIndex` (from the columns when they are usable, else its record);
    3. any other wanted shard adds each buffer's piece of it, unless a copy holds that piece;
    4. each copy adds its piece for each buffer, when of the buffer's or the shard's dtype;
    5. all of it is merged into runs.
    """
    copies: dict[str, list[ShardRecord]] = {}
    for r in packed:
        if r.name in wanted:
            copies.setdefault(r.name, []).append(r)
    index = _ShardIndex(shards, columns)
    pieces = _Pieces()
    whole: list[int] = []  # shards a whole-tensor buffer takes whole
    for i, name in enumerate(index.names):
        boxes = wanted.get(name, ())
        if not boxes:
            continue
        if len(boxes) == 1 and name not in copies and boxes[0][0].sizes == index.global_shape(i):
            whole.append(i)
            continue
        r = shards[i]
        for box, dtype in boxes:
            piece = r.box.intersect(box)
            if piece is not None and not any(
                c.box == piece and c.dtype in (dtype, r.dtype) for c in copies.get(r.name, ())
            ):
                pieces.add(r, piece)
    published = {r.name: r.dtype for r in shards if r.name in copies} if copies else {}
    for name, recs in copies.items():
        for r in recs:
            for box, dtype in wanted[name]:
                piece = r.box.intersect(box)
                if piece is not None and r.dtype in (dtype, published.get(name)):
                    pieces.add(r, piece)
    rows = np.concatenate([pieces.rows(), index.whole_spans(whole)], axis=1)
    return span_runs(rows[0], rows[1], rows[2])


class _ShardIndex:
    """What :func:`byte_spans` reads of one source's shards by index: names, global shapes, and
    the byte spans of shards taken whole. From the columns when they give spans (then no record
    is built for those), else from the records; the caller sees one form either way."""

    def __init__(self, shards: Sequence[ShardRecord], columns: ShardColumns | None) -> None:
        self._shards = shards
        # None: no columns, or numbers a hostile record could overflow int64 with (records decide)
        self._spans = None if columns is None else columns.spans
        if self._spans is not None:
            assert columns is not None
            self.names: Sequence[str] = columns.names
            self._flat, self._starts = columns.global_shapes.tolist(), columns.starts.tolist()
        else:
            self.names = [r.name for r in shards]

    def global_shape(self, i: int) -> tuple[int, ...]:
        if self._spans is None:
            return self._shards[i].global_shape
        return tuple(self._flat[self._starts[i] : self._starts[i + 1]])

    def whole_spans(self, idx: list[int]) -> np.ndarray:
        """``(3, len(idx))`` rows (region, lo, hi): the byte spans of the shards ``idx`` whole."""
        if self._spans is not None:
            return self._spans[idx].T
        pieces = _Pieces()
        for i in idx:
            pieces.add(self._shards[i], self._shards[i].box)
        return pieces.rows()


class _Pieces:
    """(region, lo, hi) rows of the byte ranges of pieces of shards, empty ranges left out."""

    def __init__(self) -> None:
        self.region: list[int] = []
        self.lo: list[int] = []
        self.hi: list[int] = []

    def add(self, r: ShardRecord, piece: Box) -> None:
        a, b = r.byte_range(piece)
        if a < b:
            self.region.append(r.region)
            self.lo.append(a)
            self.hi.append(b)

    def rows(self) -> np.ndarray:
        return np.array([self.region, self.lo, self.hi], dtype=np.int64).reshape(3, -1)


def read_spans(ops: np.ndarray) -> dict[int, list[tuple[int, int, int]]]:
    """Per peer index of transport ops, ``(region, lo, hi)`` runs (``spans.span_runs``) of
    the bytes they read."""
    if not len(ops):
        return {}
    stride = int(ops[:, 1].max()) + 1
    key = ops[:, 0].astype(np.int64) * stride + ops[:, 1]
    out: dict[int, list[tuple[int, int, int]]] = {}
    for k, a, b in span_runs(key, ops[:, 2], ops[:, 2] + ops[:, 4]):
        out.setdefault(k // stride, []).append((k % stride, a, b))
    return out


def dest_records(dests: Sequence[Entry]) -> tuple[ShardRecord, ...]:
    """Buffers as the planner's destination records: buffer i is region i of rank -1."""
    return tuple(e.record(-1, i, 0) for i, e in enumerate(dests))


def converted_layout(g: SourceGroup, e: Entry) -> TensorLayout | None:
    """The publisher-converted copies of this buffer's pieces, if together they cover it."""
    recs = tuple(
        r for r in g.converted if r.name == e.name and r.dtype == e.dtype and e.box.intersect(r.box) == r.box
    )
    if not recs or sum(r.box.numel for r in recs) != e.box.numel:
        return None
    return TensorLayout(e.name, e.dtype, e.global_shape, recs)


def to_transport_ops(
    g: SourceGroup,
    peer_index: Callable[[Hashable], int],
    base: Mapping[int, int],
    reads: np.ndarray,
    dst_base: np.ndarray,
) -> np.ndarray:
    """Plan rows -> (peer index, region, remote offset, local address, length), vectorized."""
    n = max(g.sources) + 1
    peer_idx = np.full(n, -1, dtype=np.int64)
    base_arr = np.zeros(n, dtype=np.int64)
    for sid, (peer, _r, _lay) in g.sources.items():
        peer_idx[sid] = peer_index(peer)
        base_arr[sid] = base[sid]
    src = reads["src_rank"].astype(np.int64)
    ops = np.empty((len(reads), 5), dtype=np.int64)
    ops[:, 0] = peer_idx[src]
    ops[:, 1] = reads["src_region"]
    ops[:, 2] = reads["src_offset"] + base_arr[src]
    ops[:, 3] = dst_base[reads["dst_region"]] + reads["dst_offset"]
    ops[:, 4] = reads["length"]
    return ops

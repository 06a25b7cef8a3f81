"""Source selection without etcd: which groups can serve a version and which serves each buffer."""

from __future__ import annotations

import pytest
import torch

from astate_store.catalog import Layout, Manifest, Piece, Replica, Version
from astate_store.catalog.shard_tables import manifest_from_record, manifest_record
from astate_store.errors import LayoutError, NoLiveSource
from astate_store.get.sources import (
    PUBLISHERS,
    assign,
    bases,
    byte_spans,
    check_live,
    covers,
    failover_order,
    read_spans,
    source_groups,
    uncovered,
)
from astate_store.model.layout import Box, Shard, ShardRecord, contiguous_strides
from astate_store.model.validation import validate_tensors

SHAPE = (8, 4)


def _rec(name: str, rank: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ShardRecord:
    return ShardRecord(name, "float32", SHAPE, Box(offsets, sizes), contiguous_strides(sizes), rank, 0, 0)


def _layout(lid: str, rank: int, *recs: ShardRecord) -> Layout:
    return Layout(lid, 1, rank, recs, b"")


def _version(
    *, missing: frozenset[int] = frozenset(), replicas: dict[str, tuple[str, Layout]] | None = None
) -> Version:
    """Two publisher ranks split "w" by rows; both hold "b" whole (replicated). Optional
    re-serving consumers: member -> (group, layout)."""
    lays = {
        0: _layout("L0", 0, _rec("w", 0, (0, 0), (4, 4)), _rec("b", 0, (0, 0), SHAPE)),
        1: _layout("L1", 1, _rec("w", 1, (4, 0), (4, 4)), _rec("b", 1, (0, 0), SHAPE)),
    }
    pieces = {r: Piece(7, 1, r, 2, lays[r].layout_id, 4096 * r) for r in lays}
    replicas = replicas or {}
    return Version(
        7,
        1,
        2,
        pieces,
        {m: Replica(7, grp, m, lay.layout_id) for m, (grp, lay) in replicas.items()},
        {r: lay for r, lay in lays.items() if r not in missing},
        {m: lay for m, (_g, lay) in replicas.items()},
        missing,
    )


def _bufs(**tensors: object) -> list:
    return validate_tensors(tensors, "buffers")  # type: ignore[arg-type]


def test_publishers_are_one_group_with_every_tensor_whole() -> None:
    groups = source_groups(_version())
    assert set(groups) == {PUBLISHERS}
    g = groups[PUBLISHERS]
    assert set(g.layouts) == {"w", "b"}
    assert sorted(s.rank for s in g.layouts["w"].shards) == [0, 1]
    assert sorted(s.rank for s in g.layouts["b"].shards) == [0, 1]  # replicas of one box
    assert bases(_version(), g) == {0: 0, 1: 4096}  # each rank's staging slot of this step


def test_a_dead_publisher_leaves_the_live_ranks_and_the_reserving_groups() -> None:
    solo = _layout("R1", 0, _rec("w", 0, (0, 0), SHAPE))
    half = _layout("R2", 0, _rec("b", 0, (0, 0), (4, 4)))  # only part of "b": not a source of it
    v = _version(missing=frozenset({1}), replicas={"c1": ("solo", solo), "c2": ("part", half)})
    groups = source_groups(v)
    assert set(groups) == {PUBLISHERS, "g:solo"}
    assert set(groups["g:solo"].layouts) == {"w"}
    assert bases(v, groups["g:solo"]) == {0: 0}  # re-served memory has no staging slot
    live = groups[PUBLISHERS]
    assert set(live.sources) == {0}  # rank 1 is not a source: it is never dialled
    # plans are cached by the group's key: one made while rank 1 lived must not serve now
    assert live.key != source_groups(_version())[PUBLISHERS].key
    assert live.partial == {"w"}  # rank 0 holds rows 0..4 of "w", and all of "b" (replicated)
    assert [s.rank for s in live.layouts["b"].shards] == [0]
    top, bottom = (_bufs(w=Shard(torch.zeros(4, 4), (o, 0), SHAPE))[0] for o in (0, 4))
    whole = _bufs(w=torch.zeros(SHAPE))[0]
    assert covers(live, top) and not covers(live, bottom) and not covers(live, whole)
    assert covers(live, _bufs(b=torch.zeros(SHAPE))[0])
    # every buffer goes to a group that covers it: the bottom rows only to the re-servers
    assert {g for r in range(4) for g in assign(groups, [bottom], r)} == {"g:solo"}
    assert {g for r in range(4) for g in assign(groups, [top], r)} == {PUBLISHERS, "g:solo"}


def _manifest(*recs: ShardRecord) -> Manifest:
    rec = manifest_record(recs)
    return manifest_from_record(rec, rec["manifest_id"])


def test_bytes_only_gone_ranks_held_are_named_before_any_read() -> None:
    v = _version(missing=frozenset({1}))
    groups = source_groups(v)
    gone = {1: _manifest(_rec("w", 1, (4, 0), (4, 4)), _rec("b", 1, (0, 0), SHAPE))}

    # everything asked for is live: nothing is short, so the gone ranks' manifests are not read
    assert uncovered(groups, _bufs(w=Shard(torch.zeros(4, 4), (0, 0), SHAPE), b=torch.zeros(SHAPE))) == []
    short = uncovered(groups, _bufs(w=Shard(torch.zeros(2, 4), (3, 0), SHAPE), b=torch.zeros(SHAPE)))
    assert [e.name for e in short] == ["w"]
    with pytest.raises(NoLiveSource, match=r"ranks \[1\] are gone.*'w' box \(4, 0\)\+\(1, 4\)") as err:
        check_live(v, groups, short, gone)
    # row 3 is rank 0's; only row 4 was rank 1's alone ("b" was replicated on rank 0 too)
    assert err.value.holes == [("w", (4, 0), (1, 4), (1,))] and err.value.step == 7
    # a tensor nobody ever published is still the buffer's LayoutError (from assign)
    check_live(v, groups, uncovered(groups, _bufs(nope=torch.zeros(SHAPE))), gone)
    with pytest.raises(LayoutError, match=r"'nope' is not in"):
        assign(groups, _bufs(nope=torch.zeros(SHAPE)), 0)
    # with every publisher gone and no re-server, every byte asked for is named
    v2 = _version(missing=frozenset({0, 1}))
    both = {0: _manifest(_rec("w", 0, (0, 0), (4, 4)), _rec("b", 0, (0, 0), SHAPE)), **gone}
    g2 = source_groups(v2)
    with pytest.raises(NoLiveSource) as err:
        check_live(v2, g2, uncovered(g2, _bufs(w=torch.zeros(SHAPE), b=torch.zeros(SHAPE))), both)
    assert err.value.holes == [
        ("b", (0, 0), SHAPE, (0, 1)),
        ("w", (0, 0), (4, 4), (0,)),
        ("w", (4, 0), (4, 4), (1,)),
    ]


def test_assign_spreads_consumers_and_checks_fit_first() -> None:
    solo = _layout("R1", 0, _rec("w", 0, (0, 0), SHAPE), _rec("b", 0, (0, 0), SHAPE))
    groups = source_groups(_version(replicas={"c1": ("solo", solo)}))
    assert set(groups) == {PUBLISHERS, "g:solo"}
    dests = _bufs(w=torch.zeros(SHAPE))
    chosen = {next(iter(assign(groups, dests, rotation))) for rotation in range(4)}
    assert chosen == {PUBLISHERS, "g:solo"}  # consumers with other rotations use other groups
    with pytest.raises(LayoutError, match=r"'w'.*global shape"):
        assign(groups, _bufs(w=Shard(torch.zeros(2, 4), (0, 0), (9, 4))), 0)
    with pytest.raises(LayoutError, match=r"'w'.*not a float conversion"):
        assign(groups, _bufs(w=torch.zeros(SHAPE, dtype=torch.int32)), 0)
    with pytest.raises(LayoutError, match=r"'nope' is not in"):
        assign(groups, _bufs(nope=torch.zeros(SHAPE)), 0)


def test_failover_tries_other_groups_then_the_publishers_alone() -> None:
    solo = _layout("R1", 0, _rec("w", 0, (0, 0), SHAPE))
    groups = source_groups(_version(replicas={"c1": ("solo", solo)}))
    only_w = failover_order(groups, _bufs(w=torch.zeros(SHAPE)))
    assert [sorted(gs) for gs in only_w] == [["g:solo", PUBLISHERS], ["g:solo"], [PUBLISHERS]]
    # "b" has no re-serving source: the replicas-only set cannot serve this pull and is skipped.
    with_b = failover_order(groups, _bufs(w=torch.zeros(SHAPE), b=torch.zeros(SHAPE)))
    assert [sorted(gs) for gs in with_b] == [["g:solo", PUBLISHERS], [PUBLISHERS]]


def test_byte_spans_cover_the_pieces_the_buffers_may_read_per_region() -> None:
    def rec(
        name: str,
        sizes: tuple[int, ...],
        strides: tuple[int, ...],
        region: int,
        off: int,
        dtype: str = "float32",
        offsets: tuple[int, ...] | None = None,
    ) -> ShardRecord:
        box = Box(offsets or (0,) * len(sizes), sizes)
        return ShardRecord(name, dtype, (8, 8) if len(sizes) == 2 else sizes, box, strides, 0, region, off)

    def whole(*names: str, dtype: str = "float32") -> dict[str, list[tuple[Box, str]]]:
        return {n: [(Box((0, 0), (8, 8)), dtype)] for n in names}

    shards = [
        rec("a", (4, 8), (8, 1), 0, 1024),  # 128 bytes at 1024
        rec("b", (4, 8), (1, 4), 0, 4096),  # strided: last element at (3*1 + 7*4) -> 128 bytes
        rec("c", (2, 3), (3, 1), 1, 64, "bfloat16"),  # 12 bytes at 64 of region 1
        rec("d", (0, 5), (5, 1), 1, 0),  # empty: occupies nothing
        rec("e", (8, 8), (8, 1), 0, 1 << 20),
    ]  # 1 MiB further on
    # a and b lie closer than the merge gap: one run; e is a run of its own
    assert byte_spans(shards, [], whole("a", "b", "c", "d")) == [(0, 1024, 4096 + 128), (1, 64, 76)]
    assert byte_spans(shards, [], whole("a", "e")) == [(0, 1024, 1024 + 128), (0, 1 << 20, (1 << 20) + 256)]
    assert byte_spans(shards, [], whole("b")) == [(0, 4096, 4096 + 128)]
    assert byte_spans(shards, [], {}) == []
    # rows 1-2 of "a" only: from its first element to its last
    assert byte_spans(shards, [], {"a": [(Box((1, 0), (2, 8)), "float32")]}) == [(0, 1024 + 32, 1024 + 96)]
    # columns 4-7 of "e" (row-major): from (0, 4) to (7, 7)
    assert byte_spans(shards, [], {"e": [(Box((0, 4), (8, 4)), "float32")]}) == [
        (0, (1 << 20) + 16, (1 << 20) + 256)
    ]
    # a pre-packed copy of the wanted columns of "e" is read instead of the shard; the copy of
    # the other columns (another consumer's) is not read at all
    packed = [
        rec("e", (8, 4), (4, 1), 2, 0, offsets=(0, 4)),
        rec("e", (8, 4), (4, 1), 2, 1 << 20, offsets=(0, 0)),
    ]
    assert byte_spans(shards, packed, {"e": [(Box((0, 4), (8, 4)), "float32")]}) == [(2, 0, 128)]
    # a converted copy counts for a buffer of its dtype only
    conv = [rec("e", (8, 4), (4, 1), 2, 0, "bfloat16", offsets=(0, 4))]
    assert byte_spans(shards, conv, {"e": [(Box((0, 4), (8, 4)), "bfloat16")]}) == [(2, 0, 64)]
    assert byte_spans(shards, conv, {"e": [(Box((0, 4), (8, 4)), "float16")]}) == [
        (0, (1 << 20) + 16, (1 << 20) + 256)
    ]
    # the same shards column-wise (``Layout.columns``, as decoded from records): the same runs,
    # and no record built for a buffer that takes whole shards
    from astate_store.catalog.shard_tables import (
        layout_from_record,
        layout_record,
        manifest_from_record,
        manifest_record,
    )

    man = manifest_record(shards)
    lay = layout_record(1, 0, man, shards, b"")
    back = layout_from_record(lay, manifest_from_record(man, man["manifest_id"]), key_id=lay["layout_id"])
    for want in (
        whole("a", "b", "c", "d"),
        whole("a", "e"),
        whole("b"),
        {},
        {"a": [(Box((1, 0), (2, 8)), "float32")]},
        {**whole("a"), "e": [(Box((0, 4), (8, 4)), "float32")]},
    ):
        assert byte_spans(back.shards, [], want, back.columns) == byte_spans(shards, [], want), want
    assert byte_spans(
        back.shards, packed, {**whole("a"), "e": [(Box((0, 4), (8, 4)), "float32")]}, back.columns
    ) == [(0, 1024, 1024 + 128), (2, 0, 128)]
    fresh = layout_from_record(lay, manifest_from_record(man, man["manifest_id"]), key_id=lay["layout_id"])
    assert byte_spans(fresh.shards, [], whole("a", "e"), fresh.columns) == byte_spans(
        shards, [], whole("a", "e")
    )
    assert "built" not in repr(fresh.shards)  # whole shards only: the records were never needed


def test_read_spans_per_peer_and_region() -> None:
    import numpy as np

    ops = np.array([[0, 1, 100, 0, 10], [1, 0, 0, 0, 5], [0, 1, 40, 0, 20], [0, 2, 8, 0, 8]], dtype=np.int64)
    assert read_spans(ops) == {0: [(1, 40, 110), (2, 8, 16)], 1: [(0, 0, 5)]}
    far = np.array([[0, 1, 1 << 20, 0, 8]], dtype=np.int64)  # past the merge gap: a run of its own
    assert read_spans(np.concatenate([ops, far])) == {
        0: [(1, 40, 110), (1, 1 << 20, (1 << 20) + 8), (2, 8, 16)],
        1: [(0, 0, 5)],
    }
    assert read_spans(ops[:0]) == {}

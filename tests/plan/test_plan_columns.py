"""The first pull's column planner (``plan.columns.whole_buffer_reads``) against the bytes: layouts
decoded from real records, the reads executed into byte arrays, every buffer byte-exact and
written once; the cases it leaves to the general planner return None."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astate_store.catalog.shard_tables import (
    layout_from_record,
    layout_record,
    manifest_from_record,
    manifest_record,
)
from astate_store.model.dtypes import DTYPE_CODES
from astate_store.model.layout import Box, ShardColumns, ShardRecord, contiguous_strides
from astate_store.plan._planner.columns import whole_buffer_reads

ITEM = {"float32": 4, "int8": 1, "bfloat16": 2}


def _columns(recs: list[ShardRecord]) -> ShardColumns:
    """A rank's shards through the records a publisher writes and a consumer decodes."""
    man = manifest_record(recs)
    lay = layout_record(1, recs[0].rank if recs else 0, man, recs, b"")
    out = layout_from_record(
        lay, manifest_from_record(man, man["manifest_id"]), key_id=lay["layout_id"]
    ).columns
    assert out is not None
    return out


@st.composite
def published(
    draw: st.DrawFn,
) -> tuple[dict[str, tuple[tuple[int, ...], str]], list[list[ShardRecord]], bool]:
    """Tensors (name -> shape, dtype) and each of ``ranks`` ranks' shards: every tensor whole on
    some ranks (replicas) or split along one dim over the ranks, optionally replicated; True when
    all of it is the simple case (row-major ranges: splits along the first dim wider than 1)."""
    ranks = draw(st.integers(1, 3))
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    shards: list[list[tuple[str, Box]]] = [[] for _ in range(ranks)]
    simple = True
    for i in range(draw(st.integers(1, 6))):
        name = f"t{i}.w"
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
        tensors[name] = (shape, draw(st.sampled_from(sorted(ITEM))))
        if not shape or draw(st.booleans()):  # whole, on one or more ranks
            holders = draw(st.lists(st.integers(0, ranks - 1), min_size=1, max_size=ranks, unique=True))
            for r in holders:
                shards[r].append((name, Box((0,) * len(shape), shape)))
            continue
        k = draw(st.integers(0, len(shape) - 1))
        cuts = (
            sorted(set(draw(st.lists(st.integers(1, max(shape[k] - 1, 1)), max_size=2))))
            if shape[k] > 1
            else []
        )
        pts = [0, *[c for c in cuts if c < shape[k]], shape[k]]
        parts = list(zip(pts, pts[1:]))
        if len(parts) > 1 and any(n > 1 for n in shape[:k]):
            simple = False  # strided in the row-major buffer
        copies = draw(st.integers(1, 2))
        for j, (a, b) in enumerate(parts):
            for c in range(copies):
                offs = tuple(a if d == k else 0 for d in range(len(shape)))
                sizes = tuple(b - a if d == k else n for d, n in enumerate(shape))
                shards[(j + c) % ranks].append((name, Box(offs, sizes)))
    recs: list[list[ShardRecord]] = []
    for r, boxes in enumerate(shards):
        off, mine = 64 * r, []  # each rank's region starts elsewhere
        for name, box in boxes:
            shape, dtype = tensors[name]
            mine.append(ShardRecord(name, dtype, shape, box, contiguous_strides(box.sizes), r, 0, off))
            off += max(box.numel, 1) * ITEM[dtype] + 8
        recs.append(mine)
    return tensors, recs, simple


def _reference(tensors: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        n: rng.integers(0, 256, size=(int(np.prod(shape)) * ITEM[dt],), dtype=np.uint8).reshape(
            (*shape, ITEM[dt])
        )
        for n, (shape, dt) in tensors.items()
    }


def _regions(recs: list[list[ShardRecord]], ref: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each rank's region with its shards' bytes at their offsets (row-major boxes)."""
    out = []
    for mine in recs:
        mem = np.zeros(
            1 + max((r.byte_offset + max(r.box.numel, 1) * ITEM[r.dtype] for r in mine), default=0), np.uint8
        )
        for r in mine:
            piece = ref[r.name][tuple(slice(o, o + z) for o, z in zip(r.box.offsets, r.box.sizes))]
            mem[r.byte_offset : r.byte_offset + piece.size] = piece.reshape(-1)
        out.append(mem)
    return out


@settings(max_examples=150, deadline=None)
@given(published(), st.integers(0, 5))
def test_simple_layouts_are_read_byte_exact_each_byte_once(case, rotation: int) -> None:
    tensors, recs, simple = case
    ref = _reference(tensors)
    names = sorted(tensors)
    reads = whole_buffer_reads(
        [_columns(m) for m in recs],
        names,
        np.array([DTYPE_CODES[tensors[n][1]] for n in names]),
        [tensors[n][0] for n in names],
        rotation,
    )
    if not simple:
        assert reads is None
        return
    assert reads is not None
    regions = _regions(recs, ref)
    bufs = [np.zeros(ref[n].size, np.uint8) for n in names]
    written = [np.zeros(ref[n].size, np.int64) for n in names]
    for src, region, s_off, b, d_off, length in reads.tolist():
        assert region == 0 and length > 0
        bufs[b][d_off : d_off + length] = regions[src][s_off : s_off + length]
        written[b][d_off : d_off + length] += 1
    for i, n in enumerate(names):
        assert (written[i] == 1).all(), n  # every byte once
        assert bytes(bufs[i]) == bytes(ref[n].reshape(-1)), n


def test_dp_replicas_share_the_reads() -> None:
    """Every tensor split in two on dim 0, each half on two DP ranks (0, 2 and 1, 3): each half's
    reads alternate between its two holders, whatever the rotation."""
    recs: list[list[ShardRecord]] = [[], [], [], []]
    for i in range(6):
        for half in range(2):
            for r in (half, half + 2):
                recs[r].append(
                    ShardRecord(f"t{i}", "float32", (8,), Box((4 * half,), (4,)), (1,), r, 0, 16 * i)
                )
    cols = [_columns(m) for m in recs]
    names = [f"t{i}" for i in range(6)]
    for rotation in range(3):
        reads = whole_buffer_reads(cols, names, np.full(6, DTYPE_CODES["float32"]), [(8,)] * 6, rotation)
        assert reads is not None
        assert np.bincount(reads[:, 0], minlength=4).tolist() == [3, 3, 3, 3], rotation


def test_replicas_spread_by_rotation_and_sources_interleave() -> None:
    """Four tensors whole on both ranks: rotation 0 reads them from ranks 0, 1, 0, 1, rotation 1
    from 1, 0, 1, 0; the rows alternate between the ranks."""
    recs = [
        [ShardRecord(f"t{i}", "float32", (4,), Box((0,), (4,)), (1,), r, 0, 16 * i) for i in range(4)]
        for r in range(2)
    ]
    cols = [_columns(m) for m in recs]
    names = [f"t{i}" for i in range(4)]
    args = (names, np.full(4, DTYPE_CODES["float32"]), [(4,)] * 4)
    for rotation, want in ((0, [0, 1, 0, 1]), (1, [1, 0, 1, 0])):
        reads = whole_buffer_reads(cols, *args, rotation)  # type: ignore[arg-type]
        assert reads is not None
        by_buffer = dict(zip(reads[:, 3].tolist(), reads[:, 0].tolist()))
        assert [by_buffer[i] for i in range(4)] == want
        assert reads[:, 0].tolist() in ([0, 1, 0, 1], [1, 0, 1, 0])


@pytest.mark.parametrize("why", ["dtype", "shape", "missing", "strided_shard", "gap"])
def test_what_it_leaves_to_the_planner(why: str) -> None:
    """Another dtype (a conversion), another shape, a buffer no source holds, a shard that is not
    dense, a gap in the tiling: None, so the general planner decides and names the problem."""
    shape, dtype, names = (8, 4), "float32", ["w"]
    recs = [
        ShardRecord("w", "float32", (8, 4), Box((0, 0), (4, 4)), (4, 1), 0, 0, 0),
        ShardRecord("w", "float32", (8, 4), Box((4, 0), (4, 4)), (4, 1), 1, 0, 0),
    ]
    if why == "dtype":
        dtype = "bfloat16"
    elif why == "shape":
        shape = (4, 8)
    elif why == "missing":
        names = ["w", "x"]
    elif why == "strided_shard":
        recs[1] = ShardRecord("w", "float32", (8, 4), Box((4, 0), (4, 4)), (1, 4), 1, 0, 0)
    elif why == "gap":
        recs[1] = ShardRecord("w", "float32", (8, 4), Box((5, 0), (3, 4)), (4, 1), 1, 0, 0)
    cols = [_columns([r]) for r in recs]
    shapes = [shape] * len(names)
    assert whole_buffer_reads(cols, names, np.full(len(names), DTYPE_CODES[dtype]), shapes) is None
    if why == "dtype":  # the same layouts with the published dtype are the simple case
        assert whole_buffer_reads(cols, names, np.full(1, DTYPE_CODES["float32"]), shapes) is not None

"""Planner tests: property tests execute plans with plain byte copies and compare byte-exact."""

from __future__ import annotations

import itertools
import math
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astate_store.errors import PlanError
from astate_store.model.dtypes import DTYPE_CODES, DTYPE_NAMES, itemsize
from astate_store.model.layout import Box, ShardRecord, TensorLayout, contiguous_strides, merge_tensor_layout
from astate_store.plan import (
    COPY_DTYPE,
    READ_DTYPE,
    CostModel,
    Fabric,
    Placement,
    Planner,
    execute_reads,
    plan_consumer,
    plan_global,
)
from astate_store.plan._planner.shards import Sources

NOPACK = CostModel(prepack=False)
PROP = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------------------------
# Memory model helpers: a "placement" of a box = (strides, byte_offset) in a flat uint8 buffer.


def _addresses(box: Box, strides, byte_offset: int, isz: int) -> np.ndarray:
    """Byte address of element (box-local, row-major order) -> shape box.sizes."""
    if box.ndim == 0:
        return np.array(byte_offset, np.int64)
    idx = np.indices(box.sizes, dtype=np.int64) if box.numel else np.zeros((box.ndim,) + box.sizes, np.int64)
    return byte_offset + isz * np.tensordot(np.array(strides, np.int64), idx, axes=(0, 0))


def _layout_memory(sizes, rng, perm=None, pad=None):
    """Strides and span (elements) for a box stored permuted and/or inside a padded box."""
    nd = len(sizes)
    perm = list(range(nd)) if perm is None else perm
    pad = [0] * nd if pad is None else pad
    alloc = [sizes[d] + pad[d] for d in range(nd)]
    # memory order: perm[0] outermost
    strides = [0] * nd
    acc = 1
    for d in reversed(perm):
        strides[d] = acc
        acc *= max(alloc[d], 1)
    span = acc
    return tuple(strides), span


def _write_box(buf: torch.Tensor, gbytes: np.ndarray, box: Box, strides, off, isz):
    addrs = _addresses(box, strides, off, isz)
    sl = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
    vals = gbytes[sl] if box.ndim else gbytes
    a = buf.numpy()
    for b in range(isz):
        a[(addrs + b).reshape(-1)] = vals[..., b].reshape(-1)


def _read_box(buf: torch.Tensor, box: Box, strides, off, isz) -> np.ndarray:
    addrs = _addresses(box, strides, off, isz)
    a = buf.numpy()
    return np.stack([a[(addrs + b)] for b in range(isz)], axis=-1) if isz else a[addrs]


def execute_checked(reads, sources: dict, dests: dict):
    """Execute with byte copies while counting destination writes and marking source reads."""
    wcount = {k: np.zeros(len(v), np.int64) for k, v in dests.items()}
    rmask = {k: np.zeros(len(v), bool) for k, v in sources.items()}
    for r in reads:
        so, do, ln = int(r["src_offset"]), int(r["dst_offset"]), int(r["length"])
        key = (int(r["src_rank"]), int(r["src_region"]))
        dreg = int(r["dst_region"])
        sisz = itemsize(DTYPE_NAMES[int(r["src_dtype"])])
        disz = itemsize(DTYPE_NAMES[int(r["dst_dtype"])])
        dl = ln // sisz * disz
        assert so >= 0 and so + ln <= len(sources[key])
        assert do >= 0 and do + dl <= len(dests[dreg])
        rmask[key][so : so + ln] = True
        wcount[dreg][do : do + dl] += 1
    execute_reads(reads, sources, dests)
    return wcount, rmask


# ----------------------------------------------------------------------------------------------
# Scenario strategy

DT = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float64": torch.float64,
}
DTYPES = ["float32", "bfloat16", "float16", "int8", "int64", "uint8", "bool", "float8_e4m3fn", "int32"]


def _grid(sizes, cuts):
    """Boxes of a grid split: cuts[d] sorted interior cut points of dim d."""
    per_dim = []
    for d, n in enumerate(sizes):
        pts = [0] + sorted(set(c for c in cuts[d] if 0 < c < n)) + [n]
        per_dim.append([(a, b - a) for a, b in zip(pts[:-1], pts[1:]) if b > a] or [(0, n)])
    for combo in itertools.product(*per_dim):
        yield Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo))


@st.composite
def scenarios(draw):
    nd = draw(st.integers(0, 4))
    maxs = {0: 1, 1: 12, 2: 7, 3: 5, 4: 4}[nd]
    shape = tuple(draw(st.lists(st.integers(1, maxs), min_size=nd, max_size=nd)))
    if nd and draw(st.integers(0, 9)) == 0:
        shape = shape[:-1] + (0,)
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    src_cuts = [draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=2)) for n in shape]
    reps = draw(st.integers(1, 3))
    nranks = draw(st.integers(1, 4))
    n_cons = draw(st.integers(1, 3))
    cons = []
    for _ in range(n_cons):
        lo = tuple(draw(st.integers(0, max(n - 1, 0))) for n in shape)
        hi = tuple(draw(st.integers(l + 1, max(n, l + 1))) if n else 0 for l, n in zip(lo, shape))
        lo = tuple(min(l, n) for l, n in zip(lo, shape))
        sub = Box(lo, tuple(max(h - l, 0) for l, h in zip(lo, hi)))
        cuts = [draw(st.lists(st.integers(1, max(s - 1, 1)), max_size=2)) for s in sub.sizes]
        views = draw(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=1))
        cons.append((sub, cuts, views[0]))
    src_view = draw(st.tuples(st.booleans(), st.booleans()))
    return dict(
        shape=shape,
        dtype=dtype,
        seed=seed,
        src_cuts=src_cuts,
        reps=reps,
        nranks=nranks,
        cons=cons,
        src_view=src_view,
    )


def build(sc):
    """Materialize a scenario: layouts, source buffers, requests, destination buffers."""
    rng = np.random.default_rng(sc["seed"])
    shape, dtype = sc["shape"], sc["dtype"]
    isz = itemsize(dtype)
    nd = len(shape)
    if sc.get("float_values"):
        vals = torch.from_numpy(rng.standard_normal(size=shape).astype(np.float32)).to(DT[dtype])
        flat = vals.contiguous().reshape(-1).clone()
        gbytes = (
            flat.view(torch.uint8).numpy().reshape(shape + (isz,)).copy()
            if flat.numel()
            else np.zeros(shape + (isz,), np.uint8)
        )
        sc["_values"] = vals
    else:
        gbytes = rng.integers(0, 256, size=shape + (isz,), dtype=np.uint8)
    boxes = list(_grid(shape, sc["src_cuts"]))
    # source records: each (box, replica) on a rank, stored in one region per rank
    per_rank: dict = {}
    recs = []
    for r in range(sc["reps"]):
        for bi, box in enumerate(boxes):
            rank = (bi + r * 7) % sc["nranks"] + r * sc["nranks"]
            perm = list(rng.permutation(nd)) if sc["src_view"][0] else None
            pad = [int(x) for x in rng.integers(0, 3, size=nd)] if sc["src_view"][1] else None
            strides, span = _layout_memory(box.sizes, rng, perm, pad)
            start = per_rank.get(rank, 0) + int(rng.integers(0, 3)) * isz
            off = start
            per_rank[rank] = start + span * isz + isz
            rec = ShardRecord("t", dtype, shape, box, strides, rank, 0, off)
            recs.append(rec)
    sources = {(rk, 0): torch.zeros(n + 8, dtype=torch.uint8) for rk, n in per_rank.items()}
    for rec in recs:
        _write_box(sources[(rec.rank, 0)], gbytes, rec.box, rec.strides, rec.byte_offset, isz)
    layout = merge_tensor_layout("t", recs)
    requests = {}
    dests = {}
    for ci, (sub, cuts, (perm_v, pad_v)) in enumerate(sc["cons"]):
        drecs = []
        bufs = {}
        for k, box in enumerate(_grid(sub.sizes, cuts)):
            gbox = Box(tuple(o + s for o, s in zip(box.offsets, sub.offsets)), box.sizes)
            perm = list(rng.permutation(nd)) if perm_v else None
            pad = [int(x) for x in rng.integers(0, 3, size=nd)] if pad_v else None
            strides, span = _layout_memory(gbox.sizes, rng, perm, pad)
            off = int(rng.integers(0, 3)) * isz
            region = 10 + k
            bufs[region] = torch.zeros(off + span * isz + isz, dtype=torch.uint8)
            drecs.append(ShardRecord("t", dtype, shape, gbox, strides, ci, region, off))
        requests[ci] = tuple(drecs)
        dests[ci] = bufs
    return dict(
        gbytes=gbytes,
        layouts={"t": layout},
        sources=sources,
        requests=requests,
        dests=dests,
        isz=isz,
        recs=recs,
    )


def check_consumer(env, cid, reads, extra_recs=()):
    dests = env["dests"][cid]
    srcs = {k: v.clone() for k, v in env["sources"].items()}
    wcount, rmask = execute_checked(reads, srcs, dests)
    isz = env["isz"]
    # every destination element byte written exactly once, nothing else written
    for rec in env["requests"][cid]:
        addrs = _addresses(rec.box, rec.strides, rec.byte_offset, isz)
        got = _read_box(dests[rec.region], rec.box, rec.strides, rec.byte_offset, isz)
        sl = tuple(slice(o, o + s) for o, s in zip(rec.box.offsets, rec.box.sizes))
        want = env["gbytes"][sl] if rec.box.ndim else env["gbytes"]
        assert np.array_equal(got, want)
        for b in range(isz):
            assert (wcount[rec.region][(addrs + b).reshape(-1)] == 1).all()
            wcount[rec.region][(addrs + b).reshape(-1)] = 0
    for reg, wc in wcount.items():
        assert (wc == 0).all(), "bytes outside the destination boxes were written"
    # nothing outside the intersections read
    allowed = {k: np.zeros(len(v), bool) for k, v in srcs.items()}
    for srec in list(env["recs"]) + list(extra_recs):
        for rec in env["requests"][cid]:
            inter = srec.box.intersect(rec.box) if srec.box.ndim else srec.box
            if inter is None or inter.numel == 0:
                continue
            base = srec.byte_offset + isz * sum(
                (a - b) * s for a, b, s in zip(inter.offsets, srec.box.offsets, srec.strides)
            )
            addrs = _addresses(inter, srec.strides, base, isz)
            for b in range(isz):
                allowed[(srec.rank, srec.region)][(addrs + b).reshape(-1)] = True
    for k in rmask:
        assert not (rmask[k] & ~allowed[k]).any(), "read bytes outside the consumer's boxes"
    return wcount


# ----------------------------------------------------------------------------------------------
# Property tests


@PROP
@given(scenarios(), st.sampled_from(["greedy", "rotation"]), st.booleans())
def test_random_layouts_execute_byte_exact(sc, balance, pack):
    env = build(sc)
    cost = CostModel() if pack else NOPACK
    gp = plan_global(env["layouts"], env["requests"], balance=balance, cost=cost)
    total = 0
    for cid in env["requests"]:
        reads = gp.reads(cid)
        assert reads.dtype == READ_DTYPE
        assert not reads["convert"].any()
        assert len(reads) == gp.read_count(cid)
        check_consumer(env, cid, reads)
        total += int(reads["length"].sum())
    assert total == gp.total_bytes == sum(r.nbytes for rs in env["requests"].values() for r in rs)


@PROP
@given(scenarios())
def test_prepack_round_trip(sc):
    env = build(sc)
    cost = CostModel(per_read_seconds=1e-3)  # pack eagerly
    gp = plan_global(env["layouts"], env["requests"], cost=cost)
    items = gp.pack_items()
    packed = []
    sources = env["sources"]
    for rank, its in items.items():
        nbytes = sum(it.nbytes for it in its)
        buf = torch.zeros(nbytes + 8, dtype=torch.uint8)
        off = 0
        for it in its:
            assert it.source.rank == rank and it.consumers
            runs = it.copy_runs()
            assert runs.dtype == COPY_DTYPE and int(runs["length"].sum()) == it.nbytes
            sbuf = sources[(rank, it.source.region)]
            for r in runs:
                a, b, n = int(r["src_offset"]), int(r["dst_offset"]), int(r["length"])
                buf[off + b : off + b + n] = sbuf[a : a + n]
            packed.append(it.packed(region=99, byte_offset=off))
            off += it.nbytes
        sources[(rank, 99)] = buf
    gp2 = plan_global(env["layouts"], env["requests"], cost=cost, packed=packed)
    assert gp2.stale_packed == 0
    assert not gp2.pack_items(), "steady state should need no further packing"
    for cid in env["requests"]:
        reads = gp2.reads(cid)
        assert gp2.read_count(cid) <= gp.read_count(cid)
        check_consumer(env, cid, reads, [p.record for p in packed])
    used = {(int(r["src_rank"]), int(r["src_region"])) for c in env["requests"] for r in gp2.reads(c)}
    if packed:
        assert any(reg == 99 for _, reg in used)


@PROP
@given(scenarios())
def test_rotation_global_equals_local(sc):
    env = build(sc)
    reqs = env["requests"]
    rot = {c: (c * 5 + 1) % 4 for c in reqs}
    gp = plan_global(env["layouts"], reqs, balance="rotation", rotations=rot, staggers={c: c for c in reqs})
    for c in reqs:
        cp = plan_consumer(env["layouts"], reqs[c], consumer=c, rotation=rot[c], stagger=c)
        assert np.array_equal(cp.reads, gp.reads(c))


@settings(max_examples=25, deadline=None)
@given(scenarios())
def test_deterministic(sc):
    env = build(sc)
    a = plan_global(env["layouts"], env["requests"])
    rev = dict(reversed(list(env["requests"].items())))
    b = plan_global(dict(env["layouts"]), rev)
    for c in env["requests"]:
        assert np.array_equal(a.reads(c), b.reads(c))
    assert a.pack_items() == b.pack_items()


# ----------------------------------------------------------------------------------------------
# Unit tests: layouts


def _contig_shards(name, dtype, shape, boxes, ranks, region=0, offsets=None):
    return [
        ShardRecord(
            name,
            dtype,
            shape,
            b,
            contiguous_strides(b.sizes),
            r,
            region,
            0 if offsets is None else offsets[i],
        )
        for i, (b, r) in enumerate(zip(boxes, ranks))
    ]


def _rows(shape, k, dim=0):
    n = shape[dim]
    step = math.ceil(n / k)
    out = []
    for i in range(0, n, step):
        off = [0] * len(shape)
        sz = list(shape)
        off[dim] = i
        sz[dim] = min(step, n - i)
        out.append(Box(tuple(off), tuple(sz)))
    return out


def _dest(name, dtype, shape, box, region=0, off=0, strides=None):
    return ShardRecord(name, dtype, shape, box, strides or contiguous_strides(box.sizes), 0, region, off)


def test_row_parallel_one_read_per_shard():
    shape = (64, 32)
    boxes = _rows(shape, 4)
    lay = merge_tensor_layout("w", _contig_shards("w", "bfloat16", shape, boxes, range(4)))
    whole = _dest("w", "bfloat16", shape, Box((0, 0), shape))
    gp = plan_global({"w": lay}, {0: [whole]})
    r = gp.reads(0)
    assert len(r) == 4
    assert sorted(r["src_rank"].tolist()) == [0, 1, 2, 3]
    assert (r["length"] == 16 * 32 * 2).all()
    # a rollout TP split by rows at other cut points: one read per overlapping shard
    part = _dest("w", "bfloat16", shape, Box((8, 0), (40, 32)))
    assert plan_global({"w": lay}, {0: [part]}).read_count(0) == 3


def test_whole_tensor_one_read_and_zero_d_and_one_d():
    lay = merge_tensor_layout(
        "w", _contig_shards("w", "float32", (5, 6, 7), [Box((0, 0, 0), (5, 6, 7))], [3])
    )
    gp = plan_global({"w": lay}, {0: [_dest("w", "float32", (5, 6, 7), Box((0, 0, 0), (5, 6, 7)), 4, 16)]})
    r = gp.reads(0)
    assert (
        len(r) == 1
        and r["length"][0] == 5 * 6 * 7 * 4
        and r["dst_offset"][0] == 16
        and r["dst_region"][0] == 4
    )
    s = merge_tensor_layout("s", [ShardRecord("s", "int64", (), Box((), ()), (), 1, 2, 8)])
    r = plan_global({"s": s}, {"c": [ShardRecord("s", "int64", (), Box((), ()), (), 0, 0, 24)]}).reads("c")
    assert (
        r.tolist()
        == np.array(
            [(8, 24, 8, 1, 2, 0, 0, 0, DTYPE_CODES["int64"], DTYPE_CODES["int64"], False)], READ_DTYPE
        ).tolist()
    )
    v = merge_tensor_layout(
        "v", _contig_shards("v", "uint8", (10,), [Box((0,), (3,)), Box((3,), (7,))], [0, 1])
    )
    r = plan_global({"v": v}, {0: [_dest("v", "uint8", (10,), Box((2,), (6,)))]}).reads(0)
    assert sorted(r[["src_rank", "src_offset", "length", "dst_offset"]].tolist()) == [
        (0, 2, 1, 0),
        (1, 0, 5, 1),
    ]


def _calls(fn) -> int:
    """Python and builtin calls ``fn()`` makes (what grows when work runs row by row in Python)."""
    n = 0

    def count(frame, event, arg) -> None:
        nonlocal n
        n += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def _column_slice(rows: int):
    shape = (rows, 256)
    lay = merge_tensor_layout("w", _contig_shards("w", "bfloat16", shape, [Box((0, 0), shape)], [0]))
    return lay, _dest("w", "bfloat16", shape, Box((0, 64), (rows, 64)))


def test_column_slice_is_vectorized_runs():
    """A column slice is one run per row, made by array operations: four times the rows take no
    more calls (the planning time of model-scale plans is benchmarks/plan_scale.py's figure)."""
    rows = 7168
    lay, d = _column_slice(rows)
    r = plan_global({"w": lay}, {0: [d]}, cost=NOPACK).reads(0)
    assert len(r) == rows and (r["length"] == 128).all()
    small, big = _column_slice(rows), _column_slice(4 * rows)
    calls = [
        _calls(lambda a=a: plan_global({"w": a[0]}, {0: [a[1]]}, cost=NOPACK).reads(0)) for a in (small, big)
    ]
    assert calls[1] - calls[0] < 50, calls  # no call per row
    assert np.array_equal(r["src_offset"], np.sort(r["src_offset"]))
    assert (np.diff(r["src_offset"]) == 512).all() and (np.diff(r["dst_offset"]) == 128).all()
    # with the default cost model the slice is pre-packed instead
    items = plan_global({"w": lay}, {0: [d]}).pack_items()
    assert len(items[0]) == 1 and items[0][0].box == Box((0, 64), (rows, 64))


def test_column_parallel_and_coalescing_inner_dims():
    # source split on dim1 (column-parallel), destination whole: one run per row per shard
    shape = (4, 8, 6)
    boxes = _rows(shape, 2, dim=1)
    lay = merge_tensor_layout("w", _contig_shards("w", "float16", shape, boxes, [0, 1]))
    gp = plan_global({"w": lay}, {0: [_dest("w", "float16", shape, Box((0, 0, 0), shape))]}, cost=NOPACK)
    r = gp.reads(0)
    assert len(r) == 8 and (r["length"] == 4 * 6 * 2).all()
    # destination split the same way: each piece is one read
    gp = plan_global({"w": lay}, {0: [_dest("w", "float16", shape, b) for b in boxes]})
    assert gp.read_count(0) == 2


def test_moe_experts_split_on_e_and_inside():
    E, O, I = 8, 6, 4
    shape = (E, O, I)
    # trainer: EP=2 on experts, TP=2 on out inside each expert
    boxes, ranks = [], []
    for e in range(2):
        for t in range(2):
            boxes.append(Box((e * 4, t * 3, 0), (4, 3, I)))
            ranks.append(e * 2 + t)
    recs = _contig_shards("x", "bfloat16", shape, boxes, ranks)
    lay = merge_tensor_layout("x", recs)
    # rollout: TP=3 on out (2 rows each) inside every expert
    dst = {k: [_dest("x", "bfloat16", shape, Box((0, 2 * k, 0), (E, 2, I)))] for k in range(3)}
    gp = plan_global({"x": lay}, dst, cost=NOPACK)
    # rank 1 (out rows 2..3) straddles the trainer TP cut: per EP shard 2 pieces, each 4 runs
    assert gp.read_count(0) == 2 * 4 and gp.read_count(1) == 2 * 2 * 4 and gp.read_count(2) == 2 * 4
    assert gp.total_bytes == E * O * I * 2


def test_strided_destination_transposed_view():
    shape = (6, 5)
    lay = merge_tensor_layout("w", _contig_shards("w", "float32", shape, _rows(shape, 2), [0, 1]))
    # destination stores the whole tensor transposed (column-major)
    d = _dest("w", "float32", shape, Box((0, 0), shape), strides=(1, 6))
    gp = plan_global({"w": lay}, {0: [d]}, cost=NOPACK)
    assert gp.read_count(0) == 30  # no two elements consecutive in both memories
    src = torch.arange(30, dtype=torch.float32)
    sources = {(0, 0): src[:15].clone().view(torch.uint8), (1, 0): src[15:].clone().view(torch.uint8)}
    out = torch.zeros(30 * 4, dtype=torch.uint8)
    execute_reads(gp.reads(0), sources, {0: out})
    assert torch.equal(out.view(torch.float32).view(5, 6).t(), src.view(6, 5))


def test_conversion_flag_and_values():
    shape = (4, 6)
    lay = merge_tensor_layout("w", _contig_shards("w", "float32", shape, _rows(shape, 2), [0, 1]))
    vals = torch.randn(shape)
    sources = {
        (0, 0): vals[:2].contiguous().view(-1).view(torch.uint8).clone(),
        (1, 0): vals[2:].contiguous().view(-1).view(torch.uint8).clone(),
    }
    for dt, tdt in [
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("float8_e4m3fn", torch.float8_e4m3fn),
    ]:
        d = _dest("w", dt, shape, Box((0, 0), shape))
        gp = plan_global({"w": lay}, {0: [d]})
        r = gp.reads(0)
        assert r["convert"].all() and (r["length"] == 2 * 6 * 4).all()  # source bytes
        assert (r["src_dtype"] == DTYPE_CODES["float32"]).all()
        assert (r["dst_dtype"] == DTYPE_CODES[dt]).all()
        out = torch.zeros(24 * itemsize(dt), dtype=torch.uint8)
        execute_reads(r, sources, {0: out})
        assert torch.equal(out.view(tdt).view(shape).float(), vals.to(tdt).float())


@pytest.mark.parametrize(
    "src,dst",
    [("float32", "int32"), ("int32", "float32"), ("int8", "int32"), ("bool", "uint8"), ("uint8", "int8")],
)
def test_forbidden_conversion(src, dst):
    shape = (4,)
    lay = merge_tensor_layout("conv.w", _contig_shards("conv.w", src, shape, [Box((0,), shape)], [0]))
    with pytest.raises(PlanError, match="conv.w"):
        plan_global({"conv.w": lay}, {0: [_dest("conv.w", dst, shape, Box((0,), shape))]})


def test_errors_name_the_tensor():
    shape = (4, 4)
    lay = merge_tensor_layout("a.w", _contig_shards("a.w", "float32", shape, [Box((0, 0), shape)], [0]))
    L = {"a.w": lay}
    with pytest.raises(PlanError, match="b.w"):
        plan_global(L, {0: [_dest("b.w", "float32", shape, Box((0, 0), shape))]})
    with pytest.raises(PlanError, match="a.w.*out of bounds"):
        plan_global(L, {0: [_dest("a.w", "float32", shape, Box((2, 0), (3, 4)))]})
    with pytest.raises(PlanError, match="a.w.*ndim"):
        plan_global(L, {0: [ShardRecord("a.w", "float32", shape, Box((0,), (4,)), (1,), 0, 0, 0)]})
    with pytest.raises(PlanError, match="a.w.*global shape"):
        plan_global(L, {0: [ShardRecord("a.w", "float32", (4, 5), Box((0, 0), shape), (4, 1), 0, 0, 0)]})
    with pytest.raises(PlanError, match="a.w.*overlap"):
        plan_global(L, {0: [_dest("a.w", "float32", shape, Box((0, 0), shape), strides=(1, 1))]})
    # partial layout: only the first half of the rows is published
    from astate_store.model.layout import TensorLayout

    half = TensorLayout(
        "p.w", "float32", (4, 4), tuple(_contig_shards("p.w", "float32", (4, 4), [Box((0, 0), (2, 4))], [0]))
    )
    with pytest.raises(PlanError, match="p.w.*not covered"):
        plan_global({"p.w": half}, {0: [_dest("p.w", "float32", (4, 4), Box((1, 0), (2, 4)))]})
    # covered part of a partial layout plans fine
    assert (
        plan_global({"p.w": half}, {0: [_dest("p.w", "float32", (4, 4), Box((0, 0), (2, 4)))]}).read_count(0)
        == 1
    )
    # layout whose shards disagree on dtype
    bad = TensorLayout(
        "q.w", "float32", (4,), (ShardRecord("q.w", "float16", (4,), Box((0,), (4,)), (1,), 0, 0, 0),)
    )
    with pytest.raises(PlanError, match="q.w"):
        plan_global({"q.w": bad}, {0: [_dest("q.w", "float32", (4,), Box((0,), (4,)))]})


# ----------------------------------------------------------------------------------------------
# Balancing, topology, order, cache


def _replicated(name, shape, boxes, R, dtype="bfloat16"):
    recs = []
    for r in range(R):
        recs += _contig_shards(name, dtype, shape, boxes, [r * len(boxes) + i for i in range(len(boxes))])
    return merge_tensor_layout(name, recs)


@pytest.mark.parametrize("R,C", [(2, 7), (3, 16), (4, 9), (8, 16)])
def test_balance_bound_over_replicas(R, C):
    layouts = {}
    reqs = {c: [] for c in range(C)}
    rng = np.random.default_rng(R * 100 + C)
    for i in range(12):
        shape = (int(rng.integers(8, 64)), 16)
        nm = f"t{i}"
        layouts[nm] = _replicated(nm, shape, [Box((0, 0), shape)], R)
        for c in range(C):
            reqs[c].append(_dest(nm, "bfloat16", shape, Box((0, 0), shape), off=0))
    gp = plan_global(layouts, reqs)
    sb = gp.src_bytes()
    total = gp.total_bytes
    largest = max(lay.nbytes for lay in layouts.values())
    assert sum(sb.values()) == total
    assert max(sb.values()) <= total / R + largest
    assert len(sb) == R


def test_rotation_balances_independent_consumers():
    shape = (64, 64)
    R = 8
    lay = _replicated("w", shape, _rows(shape, 4), R)
    req = tuple(_dest("w", "bfloat16", shape, b) for b in _rows(shape, 2))
    loads: dict = {}
    for m in range(16):
        cp = plan_consumer({"w": lay}, req, consumer=m, rotation=m)
        for rk, b in cp.src_bytes.items():
            loads[rk] = loads.get(rk, 0) + b
    assert len(loads) == 4 * R
    assert max(loads.values()) == min(loads.values())


def test_not_everyone_reads_rank_zero_and_order_staggered():
    shape = (32, 32)
    R = 4
    lay = _replicated("w", shape, _rows(shape, 4), R)
    reqs = {c: (_dest("w", "bfloat16", shape, Box((0, 0), shape)),) for c in range(8)}
    gp = plan_global({"w": lay}, reqs)
    sb = gp.src_bytes()
    assert len(sb) == 16 and max(sb.values()) == min(sb.values())
    firsts = [int(gp.reads(c)["src_rank"][0]) for c in reqs]
    assert len(set(firsts)) > 1


def test_topology_prefers_same_host_then_rail():
    shape = (16, 16)
    lay = _replicated("w", shape, [Box((0, 0), shape)], 3)  # ranks 0, 1, 2
    topo = Fabric(
        sources={0: Placement("h0", nic="r0"), 1: Placement("h1", nic="r1"), 2: Placement("h2", nic="r0")},
        consumers={
            "a": Placement("h1", nic="r0"),
            "b": Placement("h9", nic="r0"),
            "c": Placement("h9", nic="r5"),
        },
    )
    req = (_dest("w", "bfloat16", shape, Box((0, 0), shape)),)
    gp = plan_global({"w": lay}, {"a": req, "b": req, "c": req}, topology=topo)
    assert set(gp.reads("a")["src_rank"].tolist()) == {1}  # same host wins over same rail
    assert set(gp.reads("b")["src_rank"].tolist()) <= {0, 2}  # same rail
    for rot in range(4):
        cp = plan_consumer({"w": lay}, req, consumer="b", rotation=rot, topology=topo)
        assert set(cp.reads["src_rank"].tolist()) <= {0, 2}


def test_cache_hits_and_misses():
    shape = (16, 8)
    lay = _replicated("w", shape, _rows(shape, 2), 2)
    reqs = {c: (_dest("w", "bfloat16", shape, Box((0, 0), shape)),) for c in range(3)}
    pl = Planner()
    a = pl.plan({"w": lay}, reqs)
    b = pl.plan({"w": lay}, reqs)
    assert a is b and pl.hits == 1 and pl.misses == 1
    # equal but distinct input objects hit too
    lay2 = merge_tensor_layout("w", list(lay.shards))
    c = pl.plan({"w": lay2}, {k: tuple(v) for k, v in reqs.items()})
    assert c is a and pl.hits == 2
    # a changed layout misses
    moved = [
        ShardRecord(s.name, s.dtype, s.global_shape, s.box, s.strides, s.rank, s.region, s.byte_offset + 64)
        for s in lay.shards
    ]
    pl.plan({"w": merge_tensor_layout("w", moved)}, reqs)
    assert pl.misses == 2
    # caller-provided version key skips fingerprinting
    pl.plan({"w": lay}, reqs, key=("v1", 0))
    pl.plan({"w": lay}, reqs, key=("v1", 0))
    assert pl.hits == 3
    cp1 = pl.plan_consumer({"w": lay}, reqs[0], consumer=0, rotation=1)
    cp2 = pl.plan_consumer({"w": lay}, reqs[0], consumer=0, rotation=1)
    assert cp1 is cp2 and pl.hits == 4
    # the data path's call: a consumer plan under a caller key, its reads reused on a hit
    r1 = pl.plan_consumer({"w": lay}, reqs[0], key=("v2", reqs[0])).reads
    r2 = pl.plan_consumer({"w": lay}, reqs[0], key=("v2", reqs[0])).reads
    assert r1 is r2 and r1.dtype == READ_DTYPE and pl.hits == 5 and pl.misses == 5


def test_merges_runs_across_tensors_in_flat_buffers():
    # publisher and consumer both keep tensors back to back in one region: one read in total
    shapes = [(4, 8), (16,), (2, 3, 4)]
    layouts, dreq = {}, []
    off = 0
    for i, sh in enumerate(shapes):
        nm = f"p{i}"
        box = Box((0,) * len(sh), sh)
        layouts[nm] = merge_tensor_layout(
            nm, [ShardRecord(nm, "float32", sh, box, contiguous_strides(sh), 0, 0, off)]
        )
        dreq.append(ShardRecord(nm, "float32", sh, box, contiguous_strides(sh), 0, 5, off + 100))
        off += box.numel * 4
    gp = plan_global(layouts, {0: dreq})
    r = gp.reads(0)
    assert len(r) == 1 and r["length"][0] == off and r["dst_offset"][0] == 100


def test_packed_mapping_form_and_plan_consumer():
    rows = 512
    shape = (rows, 64)
    lay = merge_tensor_layout("w", _contig_shards("w", "bfloat16", shape, [Box((0, 0), shape)], [0]))
    d = (_dest("w", "bfloat16", shape, Box((0, 16), (rows, 16))),)
    cp = plan_consumer({"w": lay}, d, consumer=7)
    assert len(cp.pack_items) == 1 and cp.read_count == rows
    it = cp.pack_items[0]
    assert it.consumers == (7,) and it.nbytes == rows * 16 * 2
    rec = it.packed_record(region=3, byte_offset=128)
    cp2 = plan_consumer({"w": lay}, d, consumer=7, packed=[rec])
    assert cp2.read_count == 1 and cp2.reads["src_region"][0] == 3 and cp2.reads["src_offset"][0] == 128
    assert not cp2.pack_items
    gp = plan_global({"w": lay}, {7: d}, packed={7: [rec]})
    assert np.array_equal(gp.reads(7), cp2.reads)
    # a packed record for a box the consumer no longer needs is ignored
    gp = plan_global(
        {"w": lay}, {7: (_dest("w", "bfloat16", shape, Box((0, 0), (rows, 16))),)}, packed={7: [rec]}
    )
    assert gp.stale_packed == 1


def test_scale_many_tensors_fast():
    # 2000 tensors, 64 replicated shards each, 32 consumers: planning stays well under a second
    layouts, reqs = {}, {c: [] for c in range(32)}
    shape = (256, 128)
    boxes = _rows(shape, 8)
    for i in range(300):
        nm = f"l{i}"
        layouts[nm] = _replicated(nm, shape, boxes, 4)
    for c in range(32):
        reqs[c] = tuple(_dest(nm, "bfloat16", shape, _rows(shape, 16)[c % 16]) for nm in layouts)
    t = time.perf_counter()
    gp = plan_global(layouts, reqs)
    el = time.perf_counter() - t
    assert el < 2.0
    assert gp.total_reads == 32 * 300


def test_topology_greedy_many_replicas_and_balance():
    # 70 replicas (more than fit a 62-bit candidate mask) on 10 hosts; consumers on 5 of them
    shape = (8, 8)
    R = 70
    lay = _replicated("w", shape, [Box((0, 0), shape)], R)
    src = {r: Placement(f"h{r % 10}", nic=f"rail{r % 7}") for r in range(R)}
    cons = {c: Placement(f"h{c % 5}", nic=f"rail{c % 7}") for c in range(40)}
    req = (_dest("w", "bfloat16", shape, Box((0, 0), shape)),)
    gp = plan_global({"w": lay}, {c: req for c in cons}, topology=Fabric(src, cons))
    loads = gp.src_bytes()
    for c, pl in cons.items():
        rk = set(gp.reads(c)["src_rank"].tolist())
        assert all(src[r].host == pl.host for r in rk)
        # same host and same rail exists for every consumer here (70 replicas cover all pairs)
        assert all(src[r].nic == pl.nic for r in rk)
    assert max(loads.values()) <= 2 * shape[0] * shape[1] * 2


def test_same_box_requested_twice_and_packed_for_both():
    rows = 256
    shape = (rows, 32)
    lay = merge_tensor_layout("w", _contig_shards("w", "float32", shape, [Box((0, 0), shape)], [0]))
    box = Box((0, 8), (rows, 8))
    req = (_dest("w", "float32", shape, box, region=1), _dest("w", "float32", shape, box, region=2))
    gp = plan_global({"w": lay}, {0: req})
    items = gp.pack_items()[0]
    assert len(items) == 1  # one copy serves both destinations
    rec = items[0].packed_record(region=5, byte_offset=0)
    gp2 = plan_global({"w": lay}, {0: req}, packed={0: [rec]})
    r = gp2.reads(0)
    assert len(r) == 2 and set(r["dst_region"].tolist()) == {1, 2} and set(r["src_region"].tolist()) == {5}
    src = torch.arange(rows * 32, dtype=torch.float32)
    packed = src.view(shape)[:, 8:16].contiguous().view(-1)
    d1 = torch.zeros(rows * 8 * 4, dtype=torch.uint8)
    d2 = torch.zeros(rows * 8 * 4, dtype=torch.uint8)
    execute_reads(r, {(0, 5): packed.view(torch.uint8)}, {1: d1, 2: d2})
    assert torch.equal(d1.view(torch.float32), packed) and torch.equal(d2.view(torch.float32), packed)


def test_copy_runs_strided_source():
    # publisher shard stored transposed; the packed copy is row-major
    shape = (6, 4)
    rec = ShardRecord("w", "int16", shape, Box((0, 0), shape), (1, 6), 0, 0, 8)
    lay = merge_tensor_layout("w", [rec])
    d = _dest("w", "int16", shape, Box((1, 1), (4, 2)))
    gp = plan_global({"w": lay}, {0: [d]}, cost=CostModel(per_read_seconds=1.0))
    (item,) = gp.pack_items()[0]
    vals = torch.arange(24, dtype=torch.int16).view(shape)
    buf = torch.zeros(8 + 48, dtype=torch.uint8)
    buf[8:] = vals.t().contiguous().view(-1).view(torch.uint8)
    out = torch.zeros(item.nbytes, dtype=torch.uint8)
    for r in item.copy_runs():
        out[r["dst_offset"] : r["dst_offset"] + r["length"]] = buf[
            r["src_offset"] : r["src_offset"] + r["length"]
        ]
    assert torch.equal(out.view(torch.int16).view(4, 2), vals[1:5, 1:3])


def test_cost_model_decides_prepack():
    shape = (64, 64)
    lay = merge_tensor_layout("w", _contig_shards("w", "bfloat16", shape, [Box((0, 0), shape)], [0]))
    d = [_dest("w", "bfloat16", shape, Box((0, 0), (64, 32)))]
    # 64 runs of 64 B: 63 saved reads * 5 us >> 4 KiB / 10 GB/s -> pack
    assert plan_global({"w": lay}, {0: d}).pack_items()
    # reads nearly free -> read the runs
    assert not plan_global({"w": lay}, {0: d}, cost=CostModel(per_read_seconds=1e-12)).pack_items()
    assert not plan_global({"w": lay}, {0: d}, cost=CostModel(prepack=False)).pack_items()
    # a strided destination gains nothing from a contiguous copy -> no pack
    d2 = [_dest("w", "bfloat16", shape, Box((0, 0), (64, 32)), strides=(64, 1))]
    assert not plan_global({"w": lay}, {0: d2}).pack_items()


def test_equal_requests_distinct_objects_share_rotation():
    shape = (16, 16)
    R = 4
    lay = _replicated("w", shape, [Box((0, 0), shape)], R)
    reqs = {c: [_dest("w", "bfloat16", shape, Box((0, 0), shape))] for c in range(8)}  # distinct lists
    gp = plan_global({"w": lay}, reqs, balance="rotation")
    sb = gp.src_bytes()
    assert len(sb) == R and max(sb.values()) == min(sb.values())


@settings(max_examples=60, deadline=None)
@given(
    scenarios(),
    st.sampled_from(["float32", "bfloat16", "float16", "float64"]),
    st.sampled_from(["float32", "bfloat16", "float16", "float8_e4m3fn", "float64"]),
)
def test_random_layouts_convert(sc, sdt, ddt):
    sc = dict(sc, dtype=sdt, float_values=True)
    env = build(sc)
    vals = sc["_values"]
    reqs = {
        c: tuple(
            ShardRecord(
                r.name,
                ddt,
                r.global_shape,
                r.box,
                r.strides,
                r.rank,
                r.region,
                r.byte_offset // itemsize(sdt) * itemsize(ddt),
            )
            for r in rs
        )
        for c, rs in env["requests"].items()
    }
    gp = plan_global(env["layouts"], reqs)
    disz = itemsize(ddt)
    for c, rs in reqs.items():
        reads = gp.reads(c)
        assert (reads["convert"] == (sdt != ddt)).all()
        dests = {
            r.region: torch.zeros(
                len(env["dests"][c][r.region]) // itemsize(sdt) * disz + 8, dtype=torch.uint8
            )
            for r in rs
        }
        srcs = {k: v.clone() for k, v in env["sources"].items()}
        execute_reads(reads, srcs, dests)
        for r in rs:
            if r.box.numel == 0:
                continue
            got = _read_box(dests[r.region], r.box, r.strides, r.byte_offset, disz)
            got = torch.from_numpy(np.ascontiguousarray(got)).view(DT[ddt]).reshape(r.box.sizes)
            sl = tuple(slice(o, o + n) for o, n in zip(r.box.offsets, r.box.sizes))
            want = vals[sl].to(DT[ddt]) if r.box.ndim else vals.to(DT[ddt])
            assert torch.equal(got.float(), want.float().reshape(r.box.sizes))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 24),
    st.lists(st.integers(1, 40), min_size=1, max_size=10),
    st.integers(1, 4),
)
def test_balance_bound_property(R, C, rows, splits):
    layouts, reqs = {}, {c: [] for c in range(C)}
    largest = 0
    for i, n in enumerate(rows):
        shape = (n * splits, 8)
        nm = f"t{i}"
        layouts[nm] = _replicated(nm, shape, _rows(shape, splits), R)
        largest = max(largest, max(b.numel for b in _rows(shape, splits)) * 2)
        for c in range(C):
            reqs[c].append(_dest(nm, "bfloat16", shape, Box((0, 0), shape)))
    gp = plan_global(layouts, reqs)
    sb = gp.src_bytes()
    # boxes are equal-sized and each has R replicas: every rank within one piece of the mean
    total = gp.total_bytes
    assert sum(sb.values()) == total
    assert max(sb.values()) <= total / (R * splits) + largest


# ----------------------------------------------------------------------------------------------
# Stage 1 (publisher shards) against an obviously-correct per-tensor reference


def _ref_sources(layouts):
    """What ``Sources`` holds, tensor by tensor in plain Python: non-empty records sorted by (box
    offsets, box sizes, rank, region, byte offset), identical boxes grouped, dims left-padded."""
    import zlib

    names = sorted(layouts)
    D = max([len(layouts[n].global_shape) for n in names] + [1])

    def pad(t, fill):
        return (fill,) * (D - len(t)) + tuple(t)

    out = {
        k: []
        for k in (
            "box_lo",
            "box_sz",
            "box_rs",
            "box_rc",
            "rec_rank",
            "rec_region",
            "rec_off",
            "rec_str",
            "rec_lo",
            "rec_t",
            "t_bs",
            "t_bc",
            "rec_obj",
        )
    }
    for ti, n in enumerate(names):
        recs = sorted(
            (s for s in layouts[n].shards if all(z > 0 for z in s.box.sizes)),
            key=lambda s: (s.box.offsets, s.box.sizes, s.rank, s.region, s.byte_offset),
        )
        out["t_bs"].append(len(out["box_lo"]))
        for j, s in enumerate(recs):
            if j == 0 or recs[j - 1].box != s.box:
                out["box_lo"].append(pad(s.box.offsets, 0))
                out["box_sz"].append(pad(s.box.sizes, 1))
                out["box_rs"].append(len(out["rec_obj"]))
                out["box_rc"].append(0)
            out["box_rc"][-1] += 1
            out["rec_obj"].append(s)
            out["rec_rank"].append(s.rank)
            out["rec_region"].append(s.region)
            out["rec_off"].append(s.byte_offset)
            out["rec_str"].append(pad(s.strides, 0))
            out["rec_lo"].append(pad(s.box.offsets, 0))
            out["rec_t"].append(ti)
        out["t_bc"].append(len(out["box_lo"]) - out["t_bs"][-1])
    out["t_shape"] = [pad(layouts[n].global_shape, 1) for n in names]
    out["t_code"] = [DTYPE_CODES[layouts[n].dtype] for n in names]
    out["tensor_salt"] = [zlib.crc32(n.encode()) for n in names]
    out.update(
        D=D,
        names=tuple(names),
        shapes=[tuple(layouts[n].global_shape) for n in names],
        dtypes=[layouts[n].dtype for n in names],
        n_layout_recs=len(out["rec_obj"]),
    )
    return out


@st.composite
def raw_layouts(draw):
    """Any shards (not tiling): 0-d..4-d, replicas, empty boxes, several ranks and regions, mixed dtypes."""
    layouts = {}
    for i in range(draw(st.integers(0, 5))):
        nm = f"t{draw(st.integers(0, 9))}.w{i}"
        nd = draw(st.integers(0, 4))
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=nd, max_size=nd)))
        dtype = draw(st.sampled_from(DTYPES))
        boxes, shards = [], []
        for _ in range(draw(st.integers(0, 6))):
            if boxes and draw(st.booleans()):
                box = draw(st.sampled_from(boxes))  # a replica
            else:
                lo = tuple(draw(st.integers(0, n)) for n in shape)
                box = Box(lo, tuple(draw(st.integers(0, n - o)) for o, n in zip(lo, shape)))
                boxes.append(box)
            strides = tuple(draw(st.lists(st.integers(0, 20), min_size=nd, max_size=nd)))
            shards.append(
                ShardRecord(
                    nm,
                    dtype,
                    shape,
                    box,
                    strides,
                    draw(st.integers(0, 3)),
                    draw(st.integers(0, 2)),
                    8 * draw(st.integers(0, 3)),
                )
            )
        layouts[nm] = TensorLayout(nm, dtype, shape, tuple(shards))
    return layouts


@PROP
@given(raw_layouts())
def test_sources_match_reference(layouts):
    src = Sources(layouts)
    ref = _ref_sources(layouts)
    for k in ("D", "names", "shapes", "dtypes", "n_layout_recs"):
        assert getattr(src, k) == ref[k], k
    assert len(src.rec_obj) == len(ref["rec_obj"]) and all(
        a is b for a, b in zip(src.rec_obj, ref["rec_obj"])
    )
    for k, v in ref.items():
        if k in ("D", "names", "shapes", "dtypes", "n_layout_recs", "rec_obj"):
            continue
        a = getattr(src, k)
        want = (
            np.array(v, np.int64)
            if v
            else np.zeros(
                (0, src.D) if k in ("box_lo", "box_sz", "rec_str", "rec_lo", "t_shape") else (0,), np.int64
            )
        )
        assert a.dtype == np.int64 and a.shape == want.shape and np.array_equal(a, want), k


def test_sources_errors_name_the_first_bad_tensor():
    def lay(nm, shards=None, dtype="float32", shape=(4, 4)):
        if shards is None:
            shards = [ShardRecord(nm, dtype, shape, Box((0, 0), shape), (4, 1), 0, 0, 0)]
        return TensorLayout(nm, dtype, shape, tuple(shards))

    def rec(nm, box=Box((0, 0), (4, 4)), strides=(4, 1), off=0, dtype="float32", shape=(4, 4)):
        return ShardRecord(nm, dtype, shape, box, strides, 3, 0, off)

    cases = [
        (lay("a.w", [rec("a.w", box=Box((1, 0), (4, 4)))]), "'a.w': a publisher shard box is out of bounds"),
        (lay("a.w", [rec("a.w", box=Box((-1, 0), (1, 4)))]), "'a.w': a publisher shard box is out of bounds"),
        (
            lay("a.w", [rec("a.w", strides=(4,))]),
            "'a.w': a publisher shard has a box/strides of the wrong ndim",
        ),
        (
            lay("a.w", [rec("a.w", box=Box((0,), (4,)))]),
            "'a.w': a publisher shard has a box/strides of the wrong ndim",
        ),
        (
            lay("a.w", [rec("a.w", strides=(-4, 1))]),
            "'a.w': a publisher shard has negative strides or byte offset",
        ),
        (lay("a.w", [rec("a.w", off=-8)]), "'a.w': a publisher shard has negative strides or byte offset"),
        (lay("a.w", [rec("a.w"), rec("a.w", dtype="float16")]), r"'a.w': rank 3 shard \('a.w', float16"),
        (
            lay("a.w", [rec("a.w", shape=(4, 5))]),
            r"'a.w': rank 3 shard \('a.w', float32, \(4, 5\)\) disagrees",
        ),
        (lay("a.w", [rec("x.w")]), r"'a.w': rank 3 shard \('x.w'"),
        (lay("a.w", [], dtype="complex64"), "'a.w': unknown dtype 'complex64'"),
    ]
    for bad, msg in cases:
        # the first bad tensor in name order is named, whatever the later ones hold
        layouts = {
            "b.w": lay("b.w", [rec("b.w", off=-1)], dtype="complex64"),
            "a.w": bad,
            "0.w": lay("0.w"),
            "c.w": lay("c.w", [rec("c.w", box=Box((9, 9), (1, 1)))]),
        }
        with pytest.raises(PlanError, match=msg):
            Sources(layouts)
    with pytest.raises(PlanError, match="'b.w': layout must be a TensorLayout"):
        Sources({"a.w": lay("a.w", [rec("a.w", off=-8)]), "b.w": [rec("b.w")]})
    with pytest.raises(PlanError, match="'b.w': layout mapping key differs"):
        Sources({"a.w": lay("a.w", [rec("a.w", off=-8)]), "b.w": lay("z.w")})
    # tensors with no shards or only empty boxes compile to no boxes
    src = Sources({"e.w": lay("e.w", []), "f.w": lay("f.w", [rec("f.w", box=Box((0, 0), (0, 4)))])})
    assert src.t_bc.tolist() == [0, 0] and src.t_bs.tolist() == [0, 0] and src.n_layout_recs == 0

"""Layout contracts: validation errors name the tensor and the problem."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astate_store.errors import LayoutError
from astate_store.model.layout import (
    Box,
    Shard,
    ShardRecord,
    TensorLayout,
    contiguous_strides,
    group_layouts,
    merge_tensor_layout,
    validate_name,
)
from astate_store.model.validation import local_box, validate_tensors


def rec(
    rank: int,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    shape: tuple[int, ...] = (8, 6),
    dtype: str = "float32",
) -> ShardRecord:
    return ShardRecord("layer.w", dtype, shape, Box(offsets, sizes), contiguous_strides(sizes), rank, 0, 0)


def test_plain_tensor_is_the_whole_tensor() -> None:
    t, box, shape, dtype = local_box("w", torch.zeros(3, 4, dtype=torch.bfloat16))
    assert box == Box((0, 0), (3, 4)) and shape == (3, 4) and dtype == "bfloat16"


def test_shard_box_and_strided_view() -> None:
    base = torch.zeros(4, 10)
    t, box, shape, _ = local_box("w", Shard(base[:, 2:5], (0, 2), (4, 10)))
    assert box == Box((0, 2), (4, 3)) and shape == (4, 10) and t.stride() == (10, 1)


@pytest.mark.parametrize("name", ["", "a b", "/lead", "trail/", "a//b", "x/../y", "é", 3, "a" * 600])
def test_bad_names(name: object) -> None:
    with pytest.raises(LayoutError, match="name"):
        validate_name(name)


def test_good_names() -> None:
    for n in ["w", "model.layers.0.mlp/up_proj", "a-b_c.d"]:
        assert validate_name(n) == n


def test_box_out_of_bounds_names_tensor() -> None:
    with pytest.raises(LayoutError, match=r"'emb'.*out of bounds"):
        local_box("emb", Shard(torch.zeros(4, 4), (6, 0), (8, 4)))


def test_shard_rank_mismatch() -> None:
    with pytest.raises(LayoutError, match=r"'emb'.*offsets"):
        local_box("emb", Shard(torch.zeros(4, 4), (0,), (8, 4)))
    with pytest.raises(LayoutError, match=r"'emb'.*global_shape"):
        local_box("emb", Shard(torch.zeros(4, 4), (0, 0), (8, 4, 1)))


def test_unsupported_dtype() -> None:
    with pytest.raises(LayoutError, match=r"'c'.*unsupported dtype"):
        local_box("c", torch.zeros(2, dtype=torch.complex64))


def test_aliased_memory_rejected() -> None:
    with pytest.raises(LayoutError, match=r"'e'.*overlaps itself"):
        local_box("e", torch.zeros(1, 3).expand(4, 3))


def test_not_a_tensor() -> None:
    with pytest.raises(LayoutError, match=r"'n'.*expected a torch.Tensor"):
        local_box("n", [1, 2, 3])  # type: ignore[arg-type]


def test_merge_tiles_with_replicas() -> None:
    lay = merge_tensor_layout(
        "layer.w",
        [rec(0, (0, 0), (4, 6)), rec(1, (4, 0), (4, 6)), rec(2, (0, 0), (4, 6)), rec(3, (4, 0), (4, 6))],
    )
    assert len(lay.shards) == 4 and lay.global_shape == (8, 6)


def test_merge_column_split_and_uneven() -> None:
    # ranks arrive in any order: the layout lists the shards by box offsets
    cols = merge_tensor_layout("layer.w", [rec(1, (0, 1), (8, 5)), rec(0, (0, 0), (8, 1))])
    assert (cols.name, cols.dtype, cols.global_shape, cols.nbytes) == (
        "layer.w",
        "float32",
        (8, 6),
        8 * 6 * 4,
    )
    assert [(s.rank, s.box.offsets, s.box.sizes) for s in cols.shards] == [
        (0, (0, 0), (8, 1)),
        (1, (0, 1), (8, 5)),
    ]
    uneven = [rec(0, (0, 0), (3, 6)), rec(1, (3, 0), (5, 3)), rec(2, (3, 3), (5, 3))]
    lay = merge_tensor_layout("layer.w", uneven[::-1])
    assert lay.shards == tuple(uneven) and lay.global_shape == (8, 6)
    assert sum(s.box.numel for s in lay.shards) == 8 * 6  # the boxes tile the tensor exactly once


def test_merge_overlap_rejected() -> None:
    with pytest.raises(LayoutError, match=r"'layer.w'.*overlap"):
        merge_tensor_layout("layer.w", [rec(0, (0, 0), (5, 6)), rec(1, (4, 0), (4, 6))])


def test_merge_gap_rejected() -> None:
    with pytest.raises(LayoutError, match=r"'layer.w'.*gap"):
        merge_tensor_layout("layer.w", [rec(0, (0, 0), (3, 6)), rec(1, (4, 0), (4, 6))])


def test_merge_dtype_disagreement() -> None:
    with pytest.raises(LayoutError, match=r"'layer.w'.*dtype disagrees"):
        merge_tensor_layout("layer.w", [rec(0, (0, 0), (4, 6)), rec(1, (4, 0), (4, 6), dtype="bfloat16")])


def test_merge_global_shape_disagreement() -> None:
    with pytest.raises(LayoutError, match=r"'layer.w'.*global shape disagrees"):
        merge_tensor_layout("layer.w", [rec(0, (0, 0), (4, 6)), rec(1, (4, 0), (4, 6), shape=(9, 6))])


def test_merge_out_of_bounds() -> None:
    with pytest.raises(LayoutError, match=r"'layer.w'.*out of bounds"):
        merge_tensor_layout("layer.w", [rec(0, (0, 0), (4, 6)), rec(1, (4, 0), (5, 6))])


def test_span_and_contiguity() -> None:
    r = ShardRecord("w", "float32", (4, 10), Box((0, 2), (4, 3)), (10, 1), 0, 0, 8)
    lo, hi = r.byte_range(r.box)  # from the first to one past the last element
    assert not r.contiguous and hi - lo == (3 * 10 + 2 + 1) * 4 and r.nbytes == 48


# ----------------------------------------------------------------------------------------------
# merge_tensor_layout / group_layouts against a brute-force reference (every element counted)


def _ref_merge(name, recs):
    """'ok' with the sorted shards, or the kind of error, deciding coverage element by element."""
    import numpy as np

    if not recs:
        return "no shards"
    recs = sorted(recs, key=lambda s: (s.box.offsets, s.box.sizes, s.rank, s.region))
    first = recs[0]
    if any(s.dtype != first.dtype for s in recs):
        return "dtype disagrees"
    if any(s.global_shape != first.global_shape for s in recs):
        return "global shape disagrees"
    shape = first.global_shape
    if not all(s.box.within(shape) for s in recs):
        return "out of bounds"
    count = np.zeros(shape, np.int64)
    for b in dict.fromkeys(s.box for s in recs):  # distinct boxes
        count[tuple(slice(o, o + z) for o, z in zip(b.offsets, b.sizes))] += 1
    if (count > 1).any():
        return "overlap"
    if (count == 0).any():
        return "gap"
    return ("ok", recs)


@st.composite
def tensor_shards(draw):
    """Whole / one-dim / grid tilings with replicas (the fast paths), random boxes, and perturbations."""
    nd = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=nd, max_size=nd)))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    kind = draw(st.sampled_from(["whole", "one_dim", "grid", "random"]))

    def split(n, allow):
        cuts = (
            sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3)))) if allow and n > 1 else []
        )
        pts = [0] + [c for c in cuts if c < n] + [n]
        return list(zip(pts, (b - a for a, b in zip(pts, pts[1:]))))

    if kind == "random" and nd:
        boxes = []
        for _ in range(draw(st.integers(1, 4))):
            lo = tuple(draw(st.integers(0, n)) for n in shape)
            boxes.append(Box(lo, tuple(draw(st.integers(0, n - o)) for o, n in zip(lo, shape))))
    else:
        k = draw(st.integers(0, max(nd - 1, 0)))
        parts = [split(n, kind == "grid" or (kind == "one_dim" and d == k)) for d, n in enumerate(shape)]
        boxes = [Box(tuple(p[0] for p in c), tuple(p[1] for p in c)) for c in itertools.product(*parts)]
    recs = [[dtype, shape, b.offsets, b.sizes, r] for r in range(draw(st.integers(1, 3))) for b in boxes]
    recs = draw(st.permutations(recs))
    if recs and draw(st.booleans()):  # perturb one record
        i = draw(st.integers(0, len(recs) - 1))
        dt, sh, lo, sz, r = recs[i]
        what = draw(st.sampled_from(["dtype", "shape", "drop", "grow", "shift", "dup"]))
        if what == "dtype":
            recs[i] = ["float16", sh, lo, sz, r]
        elif what == "shape":
            recs[i] = [dt, sh + (1,), lo, sz, r]
        elif what == "drop":
            recs.pop(i)
        elif what == "grow" and nd:
            recs[i] = [dt, sh, lo, sz[:-1] + (sz[-1] + 1,), r]
        elif what == "shift" and nd:
            recs[i] = [dt, sh, lo[:-1] + (lo[-1] - 1,), sz, r]
        elif what == "dup":
            recs.append([dt, sh, lo, sz, 7])
    return [
        ShardRecord("t.w", dt, sh, Box(lo, sz), contiguous_strides(sz), r, i % 2, 8 * i)
        for i, (dt, sh, lo, sz, r) in enumerate(recs)
    ]


@settings(max_examples=300, deadline=None)
@given(tensor_shards())
def test_merge_matches_brute_force(recs):
    want = _ref_merge("t.w", recs)
    if not recs:
        with pytest.raises(LayoutError, match=r"'t.w'.*no shards"):
            merge_tensor_layout("t.w", recs)
        assert group_layouts(recs) == {}
        return
    for merge in (lambda: merge_tensor_layout("t.w", iter(recs)), lambda: group_layouts(recs)["t.w"]):
        if isinstance(want, str):
            with pytest.raises(LayoutError, match=rf"'t.w'.*{want}"):
                merge()
        else:
            lay = merge()
            assert lay == TensorLayout("t.w", recs[0].dtype, recs[0].global_shape, tuple(want[1]))
            assert all(a is b for a, b in zip(lay.shards, want[1]))


@settings(max_examples=150, deadline=None)
@given(st.lists(tensor_shards(), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_group_layouts_of_many_tensors_merges_each_as_alone(tensors, rnd):
    """Several tensors' records interleaved (merged column-wise in one batch): each tensor's
    layout, or the first failing tensor's error, is what merging it alone gives."""
    named = [[dataclasses.replace(r, name=f"t{i}.w") for r in recs] for i, recs in enumerate(tensors)]
    flat = [r for recs in named for r in recs]
    rnd.shuffle(flat)
    wants = {f"t{i}.w": _ref_merge(f"t{i}.w", recs) for i, recs in enumerate(named) if recs}
    bad = [n for n, w in sorted(wants.items()) if isinstance(w, str)]
    if bad:
        with pytest.raises(LayoutError, match=rf"'{bad[0]}'.*{wants[bad[0]]}"):
            group_layouts(flat)
        return
    out = group_layouts(flat)
    assert list(out) == sorted(wants)
    for n, w in wants.items():
        # records of one tensor in the order merging it alone gives (ties: the order they came in)
        alone = merge_tensor_layout(n, [r for r in flat if r.name == n])
        assert out[n] == alone and all(a is b for a, b in zip(out[n].shards, alone.shards))


def test_group_layouts_sorted_by_name_records_in_order():
    a = [rec(r, (0, 0), (8, 6)) for r in (3, 1, 2)]
    b = [ShardRecord("b.w", "int8", (2,), Box((0,), (2,)), (1,), 0, 0, 0)]
    c = [ShardRecord("a.w", "bool", (), Box((), ()), (), 5, 0, 0)]
    out = group_layouts([a[0], b[0], a[1], c[0], a[2]])
    assert list(out) == ["a.w", "b.w", "layer.w"]
    assert out["layer.w"].shards == (a[1], a[2], a[0]) and out["b.w"].shards == tuple(b)
    assert out["a.w"] == TensorLayout("a.w", "bool", (), tuple(c))


def test_memory_checks_fast_paths_agree():
    # contiguous with elements: nothing to check; empty but aliased strides are still checked
    local_box("w", torch.zeros(3, 1).as_strided((3, 1), (1, 7)))
    with pytest.raises(LayoutError, match=r"'z'.*overlaps itself"):
        local_box("z", torch.empty(0, 3).as_strided((0, 3), (0, 0)))
    # strided views in stride order pass; out of order they go through the full check
    local_box("v", Shard(torch.zeros(4, 10)[:, 2:5], (0, 2), (4, 10)))
    local_box("t", torch.zeros(3, 4).t())
    with pytest.raises(LayoutError, match=r"'o'.*overlaps itself"):
        local_box("o", torch.zeros(16).as_strided((3, 3), (1, 2)))
    with pytest.raises(LayoutError, match=r"'m'.*device meta"):
        validate_tensors({"m": torch.zeros(2, device="meta")}, "buffers")
    (e,) = validate_tensors({"p": torch.nn.Parameter(torch.zeros(2, 3))}, "buffers")
    assert e.box == Box((0, 0), (2, 3)) and e.global_shape == (2, 3) and e.dtype == "float32"

"""Layout contracts: validation errors name the tensor and the problem."""

from __future__ import annotations

import pytest
import torch

from astate_store.errors import LayoutError
from astate_store.layout import (
    Box, Shard, ShardRecord, contiguous_strides, local_box, merge_tensor_layout, validate_name,
)


def rec(rank: int, offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...] = (8, 6),
        dtype: str = "float32") -> ShardRecord:
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
    lay = merge_tensor_layout("layer.w", [rec(0, (0, 0), (4, 6)), rec(1, (4, 0), (4, 6)),
                                          rec(2, (0, 0), (4, 6)), rec(3, (4, 0), (4, 6))])
    assert len(lay.shards) == 4 and lay.global_shape == (8, 6)


def test_merge_column_split_and_uneven() -> None:
    merge_tensor_layout("layer.w", [rec(0, (0, 0), (8, 1)), rec(1, (0, 1), (8, 5))])
    merge_tensor_layout("layer.w", [rec(0, (0, 0), (3, 6)), rec(1, (3, 0), (5, 3)), rec(2, (3, 3), (5, 3))])


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
    assert not r.contiguous and r.span_bytes == (3 * 10 + 2 + 1) * 4 and r.nbytes == 48

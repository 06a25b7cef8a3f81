"""The snapshot pool (put/staging.py): slot layout, the staging cap, exact copies into a slot.

Single process, one real ``UcxTransport("shm")``: the pool registers its slots with it, prepares
their pages and copies through its copy loop. ``_Counting`` only counts the calls into that real
transport, so a test can say which copy path (native rows or torch) a fill took.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from astate_store.errors import LayoutError
from astate_store.model.layout import Box
from astate_store.put.staging import ALIGN, WORDS_BYTES, SnapshotPool, StagingCapExceeded
from astate_store.transport import UcxTransport
from tests.support.data import value


class _Counting(UcxTransport):
    """A real UCX transport that also counts the rows its copy loop ran and the regions it freed."""

    def __init__(self) -> None:
        super().__init__("shm")
        self.copied_rows = 0
        self.prepared: list[int] = []
        self.unregistered: list[int] = []

    def copy_rows(self, rows: np.ndarray) -> None:
        self.copied_rows += len(rows)
        super().copy_rows(rows)

    def prepare_staging(self, buffer: Any) -> None:
        self.prepared.append(int(buffer.numel()))
        super().prepare_staging(buffer)

    def unregister(self, region: int) -> None:
        self.unregistered.append(region)
        super().unregister(region)


@pytest.fixture
def transport() -> Iterator[_Counting]:
    t = _Counting()
    yield t
    t.close()


def _alloc(n: int) -> torch.Tensor:
    # Dirty memory: a slot that is not written by fill() must not pass for a good one.
    return torch.full((n,), 0xA5, dtype=torch.uint8)


def _whole(
    name: str, shape: tuple[int, ...], dtype: str = "float32"
) -> tuple[str, str, tuple[int, ...], Box]:
    return name, dtype, shape, Box((0,) * len(shape), shape)


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _slot_bytes(pool: SnapshotPool, k: int, i: int) -> torch.Tensor:
    """Entry i of slot k as raw bytes of the pool's buffer."""
    assert pool.buffer is not None
    e = pool.entries[i]
    base = k * pool.slot_size + e.offset
    return pool.buffer[base : base + e.nbytes]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# ---- layout ---------------------------------------------------------------------------------


def test_entries_are_aligned_back_to_back_and_the_slots_registered_once(transport: _Counting) -> None:
    items = [_whole("a", (3, 5)), _whole("b", (100,), "int64"), _whole("c", (7,), "bfloat16")]
    pool = SnapshotPool(3, None, _alloc, transport)
    assert pool.configure(items) is True
    sizes = [60, 800, 14]
    want_offsets = [0, _round(60), _round(60) + _round(800)]
    assert [e.offset for e in pool.entries] == want_offsets
    assert [e.nbytes for e in pool.entries] == sizes
    assert [(e.name, e.dtype, e.global_shape, e.source) for e in pool.entries] == [
        ("a", "float32", (3, 5), -1),
        ("b", "int64", (100,), -1),
        ("c", "bfloat16", (7,), -1),
    ]
    assert pool.slot_size == sum(map(_round, sizes)) and pool.slot_size % ALIGN == 0
    assert pool.depth == 3 and pool.nbytes == 3 * pool.slot_size + WORDS_BYTES  # the step words last
    assert pool.slot_step == [None, None, None] and pool.next_slot() == (0, None)
    # The whole pool is one registered region of this transport, its pages prepared first.
    assert pool.region is not None
    info = transport.region(pool.region)
    assert pool.buffer is not None
    assert (info.base, info.size) == (pool.buffer.data_ptr(), pool.nbytes)
    assert transport.num_regions == 1 and transport.prepared == [pool.nbytes]
    assert int(pool.buffer.max()) == 0  # written whole at configure (zeroed), not left dirty
    # A record of an entry is the contiguous shard at the byte offset it is given.
    rec = pool.entries[0].record(
        rank=2, region=pool.region, byte_offset=pool.slot_size + pool.entries[0].offset
    )
    assert (rec.name, rec.rank, rec.region, rec.byte_offset) == ("a", 2, pool.region, pool.slot_size)
    assert rec.strides == (5, 1) and rec.box == Box((0, 0), (3, 5))


def test_the_same_signature_changes_nothing(transport: _Counting) -> None:
    items = [_whole("a", (64,))]
    pool = SnapshotPool(2, None, _alloc, transport)
    assert pool.configure(items)
    buf, region = pool.buffer, pool.region
    pool.fill(0, [torch.ones(64)], step=5)
    assert pool.configure(list(items)) is False  # an equal signature, even from another list
    assert pool.buffer is buf and pool.region == region
    assert pool.slot_step == [5, None] and pool.next_slot() == (1, None)


def test_an_empty_layout_still_gets_an_aligned_slot(transport: _Counting) -> None:
    pool = SnapshotPool(2, None, _alloc, transport)
    pool.configure([_whole("empty", (0, 4))])
    assert pool.entries[0].nbytes == 0 and pool.slot_size == ALIGN and pool.depth == 2
    pool.fill(0, [torch.empty(0, 4)], step=1)
    assert pool.slot_step == [1, None]


def test_depth_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        SnapshotPool(0, None, _alloc, None)  # type: ignore[arg-type]


# ---- the cap --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cap_slots", "want", "depth"), [(10.0, 4, 4), (4.0, 4, 4), (2.5, 4, 2), (1.0, 3, 1)]
)
def test_depth_shrinks_to_what_the_cap_holds(
    transport: _Counting, cap_slots: float, want: int, depth: int
) -> None:
    items = [_whole("w", (1000,))]  # 4000 bytes: a slot of 4096
    slot = _round(4000)
    pool = SnapshotPool(want, int(cap_slots * slot) + WORDS_BYTES, _alloc, transport)
    pool.configure(items)
    assert pool.slot_size == slot
    assert pool.depth == depth and pool.want_depth == want
    assert pool.nbytes == depth * slot + WORDS_BYTES <= pool.cap_bytes  # type: ignore[operator]
    assert len(pool.slot_step) == depth


def test_a_slot_over_the_cap_is_refused_with_both_sizes(transport: _Counting) -> None:
    items = [_whole("w", (1000,)), _whole("v", (10,))]  # a slot of 4096 + 256 bytes
    pool = SnapshotPool(2, 4096, _alloc, transport)
    with pytest.raises(StagingCapExceeded) as info:
        pool.configure(items)
    msg = str(info.value)
    assert "2 tensors" in msg and "cap of 4096 bytes" in msg
    assert f"needs {4096 + 256 + WORDS_BYTES} bytes" in msg  # the slot and the step words
    assert isinstance(info.value, LayoutError)  # callers that catch layout errors catch it too
    # Nothing was allocated or registered for a refused layout.
    assert pool.buffer is None and pool.region is None and transport.num_regions == 0
    assert pool.signature is None


# ---- fill -----------------------------------------------------------------------------------


def test_fill_copies_exact_bytes_by_the_native_loop_and_rotates_slots(transport: _Counting) -> None:
    shapes = {
        "a": ((17, 3), "float32"),
        "b": ((5,), "int64"),
        "c": ((9, 2), "bfloat16"),
        "d": ((33,), "bool"),
    }
    items = [_whole(n, s, dt) for n, (s, dt) in shapes.items()]
    pool = SnapshotPool(2, None, _alloc, transport)
    pool.configure(items)
    for step in (1, 2, 3):
        k, old = pool.next_slot()
        assert (k, old) == ((step - 1) % 2, step - 2 if step > 2 else None)
        tensors = [value(n, s, dt, step) for n, (s, dt) in shapes.items()]
        before = transport.copied_rows
        pool.fill(k, tensors, step)
        assert transport.copied_rows - before == 4  # every shard went through the copy loop
        for i, t in enumerate(tensors):
            assert torch.equal(_slot_bytes(pool, k, i), _as_bytes(t)), (step, items[i][0])
    assert pool.slot_step == [3, 2]
    # The other slot still holds step 2 untouched.
    for i, (n, (s, dt)) in enumerate(shapes.items()):
        assert torch.equal(_slot_bytes(pool, 1, i), _as_bytes(value(n, s, dt, 2)))


def test_fill_by_torch_for_strided_and_other_dtype_sources(transport: _Counting) -> None:
    items = [_whole("t", (6, 4)), _whole("conv", (10,)), _whole("plain", (8,))]
    pool = SnapshotPool(1, None, _alloc, transport)
    pool.configure(items)
    strided = value("t", (4, 6), "float32", 7).t()  # (6, 4), not contiguous
    other = value("conv", (10,), "float64", 7)  # float64 into a float32 entry
    plain = value("plain", (8,), "float32", 7)
    assert not strided.is_contiguous()
    pool.fill(0, [strided, other, plain], step=7)
    assert transport.copied_rows == 1  # only the contiguous float32 shard took the native loop
    assert torch.equal(_slot_bytes(pool, 0, 0), _as_bytes(strided.contiguous()))
    assert torch.equal(_slot_bytes(pool, 0, 1), _as_bytes(other.to(torch.float32)))
    assert torch.equal(_slot_bytes(pool, 0, 2), _as_bytes(plain))


def test_a_cached_copy_plan_copies_the_new_contents_of_the_same_tensors(transport: _Counting) -> None:
    shapes = {"a": (32,), "b": (4, 4)}
    pool = SnapshotPool(2, None, _alloc, transport)
    pool.configure([_whole(n, s) for n, s in shapes.items()])
    tensors = [value(n, s, "float32", 0) for n, s in shapes.items()]
    key = object()  # the publisher's validated entries: the same while tensors stay put
    for step in range(1, 5):
        for t, (n, s) in zip(tensors, shapes.items()):
            t.copy_(value(n, s, "float32", step))  # changed in place, same addresses
        k, _ = pool.next_slot()
        pool.fill(k, tensors, step, key=key)
        for i, t in enumerate(tensors):
            assert torch.equal(
                _slot_bytes(pool, k, i), _as_bytes(value(list(shapes)[i], t.shape, "float32", step))
            )
    # Other tensors under another key: the plan is rebuilt, not reused with stale addresses.
    fresh = [value(n, s, "float32", 99) for n, s in shapes.items()]
    k, _ = pool.next_slot()
    pool.fill(k, fresh, 99, key=object())
    for i, t in enumerate(fresh):
        assert torch.equal(_slot_bytes(pool, k, i), _as_bytes(t))


def test_pre_packed_copies_are_cut_from_the_shards(transport: _Counting) -> None:
    # A row shard (rows 4..11 of a 16x6 tensor) and two copies cut from it: a column block
    # as is, and a row block converted to bfloat16.
    shard = ("w", "float32", (16, 6), Box((4, 0), (8, 6)))
    packs = [(0, Box((4, 2), (8, 3)), None), (0, Box((6, 0), (3, 6)), "bfloat16")]
    pool = SnapshotPool(2, None, _alloc, transport)
    pool.configure([shard], packs)
    assert [(e.source, e.dtype, e.box) for e in pool.entries[1:]] == [
        (0, "float32", Box((4, 2), (8, 3))),
        (0, "bfloat16", Box((6, 0), (3, 6))),
    ]
    assert pool.entries[1].offset == _round(8 * 6 * 4)
    assert pool.entries[2].offset == pool.entries[1].offset + _round(8 * 3 * 4)
    whole = value("w", (16, 6), "float32", 3)
    pool.fill(1, [whole[4:12]], step=3)
    assert torch.equal(_slot_bytes(pool, 1, 0), _as_bytes(whole[4:12]))
    assert torch.equal(_slot_bytes(pool, 1, 1), _as_bytes(whole[4:12, 2:5]))
    assert torch.equal(_slot_bytes(pool, 1, 2), _as_bytes(whole[6:9].to(torch.bfloat16)))


def test_a_new_signature_lays_out_again_and_resets_the_slots(transport: _Counting) -> None:
    pool = SnapshotPool(2, None, _alloc, transport)
    pool.configure([_whole("a", (64,))])
    first_region = pool.region
    pool.fill(0, [value("a", (64,), "float32", 1)], 1)
    pool.fill(1, [value("a", (64,), "float32", 2)], 2)
    # Bigger: a new buffer, registered; the old registration is released.
    bigger = [_whole("a", (64,)), _whole("b", (4096,), "int64")]
    assert pool.configure(bigger) is True
    assert pool.slot_step == [None, None] and pool.next_slot() == (0, None)
    assert transport.unregistered == [first_region]
    assert transport.num_regions == 1 and pool.region != first_region
    assert transport.region(pool.region).size == pool.nbytes == 2 * pool.slot_size + WORDS_BYTES  # type: ignore[arg-type]
    tensors = [value("a", (64,), "float32", 3), value("b", (4096,), "int64", 3)]
    pool.fill(0, tensors, 3)
    for i, t in enumerate(tensors):
        assert torch.equal(_slot_bytes(pool, 0, i), _as_bytes(t))
    # Smaller, but more than half the buffer still used: the buffer and its registration stay.
    buf, region = pool.buffer, pool.region
    assert pool.configure([_whole("b", (4096,), "int64")]) is True
    assert pool.buffer is buf and pool.region == region and pool.entries[0].offset == 0
    # Much smaller: the buffer shrinks (memory is given back), registered anew.
    assert pool.configure([_whole("a", (8,))]) is True
    assert pool.buffer is not buf and transport.unregistered == [first_region, region]
    assert pool.nbytes == 2 * ALIGN + WORDS_BYTES and transport.num_regions == 1

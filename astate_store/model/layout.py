"""Layout contracts: how a tensor is split into N-d boxes and where each box's bytes live.

Everything here is pure and frozen. A publisher rank describes what it holds with
``ShardRecord``s; the catalog merges the ranks' records of one version into a
``TensorLayout`` per tensor after checking that they agree and tile the tensor.
Consumers describe their buffers with the same records (``rank`` is then the
consumer's buffer index space, ``region`` the buffer).

Validating what a user hands in (``validate_tensors``, ``Entry``, tied-weight aliases) lives in
:mod:`astate_store.model.validation`. This module imports nothing of the package but ``errors``
and the dtype table (``model/dtypes.py``).
"""

from __future__ import annotations

import functools
import gc
import math
import operator
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import and_, attrgetter, eq, gt
from typing import Union

import numpy as np
import torch

from astate_store.errors import LayoutError
from astate_store.model.dtypes import ITEMSIZES, itemsize

__all__ = [
    "validate_name",
    "Box",
    "ShardRecord",
    "TensorLayout",
    "Shard",
    "TensorLike",
    "contiguous_strides",
    "MAX_STEP",
    "check_step",
    "merge_tensor_layout",
    "frozen_instance",
    "ZEROS",
]

# Names become etcd key segments and file names: keep them printable and slash-free at the ends.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
MAX_NAME_LEN = 512


def validate_name(name: object) -> str:
    """Check a tensor name and return it.

    Raises:
        LayoutError: not a string, empty, too long, or with characters outside ``[A-Za-z0-9_.-/]``.
    """
    if not isinstance(name, str):
        raise LayoutError(f"tensor name must be a str, got {type(name).__name__}: {name!r}")
    if not name or len(name) > MAX_NAME_LEN or not _NAME_RE.match(name) or ".." in name.split("/"):
        raise LayoutError(
            f"bad tensor name {name!r}: use 1-{MAX_NAME_LEN} characters from [A-Za-z0-9_.-] "
            "with '/' only between segments"
        )
    return name


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of a dense box."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(sizes[d + 1]), 1)
    return tuple(strides)


@dataclass(frozen=True)
class Box:
    """An N-d box of a global tensor: ``offsets[d] <= i < offsets[d] + sizes[d]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise LayoutError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        # map() over the tuples and no __post_init__: called per (shard, buffer) pair when a
        # 10^4-tensor model is planned, where a generator's frame per call outweighs the work.
        lo = tuple(map(max, self.offsets, other.offsets))
        hi = map(
            min, map(operator.add, self.offsets, self.sizes), map(operator.add, other.offsets, other.sizes)
        )
        sizes = tuple(map(operator.sub, hi, lo))
        if min(sizes, default=1) <= 0:
            return None
        if sizes == self.sizes and lo == self.offsets:
            return self  # other holds all of self (frozen: sharing it is safe)
        return frozen_instance(Box, {"offsets": lo, "sizes": sizes})

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(
            o >= 0 and s >= 0 and o + s <= g for o, s, g in zip(self.offsets, self.sizes, shape)
        )


@dataclass(frozen=True)
class ShardRecord:
    """One box of one tensor held in registered memory.

    ``byte_offset`` is where element ``box.offsets`` lives inside memory region ``region``
    of ``rank``; ``strides`` are element strides of that memory (row-major for a
    contiguous shard, anything non-negative and non-overlapping for a view).
    """

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    strides: tuple[int, ...]
    rank: int
    region: int
    byte_offset: int

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dtype)

    @property
    def contiguous(self) -> bool:
        return _is_dense(self.box.sizes, self.strides)

    def byte_range(self, piece: Box) -> tuple[int, int]:
        """``[first, one past the last)`` byte of ``piece`` (a box inside this record's) in its
        region, from ``byte_offset``; an empty piece occupies nothing."""
        if 0 in piece.sizes:
            return self.byte_offset, self.byte_offset
        # map() rather than generators: once per shard of a 10^4-tensor model's first pull
        size, mul, sub = itemsize(self.dtype), operator.mul, operator.sub
        start = self.byte_offset + size * sum(
            map(mul, map(sub, piece.offsets, self.box.offsets), self.strides)
        )
        return start, start + size * (
            1 + sum(map(mul, map(sub, piece.sizes, _ONES[len(piece.sizes)]), self.strides))
        )


_SAFE = float(1 << 60)  # int64 sums of byte offsets below this cannot overflow


@dataclass(frozen=True, eq=False)
class ShardColumns:
    """One source's shards column-wise (a layout as decoded from its records): shard i is
    ``names[i]``, dtype ``DTYPE_NAMES[dtypes[i]]``, with ``ndims[i]`` dims of global shape,
    offsets, sizes and element strides starting at ``starts[i]`` of the flat columns, its bytes
    at ``byte_offsets[i]`` of ``regions[i]``. What a first pull reads instead of 10^4 records."""

    names: tuple[str, ...]
    dtypes: np.ndarray
    ndims: np.ndarray
    global_shapes: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    strides: np.ndarray
    regions: np.ndarray
    byte_offsets: np.ndarray

    @functools.cached_property
    def starts(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.ndims, dtype=np.int64)))

    @functools.cached_property
    def itemsizes(self) -> np.ndarray:
        return ITEMSIZES[self.dtypes]

    @functools.cached_property
    def spans(self) -> np.ndarray | None:
        """Per shard ``(region, lo, hi)``: ``ShardRecord.byte_range`` of its whole box (``lo ==
        hi`` when empty). None when a hostile record's numbers could overflow int64 (records,
        in Python ints, decide then)."""
        n, sz, st = len(self.names), self.sizes, self.strides
        if n == 0:
            return np.zeros((0, 3), dtype=np.int64)
        if not self.bounded:
            return None
        starts, boffs = self.starts, self.byte_offsets
        reach = np.concatenate(
            ([0], np.cumsum((sz - 1) * st))
        )  # per dim (size - 1) * stride, summed per shard
        zeros = np.concatenate(([0], np.cumsum(sz == 0)))
        empty = zeros[starts[1:]] != zeros[starts[:-1]]
        hi = boffs + self.itemsizes * (1 + reach[starts[1:]] - reach[starts[:-1]])
        return np.stack([self.regions, boffs, np.where(empty, boffs, hi)], axis=1)

    @functools.cached_property
    def bounded(self) -> bool:
        """Whether every byte offset this layout can name fits int64 with room to add to it."""
        if not len(self.names):
            return True
        big = float(ITEMSIZES.max())
        extent = float(np.sum(np.maximum(self.sizes - 1, 0).astype(np.float64) * self.strides))
        numel = float(np.sum(self.global_shapes.astype(np.float64)))
        return max(extent, numel) * big + float(self.byte_offsets.max()) + big < _SAFE


@dataclass(frozen=True)
class TensorLayout:
    """The committed layout of one tensor: every publisher shard, replicas included."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    shards: tuple[ShardRecord, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * itemsize(self.dtype)


@dataclass(frozen=True, init=False)
class Shard:
    """A local tensor that holds the box ``[offsets, offsets + tensor.shape)`` of a global tensor.

    Args:
        tensor: the local piece (any strides; its shape is the box's sizes).
        offsets: where the piece starts in the global tensor, one int per dim.
        global_shape: the whole tensor's shape.

    Raises:
        LayoutError: offsets or global_shape of the wrong rank, or the box out of bounds.
    """

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    def __init__(self, tensor: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int]):
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"Shard needs a torch.Tensor, got {type(tensor).__name__}")
        object.__setattr__(self, "tensor", tensor)
        object.__setattr__(self, "offsets", _int_tuple(offsets, "offsets"))
        object.__setattr__(self, "global_shape", _int_tuple(global_shape, "global_shape"))

    @property
    def box(self) -> Box:
        return Box(self.offsets, tuple(self.tensor.shape))


TensorLike = Union[torch.Tensor, Shard]


def _int_tuple(values: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise LayoutError(f"{what} must be a sequence of ints, got {values!r}") from None
    if any(isinstance(v, bool) for v in values):
        raise LayoutError(f"{what} must be ints, got {values!r}")
    return out


def _is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    expect = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def frozen_instance(cls: type, fields: dict) -> object:
    """An instance of a frozen dataclass with ``fields`` already checked: what ``cls(**fields)`` builds,
    without the per-field ``object.__setattr__`` calls (and ``__post_init__``)."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


class GCPaused:
    """Pause the cyclic GC while building one object per tensor (or per shard): at 10^5 of them
    its collections, each walking every live object, cost about as much as the building."""

    def __enter__(self) -> None:
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was:
            gc.enable()


class _Repeated(dict):
    """ndim -> (value,) * ndim, built on first use (``ZEROS[n]`` is one C-level lookup)."""

    def __init__(self, value: int) -> None:
        super().__init__()
        self.value = value

    def __missing__(self, n: int) -> tuple[int, ...]:
        z = self[n] = (self.value,) * n
        return z


ZEROS, _ONES = _Repeated(0), _Repeated(1)
# Steps are 20-digit zero-padded in etcd keys, counters and checkpoint paths, and the commit
# transaction compares against ``step + 1``, which must still fit in 20 digits.
MAX_STEP = 10**19 - 1


def check_step(step: object, error: type[Exception] = LayoutError) -> int:
    """``step`` as an int in [0, MAX_STEP]; else ``error`` (the caller's typed error)."""
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise error(f"step must be an int in [0, 1e19), got {step!r}")
    value = int(step.__index__())  # type: ignore[attr-defined]
    if not 0 <= value <= MAX_STEP:
        raise error(f"step must be an int in [0, 1e19), got {step!r}")
    return value


def merge_tensor_layout(name: str, shards: Iterable[ShardRecord]) -> TensorLayout:
    """Merge the shards all publisher ranks wrote for one tensor into its committed layout.

    Identical boxes on several ranks are replicas. Distinct boxes must tile the global
    tensor: no overlap, no gap.

    Raises:
        LayoutError: dtype or global shape disagreeing between ranks, partial overlaps,
            or elements no shard holds.
    """
    shards = list(shards)
    if len(shards) > 1:
        shards.sort(key=_MERGE_KEY)  # stable: ties keep the callers' order
    if not shards:
        raise LayoutError(f"tensor {name!r}: no shards")
    first = shards[0]
    if _tiles_fast(shards, first):
        return frozen_instance(
            TensorLayout,
            {"name": name, "dtype": first.dtype, "global_shape": first.global_shape, "shards": tuple(shards)},
        )
    # the general checks: they decide every case the fast path leaves, and name the problem
    for s in shards[1:]:
        if s.dtype != first.dtype:
            raise LayoutError(
                f"tensor {name!r}: dtype disagrees between ranks: rank {first.rank} has "
                f"{first.dtype}, rank {s.rank} has {s.dtype}"
            )
        if s.global_shape != first.global_shape:
            raise LayoutError(
                f"tensor {name!r}: global shape disagrees between ranks: rank {first.rank} has "
                f"{first.global_shape}, rank {s.rank} has {s.global_shape}"
            )
    shape = first.global_shape
    for s in shards:
        if not s.box.within(shape):
            raise LayoutError(
                f"tensor {name!r}: rank {s.rank} box {s.box.offsets}+{s.box.sizes} is out of "
                f"bounds of {shape}"
            )
    distinct: list[Box] = []
    for s in shards:
        if not distinct or distinct[-1] != s.box:
            distinct.append(s.box)
    # Boxes are sorted; overlap checks stay quadratic only among boxes that share a start
    # region, which keeps 1T-parameter layouts (thousands of boxes per tensor) fast.
    _check_tiling(name, shape, distinct, shards)
    return TensorLayout(name, first.dtype, shape, tuple(shards))


_MERGE_KEY = attrgetter("box.offsets", "box.sizes", "rank", "region")
_DTYPE_SHAPE = attrgetter("dtype", "global_shape")
_OFFSETS = attrgetter("box.offsets")
_SIZES = attrgetter("box.sizes")


def _tiles_fast(shards: list[ShardRecord], first: ShardRecord) -> bool:
    """True when the sorted ``shards`` agree on dtype and global shape and their distinct boxes are
    the whole tensor, or tile it along one dim in order: the common layouts, for which the general
    checks of ``merge_tensor_layout`` pass. False means nothing (the general checks decide)."""
    shape = first.global_shape
    n = len(shards)
    if n > 1 and list(map(_DTYPE_SHAPE, shards)).count((first.dtype, shape)) != n:
        return False
    if min(shape, default=0) < 0:
        return False
    nd = len(shape)
    zeros = ZEROS[nd]
    if n == 1:
        box = first.box
        if box.offsets == zeros and box.sizes == shape:
            return True
    offs = list(map(_OFFSETS, shards))
    sizes = list(map(_SIZES, shards))
    if offs.count(zeros) == n and sizes.count(shape) == n:
        return True  # replicas of the whole tensor
    # distinct boxes (replicas are adjacent once sorted) must chain along one dim k from 0 to shape[k]
    z0 = sizes[0]
    if offs[0] != zeros or len(z0) != nd:
        return False
    k = next((d for d in range(nd) if z0[d] != shape[d]), None)
    if k is None:
        return False
    head, tail = shape[:k], shape[k + 1 :]
    pos = 0
    po = pz = None
    for o, z in zip(offs, sizes):
        if o == po and z == pz:
            continue  # a replica of the previous box
        if (
            len(z) != nd
            or z[k] <= 0
            or z[:k] != head
            or z[k + 1 :] != tail
            or o != zeros[:k] + (pos,) + zeros[k + 1 :]
        ):
            return False
        pos += z[k]
        po, pz = o, z
    return pos == shape[k]


def _check_tiling(name: str, shape: tuple[int, ...], boxes: list[Box], shards: list[ShardRecord]) -> None:
    total = math.prod(shape)
    covered = sum(b.numel for b in boxes)
    if len(boxes) > 1:
        # Sweep on dim 0 (or the flat index for 0-d) to find partial overlaps.
        by_start = sorted(boxes, key=lambda b: b.offsets)
        active: list[Box] = []
        for b in by_start:
            active = [a for a in active if a.ndim == 0 or a.ends[0] > b.offsets[0]]
            for a in active:
                if a.intersect(b) is not None and b.numel and a.numel:
                    ra = next(s.rank for s in shards if s.box == a)
                    rb = next(s.rank for s in shards if s.box == b)
                    raise LayoutError(
                        f"tensor {name!r}: shards overlap without being replicas: rank {ra} "
                        f"{a.offsets}+{a.sizes} and rank {rb} {b.offsets}+{b.sizes}"
                    )
            active.append(b)
    if covered != total:
        raise LayoutError(
            f"tensor {name!r}: shards cover {covered} of {total} elements of {shape}; "
            "publisher shards must tile the whole tensor (a gap)"
        )


def group_layouts(records: Iterable[ShardRecord]) -> Mapping[str, TensorLayout]:
    """Merge a version's shard records into one layout per tensor."""
    with GCPaused():
        return _group_layouts(list(records))


def _group_layouts(recs: list[ShardRecord]) -> dict[str, TensorLayout]:
    names = list(map(_NAME, recs))
    last = dict(zip(names, recs))  # name -> its last record: the only one of most tensors
    groups: dict[str, list[ShardRecord]] = {}
    if len(last) != len(recs):  # tensors with several records (replicas, splits) grouped in order
        counts = Counter(names)
        multi = set(compress(counts, map(gt, counts.values(), repeat(1))))
        for r in compress(recs, map(multi.__contains__, names)):
            groups.setdefault(r.name, []).append(r)
    order = sorted(last)
    firsts = list(map(last.__getitem__, order))
    out: dict[str, TensorLayout] = {}
    for n, r, whole in zip(order, firsts, _whole_boxes(firsts)):
        rs = groups.get(n)
        if rs is not None:
            out[n] = merge_tensor_layout(n, rs)
        elif whole:  # one record holding the whole tensor: what merge_tensor_layout returns
            out[n] = frozen_instance(
                TensorLayout, {"name": n, "dtype": r.dtype, "global_shape": r.global_shape, "shards": (r,)}
            )
        else:
            out[n] = merge_tensor_layout(n, (r,))
    return out


_NAME = attrgetter("name")
_GLOBAL_SHAPE = attrgetter("global_shape")


def _whole_boxes(recs: list[ShardRecord]) -> list[bool]:
    """Per record, whether its box is its whole (non-negative) global shape, checked column-wise."""
    shapes = list(map(_GLOBAL_SHAPE, recs))
    if min(chain.from_iterable(shapes), default=0) < 0:
        return [False] * len(recs)
    offs = map(eq, map(_OFFSETS, recs), map(ZEROS.__getitem__, map(len, shapes)))
    sizes = map(eq, map(_SIZES, recs), shapes)
    return list(map(and_, offs, sizes))

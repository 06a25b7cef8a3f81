"""Validating user tensors: the one check of what a caller hands to ``put`` or ``get_into``.

:func:`validate_tensors` turns a user mapping (name -> tensor, :class:`~.layout.Shard`, or a list
of Shards) into sorted :class:`Entry` objects, checking, in order, for each value:

1. the name (:func:`~.layout.validate_name`'s rules, matched by one regular expression first);
2. the box: a plain tensor is the whole tensor, a Shard's offsets must fit its global shape;
3. the dtype (one of :data:`~.dtypes.DTYPES`) and the memory (no negative strides, no element
   shared by two indices);
4. the device (cpu or cuda), and no DTensor left unconverted;
5. for a list of Shards: the boxes agree on dtype and global shape and do not overlap;

then ties entries that view the very same memory (tied weights) into one entry with
``aliases`` (:func:`with_aliases` gives their records). :func:`check_fit` checks a buffer
against a published :class:`~.layout.TensorLayout`.

Every failure is a :class:`~astate_store.errors.LayoutError` naming the tensor, raised before
any byte moves. This module imports only :mod:`.layout` and ``errors``.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch

from astate_store.errors import LayoutError
from astate_store.model.dtypes import TORCH_NAMES, dtype_name, is_floating
from astate_store.model.layout import (
    MAX_NAME_LEN,
    ZEROS,
    Box,
    GCPaused,
    Shard,
    ShardRecord,
    TensorLayout,
    TensorLike,
    frozen_instance,
    validate_name,
)

__all__ = ["Entry", "local_box", "validate_tensors", "with_aliases", "check_fit"]

# validate_name's rules as one regular expression, so a good name costs one C-level match.
_NAME_SEG = r"(?!\.\.(?:/|\Z))[A-Za-z0-9_.\-]+"
_NAME_FAST = re.compile(rf"(?=[^\n]{{1,{MAX_NAME_LEN}}}\Z){_NAME_SEG}(?:/{_NAME_SEG})*").fullmatch

_WHOLE: dict[tuple[int, ...], Box] = {}  # shape -> Box(zeros, shape); Boxes are immutable, so shared


def _check_non_overlapping(name: str, sizes: Sequence[int], strides: Sequence[int]) -> None:
    """Reject memory where two elements share an address (expanded views): a read into it
    would write the same byte twice and a published one has no single value per element."""
    dims = sorted((st, sz) for sz, st in zip(sizes, strides) if sz > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            raise LayoutError(
                f"tensor {name!r}: memory with strides {tuple(strides)} for sizes {tuple(sizes)} "
                "overlaps itself (an expanded or aliased view); pass a .contiguous() copy"
            )
        span += stride * (size - 1)


def _whole_box(shape: tuple[int, ...]) -> Box:
    """``Box((0,) * len(shape), shape)``, the box of a plain tensor: one object per shape."""
    box = _WHOLE.get(shape)
    if box is None:
        if len(_WHOLE) >= 1 << 14:
            _WHOLE.clear()
        box = _WHOLE[shape] = frozen_instance(Box, {"offsets": ZEROS[len(shape)], "sizes": shape})
    return box


def _check_memory(name: str, tensor: torch.Tensor, sizes: tuple[int, ...]) -> None:
    """No negative strides, no element sharing an address (a dense tensor with elements has neither);
    ``sizes`` is ``tuple(tensor.shape)``."""
    if tensor.is_contiguous() and tensor.numel():
        return
    strides = tensor.stride()
    # the dims innermost first are usually already in stride order: if each clears the span of
    # those inside it, that is exactly what _check_non_overlapping would find
    span = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size > 1:
            if stride < span:
                break
            span += stride * (size - 1)
    else:
        if min(strides, default=0) >= 0:
            return
    if any(s < 0 for s in strides):
        raise LayoutError(f"tensor {name!r}: negative strides {strides} are not supported")
    _check_non_overlapping(name, sizes, strides)


def _local_box(name: str, value: object) -> tuple[torch.Tensor, Box, tuple[int, ...], str]:
    """``local_box``: the same checks in the same order, with fewer Python operations."""
    if type(name) is not str or not _NAME_FAST(name):
        validate_name(name)
    if isinstance(value, torch.Tensor):
        tensor = value
        global_shape = sizes = tuple(tensor.shape)
        box = _whole_box(global_shape)
    elif isinstance(value, Shard):
        tensor, global_shape, offsets = value.tensor, value.global_shape, value.offsets
        sizes = tuple(tensor.shape)
        nd = len(sizes)
        if len(offsets) != nd:
            raise LayoutError(f"tensor {name!r}: {len(offsets)} offsets for a {nd}-d tensor of shape {sizes}")
        if len(global_shape) != nd:
            raise LayoutError(
                f"tensor {name!r}: global_shape {global_shape} has {len(global_shape)} dims, "
                f"the local tensor has {nd} (shape {sizes})"
            )
        box = frozen_instance(Box, {"offsets": offsets, "sizes": sizes})
        for o, z, g in zip(offsets, sizes, global_shape):
            if o < 0 or o + z > g:
                raise LayoutError(
                    f"tensor {name!r}: box offsets {offsets} + sizes {sizes} is out of "
                    f"bounds of global shape {global_shape}"
                )
    else:
        raise LayoutError(
            f"tensor {name!r}: expected a torch.Tensor or astate_store.Shard, got {type(value).__name__}"
        )
    dtype = TORCH_NAMES.get(tensor.dtype)
    if dtype is None:
        dtype_name(tensor.dtype, tensor=name)  # raises, naming the tensor
    _check_memory(name, tensor, sizes)
    return tensor, box, global_shape, dtype


def local_box(name: str, value: TensorLike) -> tuple[torch.Tensor, Box, tuple[int, ...], str]:
    """Validate one user entry and return ``(tensor, box, global_shape, dtype_name)``.

    Raises:
        LayoutError: bad name, unsupported dtype, box out of bounds, or aliased memory.
    """
    return _local_box(name, value)


@dataclass(frozen=True, eq=False)
class Entry:
    """One validated user tensor: the local piece and where it sits in the global tensor."""

    name: str
    tensor: torch.Tensor
    box: Box
    global_shape: tuple[int, ...]
    dtype: str
    # other names of the very same memory view (tied weights): published as records of this
    # entry's bytes, filled once (set by validate_tensors; a class default for the common case)
    aliases: tuple[str, ...] = ()

    @functools.cached_property
    def strides(self) -> tuple[int, ...]:
        """The tensor's element strides, asked of torch once (a first pull of 10^4 buffers asked
        it ~4 times per buffer: a tenth of a second)."""
        return tuple(self.tensor.stride())

    def record(
        self, rank: int, region: int = 0, byte_offset: int = 0, *, strides: Sequence[int] | None = None
    ) -> ShardRecord:
        """This entry as a shard of ``rank`` at ``byte_offset`` in ``region``; ``strides`` default to
        the tensor's own (pass ``contiguous_strides`` for a packed copy of it)."""
        st = self.strides if strides is None else tuple(strides)
        fields = {
            "name": self.name,
            "dtype": self.dtype,
            "global_shape": self.global_shape,
            "box": self.box,
            "strides": st,
            "rank": rank,
            "region": region,
            "byte_offset": byte_offset,
        }
        return frozen_instance(ShardRecord, fields)  # type: ignore[return-value]  (checked fields: no __init__ needed)


def validate_tensors(tensors: Mapping[str, TensorLike | Sequence[Shard]], what: str) -> list[Entry]:
    """Every entry of a user mapping checked (name, dtype, box, memory, device), sorted by name
    (the boxes of one name by offsets).

    A value may be a list of ``Shard``s: several boxes of one tensor held by this rank (they must
    agree on dtype and global shape and must not overlap). Entries that are the very same memory
    view under several names (tied weights) become one entry, under the first name in sorted
    order, listing the others in ``Entry.aliases``.

    Raises:
        LayoutError: not a mapping, empty, or an entry that fails :func:`local_box` or sits on a
            device other than cpu/cuda; boxes of one name that overlap or disagree; the message
            names ``what`` or the tensor.
    """
    if not isinstance(tensors, Mapping):
        raise LayoutError(f"{what} must map names to tensors or Shards, got {type(tensors).__name__}")
    if not tensors:
        raise LayoutError(f"{what} is empty")
    out = []
    append = out.append
    multi = False
    with GCPaused():
        for name in sorted(tensors):
            value = tensors[name]
            if isinstance(value, (list, tuple)):
                _append_boxes(out, name, value)
                multi = True
                continue
            append(_entry(name, value))
        if multi:
            out.sort(key=_ENTRY_ORDER)
        return _tie(out)


def _entry(name: str, value: object) -> Entry:
    if _is_dtensor(value.tensor if isinstance(value, Shard) else value):
        raise LayoutError(
            f"tensor {name!r}: a DTensor reached validation unconverted; pass the DTensor itself to "
            "put/get_into (they derive its box from the placements), not wrapped in a Shard"
        )
    t, box, gshape, dtype = _local_box(name, value)
    if not (t.is_cpu or t.is_cuda):
        raise LayoutError(f"tensor {name!r}: device {t.device} is not supported (cpu or cuda)")
    fields = {"name": name, "tensor": t, "box": box, "global_shape": gshape, "dtype": dtype}
    return frozen_instance(Entry, fields)


def _is_dtensor(value: object) -> bool:
    """A torch DTensor (or a Parameter of one), told by its class name: this module imports no
    torch.distributed."""
    cls = type(value)
    return (
        cls is not torch.Tensor
        and isinstance(value, torch.Tensor)
        and any(c.__name__ == "DTensor" for c in cls.__mro__)
    )


def _append_boxes(out: list[Entry], name: str, value: Sequence[object]) -> None:
    """The entries of a list of ``Shard``s of one name (several boxes on this rank).

    Raises:
        LayoutError: an empty list, an element that is not a Shard, boxes disagreeing on dtype
            or global shape, or two boxes that overlap.
    """
    if not value:
        raise LayoutError(f"tensor {name!r}: an empty list of Shards")
    es = []
    for v in value:
        if not isinstance(v, Shard):
            raise LayoutError(
                f"tensor {name!r}: a list value must hold astate_store.Shard boxes, got {type(v).__name__}"
            )
        es.append(_entry(name, v))
    first = es[0]
    for e in es[1:]:
        if e.dtype != first.dtype or e.global_shape != first.global_shape:
            raise LayoutError(
                f"tensor {name!r}: its boxes disagree: {first.dtype} {first.global_shape} and "
                f"{e.dtype} {e.global_shape}"
            )
    _check_disjoint(name, [e.box for e in es])
    out.extend(es)


def _check_disjoint(name: str, boxes: list[Box]) -> None:
    """No two boxes of one name on one rank share an element (the store could not say which
    one's bytes a reader gets, nor fill both). A sweep along dim 0 keeps it near-linear."""
    order = sorted((b for b in boxes if b.numel), key=attrgetter("offsets"))
    active: list[Box] = []
    for b in order:
        active = [a for a in active if a.ndim == 0 or a.ends[0] > b.offsets[0]]
        for a in active:
            if a.intersect(b) is not None or a.ndim == 0:
                raise LayoutError(
                    f"tensor {name!r}: boxes {a.offsets}+{a.sizes} and {b.offsets}+{b.sizes} "
                    "overlap (the boxes of one name must be disjoint)"
                )
        active.append(b)


_ENTRY_ORDER = attrgetter("name", "box.offsets")
_TENSOR = attrgetter("tensor")


def _tie(entries: list[Entry]) -> list[Entry]:
    """Entries viewing the very same memory the same way (tied weights: one Parameter under two
    names) folded into the first, in sorted order, which lists the others as aliases. Empty
    tensors tie nothing (they may share an address with anything)."""
    ptrs = list(map(torch.Tensor.data_ptr, map(_TENSOR, entries)))  # C-level: the common case costs this
    if len(set(ptrs)) == len(ptrs):
        return entries
    counts = Counter(ptrs)
    seen: dict[tuple, int] = {}
    tied: dict[int, list[str]] = {}
    drop = []
    for i, e in enumerate(entries):
        if counts[ptrs[i]] < 2:
            continue
        t = e.tensor
        if not t.numel():
            continue
        key = (ptrs[i], t.device, e.dtype, e.box.offsets, e.box.sizes, e.global_shape, t.stride())
        j = seen.setdefault(key, i)
        if j != i:
            if entries[j].name == e.name:
                raise LayoutError(f"tensor {e.name!r}: the box {e.box.offsets}+{e.box.sizes} is listed twice")
            tied.setdefault(j, []).append(e.name)
            drop.append(i)
    if not tied:
        return entries
    for j, names in tied.items():
        e = entries[j]
        entries[j] = frozen_instance(Entry, {**e.__dict__, "aliases": tuple(names)})
    gone = set(drop)
    return [e for i, e in enumerate(entries) if i not in gone]


def with_aliases(entries: Sequence[Entry], records: list[ShardRecord]) -> list[ShardRecord]:
    """``records`` (one per entry, in order) plus, for tied weights, a record of the same bytes
    under each alias: a consumer may ask for any of the names, and the bytes are staged once."""
    if not any(e.aliases for e in entries):
        return records
    out = []
    for e, r in zip(entries, records):
        out.append(r)
        out.extend(frozen_instance(ShardRecord, {**r.__dict__, "name": a}) for a in e.aliases)
    return out


def check_fit(e: Entry, saved: TensorLayout, source: str) -> None:
    """A buffer can take this tensor: same global shape, and the same dtype or a float -> float
    conversion. ``source`` names where the tensor comes from in the message.

    Raises:
        LayoutError: naming the tensor, both sides and ``source``.
    """
    if saved.global_shape != e.global_shape:
        raise LayoutError(
            f"tensor {e.name!r}: buffer expects global shape {e.global_shape}, {source} has "
            f"global shape {saved.global_shape}"
        )
    if e.dtype != saved.dtype and not (is_floating(e.dtype) and is_floating(saved.dtype)):
        raise LayoutError(
            f"tensor {e.name!r}: buffer dtype {e.dtype} does not match {source}'s dtype "
            f"{saved.dtype}, and {saved.dtype} -> {e.dtype} is not a float conversion"
        )

"""What users pass to ``put`` / ``get_into`` / ``restore`` / ``recover``, in the store's form.

Users hand over ``model.state_dict()``-like mappings: nested dicts, DTensors (FSDP2, tensor
parallel, 2-D meshes), plain tensors, ``Shard``s, lists of ``Shard``s (several boxes of one
name) and sometimes non-tensor entries. :class:`StateDictConverter` turns them into the flat
``{name: Tensor | Shard | list[Shard]}`` mapping that ``validation.validate_tensors`` checks:

- nested mappings are flattened the way torch DCP's ``flatten_state_dict`` names them
  (``{"a": {"b": t}}`` -> ``"a.b"``; lists holding tensors or mappings -> ``"a.0"``, ...);
- a DTensor becomes a ``Shard`` of its local tensor at its global offset (torch's own
  ``compute_local_shape_and_global_offset``); a ``_StridedShard`` whose local rows are not one run
  of global rows becomes one ``Shard`` per run; ``Replicate`` gives the same box on several ranks
  (replicas); ``Partial`` is refused;
- non-tensor entries are refused or skipped (``non_tensors="error" | "skip"``).

A training loop passes a new ``state_dict()`` every step whose values are new objects (``detach``
makes new DTensors and new tensors) over the same memory. The converter hands back the *same*
``Shard`` and tensor objects while each value still views the same memory the same way, so the
validation cache downstream (``validated.ValidatedTensors``, keyed on object identity) hits.
"""

from __future__ import annotations

import logging
import operator
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from astate_store.errors import LayoutError
from astate_store.model.layout import Shard

__all__ = ["NonTensors", "StateDictConverter", "flatten_state_dict", "normalize", "dtensor_shards"]

log = logging.getLogger("astate_store.model.state_dict")

NonTensors = Literal["error", "skip"]
_NON_TENSORS = ("error", "skip")

Value = Any  # torch.Tensor | Shard | list[Shard]


def _dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor`` once that module is loaded, else None: no DTensor can
    exist before it is imported, and importing it here would cost every process seconds (it pulls
    in sympy) whether it uses DTensors or not."""
    global _DTENSOR
    if _DTENSOR is None:
        mod = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(mod, "DTensor", None)
    return _DTENSOR


_DTENSOR: Any = None


# ---- flattening (DCP's naming) -----------------------------------------------------------------


def _is_dtensor_of(value: object, dt_type: type | None) -> bool:
    """Whether ``value`` is a DTensor (``dt_type``, None when torch.distributed has none)."""
    return dt_type is not None and type(value) is not torch.Tensor and isinstance(value, dt_type)


def _items(key: Any, value: object) -> tuple[Iterable[tuple[str, object]], bool]:
    """The (name, leaf) pairs of one top-level entry, and whether it was nested.

    A tensor, a Shard, a list of Shards, anything under a non-string key, and anything that is
    not a mapping or list is one leaf under its own name; the rest is walked (:func:`_walk`).
    """
    if (
        isinstance(value, (torch.Tensor, Shard))
        or type(key) is not str
        or not isinstance(value, (Mapping, list, tuple))
        or _is_shard_list(value)
    ):
        return ((key if type(key) is str else str(key), value),), False
    return _walk(str(key), value), True


def _is_shard_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, Shard) for v in value)


def _has_tensors(value: list) -> bool:
    """DCP traverses a list only when something in it is a tensor or a mapping (or such a list)."""
    for v in value:
        if isinstance(v, (torch.Tensor, Shard, Mapping)) or (isinstance(v, list) and _has_tensors(v)):
            return True
    return False


def _walk(path: str, value: object) -> Iterator[tuple[str, object]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(f"{path}.{k}", v)
    elif isinstance(value, list) and not _is_shard_list(value) and _has_tensors(value):
        for i, v in enumerate(value):
            yield from _walk(f"{path}.{i}", v)
    else:
        yield path, value


def flatten_state_dict(state_dict: Mapping[Any, object], what: str = "state_dict") -> dict[str, object]:
    """Nested mappings (and lists holding tensors) flattened to dotted names, as DCP's
    ``flatten_state_dict`` names them; a list of ``Shard``s stays one entry (boxes of one name).

    Raises:
        LayoutError: two paths flatten to one name (``{"a.b": x, "a": {"b": y}}``).
    """
    out: dict[str, object] = {}
    for k, v in state_dict.items():
        for name, leaf in _walk(str(k), v) if isinstance(v, (Mapping, list)) else ((str(k), v),):
            if name in out:
                raise LayoutError(f"{what}: two entries flatten to the name {name!r}")
            out[name] = leaf
    return out


# ---- DTensors ---------------------------------------------------------------------------------


def _placement_error(name: str, dt: Any) -> None:
    for p in dt.placements:
        if p.is_partial():
            raise LayoutError(
                f"tensor {name!r}: DTensor placement Partial ({p}, a pending reduction) cannot be "
                "published or filled; redistribute it to Shard or Replicate first (e.g. "
                "dt.redistribute(placements=[Replicate()]))"
            )


def _runs(index: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive global indices as (local start, global start, length)."""
    out: list[tuple[int, int, int]] = []
    for i, g in enumerate(index):
        if out and out[-1][1] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, g, 1))
    return out


def _strided_boxes(
    name: str, dt: Any, gshape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(local start, global offset, sizes) of each box of a DTensor with a ``_StridedShard``:
    torch's per-dim global indices of the local rows (its ``_get_shard_size_and_offsets``, the
    steps of ``compute_local_shape_and_global_offset``), cut into runs of consecutive rows."""
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    local = list(gshape)
    index: dict[int, Any] = {}
    for mdim, p in enumerate(dt.placements):
        if not isinstance(p, (TShard, _StridedShard)):
            continue
        size, idx = _get_shard_size_and_offsets(
            local[p.dim], mesh.size(mdim), coord[mdim], p, index.get(p.dim), gshape[p.dim], False
        )
        local[p.dim] = size
        index[p.dim] = idx
    per_dim = []
    for d, n in enumerate(local):
        if d in index and n:
            per_dim.append(_runs([int(v) for v in index[d].tolist()][:n]))
        else:
            per_dim.append([(0, 0 if d not in index else gshape[d], n)])
    boxes = [((), (), ())]
    for runs in per_dim:
        boxes = [(a + (r[0],), b + (r[1],), c + (r[2],)) for a, b, c in boxes for r in runs]
    return boxes


def dtensor_shards(name: str, dt: Any) -> Shard | list[Shard]:
    """This rank's piece of a DTensor: a ``Shard`` of its local tensor (no copy), or one per run of
    global rows when a ``_StridedShard`` interleaves them.

    Raises:
        LayoutError: a ``Partial`` placement, this rank outside the DTensor's mesh, or a local
            tensor that is not the shape torch's placement arithmetic says (padded storage).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    _placement_error(name, dt)
    mesh, placements = dt.device_mesh, tuple(dt.placements)
    if mesh.get_coordinate() is None:
        raise LayoutError(f"tensor {name!r}: this rank is not in the DTensor's device mesh {mesh}")
    local = dt._local_tensor  # the DTensor's own local tensor: filled in place, data_ptr() unchanged
    gshape = tuple(int(s) for s in dt.shape)
    if any(isinstance(p, _StridedShard) for p in placements):
        boxes = _strided_boxes(name, dt, gshape)
        _check_local(name, local, _distinct_extent(boxes), placements)
        if len(boxes) > 1:
            return [Shard(_narrow(local, start, sizes), off, gshape) for start, off, sizes in boxes]
        return Shard(local, boxes[0][1], gshape)
    lshape, offset = compute_local_shape_and_global_offset(gshape, mesh, placements)
    _check_local(name, local, tuple(lshape), placements)
    return Shard(local, offset, gshape)


def _distinct_extent(
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]],
) -> tuple[int, ...]:
    """The local shape the boxes cover (per dim: the last box's local end along that dim)."""
    nd = len(boxes[0][0])
    return tuple(max(b[0][d] + b[2][d] for b in boxes) for d in range(nd))


def _narrow(t: torch.Tensor, start: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (s, n) in enumerate(zip(start, sizes)):
        if s or n != t.shape[d]:
            t = t.narrow(d, s, n)
    return t


def _check_local(name: str, local: torch.Tensor, lshape: tuple[int, ...], placements: tuple) -> None:
    if tuple(local.shape) != tuple(lshape):
        raise LayoutError(
            f"tensor {name!r}: DTensor local tensor has shape {tuple(local.shape)} but placements "
            f"{placements} give {tuple(lshape)} on this rank (padded local storage is not supported)"
        )


# ---- the converter ----------------------------------------------------------------------------


class StateDictConverter:
    """Converts one call site's mappings (``put``'s, ``get_into``'s), reusing what it built last
    call for values that still view the same memory the same way.

    Args:
        what: how the messages name the argument (``"put(tensors)"``).
    """

    def __init__(self, what: str):
        self.what = what
        self._last_in: list[object] = []  # the values of the last flat input (fast path)
        self._last_names: list[str] = []
        self._last_locals: list[tuple[int, object]] = []  # (index, local tensor) of each DTensor value
        self._last_out: dict[str, Value] | None = None
        # (id of the DTensor's spec, local data_ptr) -> (spec, a tensor of the result, result):
        # DTensor.detach() (what state_dict() does) keeps the spec object, so its id is stable
        self._dt: dict[tuple[int, int], tuple[Any, torch.Tensor, Value]] = {}
        # (data_ptr, shape, stride, dtype) -> the tensor object handed out last time
        self._plain: dict[tuple[Any, ...], torch.Tensor] = {}

    def convert(self, tensors: Mapping[Any, object], non_tensors: NonTensors = "error") -> dict[str, Value]:
        """``tensors`` in the store's form: ``{name: Tensor | Shard | list[Shard]}``.

        1. the arguments are checked; the very same flat input as last call returns last call's
           output at once (:meth:`_same_input`);
        2. each top-level entry is flattened into (name, leaf) pairs (:func:`_items`: nested
           mappings and lists get dotted names);
        3. each leaf is converted (:meth:`_leaf`): a DTensor to its Shards, a plain tensor kept
           (last call's object when it views the same memory), Shards as they are, anything else
           skipped or refused;
        4. a flat input is remembered for step 1 of the next call (:meth:`_remember`), and last
           call's output object is returned when nothing changed (:meth:`_reuse`).

        Raises:
            LayoutError: not a mapping, a bad ``non_tensors``, a non-tensor entry (with
                ``non_tensors="error"``), a ``Partial`` DTensor, or two paths flattening to one name.
        """
        if non_tensors not in _NON_TENSORS:
            raise LayoutError(f"{self.what}: non_tensors must be 'error' or 'skip', got {non_tensors!r}")
        if not isinstance(tensors, Mapping):
            raise LayoutError(
                f"{self.what} must map names to tensors or Shards, got {type(tensors).__name__}"
            )
        if self._last_out is not None and self._same_input(tensors):
            return self._last_out  # the very same values as last call (a dict of live parameters)
        dt_type = _dtensor_type()
        old = (self._dt, self._plain)  # last call's conversions, reused where still valid
        self._dt, self._plain = {}, {}
        out: dict[str, Value] = {}
        flat = True
        for k, v in tensors.items():
            items, nested = _items(k, v)
            flat = flat and not nested
            for name, leaf in items:
                if name in out:
                    raise LayoutError(f"{self.what}: two entries flatten to the name {name!r}")
                value = self._leaf(name, leaf, dt_type, old, non_tensors)
                if value is not None:
                    out[name] = value
        self._remember(tensors, flat, dt_type)
        out = self._reuse(out)
        self._last_out = out
        return out

    def _leaf(
        self, name: str, leaf: object, dt_type: type | None, old: tuple[dict, dict], non_tensors: NonTensors
    ) -> Value | None:
        """One leaf in the store's form; None for a non-tensor that ``non_tensors`` skips.

        Raises:
            LayoutError: a non-tensor with ``non_tensors="error"``, or a ``Partial`` DTensor.
        """
        if isinstance(leaf, torch.Tensor):
            if _is_dtensor_of(leaf, dt_type):
                return self._dtensor(name, leaf, old[0])
            return self._tensor(leaf, old[1])
        if isinstance(leaf, Shard) or _is_shard_list(leaf):
            return leaf  # type: ignore[return-value]
        if non_tensors == "skip":
            log.debug("%s: skipping non-tensor entry %r (%s)", self.what, name, type(leaf).__name__)
            return None
        raise LayoutError(
            f"{self.what}: entry {name!r} is a {type(leaf).__name__}, not a tensor; pass "
            "non_tensors='skip' to leave such entries out"
        )

    def _remember(self, tensors: Mapping[Any, object], flat: bool, dt_type: type | None) -> None:
        """Note a flat input (its names, values, and each DTensor's local tensor) so the very same
        input next call is answered at once; a nested one is not remembered."""
        if not flat:
            self._last_names, self._last_in, self._last_locals = [], [], []
            return
        self._last_names, self._last_in = list(tensors), list(tensors.values())
        self._last_locals = [
            (i, v._local_tensor)  # type: ignore[attr-defined]
            for i, v in enumerate(self._last_in)
            if _is_dtensor_of(v, dt_type)
        ]

    def _reuse(self, out: dict[str, Value]) -> dict[str, Value]:
        """The last output object itself when nothing changed (cheaper checks downstream)."""
        last = self._last_out
        if (
            last is not None
            and len(last) == len(out)
            and list(last) == list(out)
            and all(a is b for a, b in zip(last.values(), out.values()))
        ):
            return last
        return out

    def _same_input(self, tensors: Mapping[Any, object]) -> bool:
        """The very same values as the last flat input, and each DTensor still on the same local
        tensor object (FSDP2 swaps ``_local_tensor`` after ``to()`` / ``load_state_dict``).
        Storage moved under a tensor (``set_``) is caught by the validation cache downstream."""
        if not self._last_names or len(tensors) != len(self._last_names) or list(tensors) != self._last_names:
            return False
        if not all(map(operator.is_, tensors.values(), self._last_in)):
            return False
        vals = self._last_in
        return all(vals[i]._local_tensor is t for i, t in self._last_locals)  # type: ignore[attr-defined]

    def _dtensor(self, name: str, dt: Any, old: dict) -> Value:
        spec, local = dt._spec, dt._local_tensor
        ptr = local.data_ptr()
        key = (id(spec), ptr)
        hit = old.get(key)
        # the same spec object (detach keeps it: same mesh, placements, global shape) over the same
        # memory, and the tensor handed out last time still there (not moved by set_)
        if hit is not None and hit[0] is spec and hit[1].data_ptr() == ptr:
            self._dt[key] = hit
            return hit[2]
        res = dtensor_shards(name, dt)
        self._dt[key] = (spec, (res if isinstance(res, Shard) else res[0]).tensor, res)
        return res

    def _tensor(self, t: torch.Tensor, old: dict) -> torch.Tensor:
        # a data_ptr names one place in one address space (CUDA's unified addressing included)
        key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
        hit = old.get(key)
        if hit is not None and hit.data_ptr() == key[0] and hit.shape == key[1] and hit.stride() == key[2]:
            # the same memory viewed the same way: hand out last call's object (an alias of it)
            self._plain[key] = hit
            return hit
        self._plain[key] = t
        return t


def normalize(
    tensors: Mapping[Any, object], what: str, non_tensors: NonTensors = "error"
) -> dict[str, Value]:
    """One conversion without a cache (``restore``, ``recover``); see :class:`StateDictConverter`."""
    return StateDictConverter(what).convert(tensors, non_tensors)

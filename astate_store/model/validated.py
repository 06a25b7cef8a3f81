"""Validated user tensors, cached across calls: a training loop passes the same tensor objects
every step, and with 10^5 tensors validating them again would cost more than the step.

The check that the mapping is unchanged allocates nothing the garbage collector tracks (a
collection during a 10,000-buffer pull cost more than the check itself).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from operator import attrgetter

import torch

from astate_store.model.layout import Shard, TensorLike
from astate_store.model.validation import Entry, validate_tensors

__all__ = ["ValidatedTensors", "Fingerprint"]

_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_STRIDE = torch.Tensor.stride
_NAME, _DTYPE, _TENSOR = attrgetter("name"), attrgetter("dtype"), attrgetter("tensor")
_OFFSETS, _SIZES = attrgetter("box.offsets"), attrgetter("box.sizes")


def _tensors_of(values: list[object]) -> list[torch.Tensor]:
    """The tensors of a mapping's values, a list of Shards (boxes of one name) contributing each."""
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(s.tensor for s in v)
        else:
            out.append(v.tensor if isinstance(v, Shard) else v)  # type: ignore[arg-type]
    return out


class Fingerprint:
    """A large tuple used as a cache key, hashed once: a steady-state lookup with the same
    object compares by identity instead of walking 10^5 entries."""

    __slots__ = ("items", "_hash")

    def __init__(self, items: tuple[object, ...]):
        self.items, self._hash = items, hash(items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Fingerprint) and self._hash == other._hash and self.items == other.items
        )


class ValidatedTensors:
    """The entries of the last mapping validated, reused while the same tensor objects sit at the
    same addresses with the same sizes."""

    def __init__(self, what: str):
        self.what = what
        self.entries: list[Entry] = []
        self.fingerprint: Fingerprint | None = None  # names, boxes, dtypes, strides, addresses
        self._names: list[str] = []
        self._values: list[object] = []
        self._tensors: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._numels: list[int] = []
        self._lists = False  # some value is a list of Shards (several boxes of one name)

    def _same(self, tensors: Mapping[str, TensorLike]) -> bool:
        """Same names, the very same objects, and their storages not moved or resized. Every
        comparison runs in C (``map`` over lists): no Python bytecode runs per tensor."""
        if len(tensors) != len(self._names) or not self._names:
            return False
        if list(tensors) != self._names or not all(map(operator.is_, tensors.values(), self._values)):
            return False
        # Same objects (a Shard is frozen, so its tensor is the same too; a list of Shards may
        # have been changed in place); a tensor's storage may still have been swapped under it.
        if self._lists and not all(map(operator.is_, _tensors_of(self._values), self._tensors)):
            return False
        return (
            list(map(_DATA_PTR, self._tensors)) == self._ptrs
            and list(map(_NUMEL, self._tensors)) == self._numels
        )

    def validate(self, tensors: Mapping[str, TensorLike]) -> list[Entry]:
        """The mapping's entries (the cached list object itself when nothing changed).

        Raises:
            LayoutError: see :func:`astate_store.model.validation.validate_tensors`.
        """
        if self._same(tensors):
            return self.entries
        entries = validate_tensors(tensors, self.what)
        self._names, self._values = list(tensors), list(tensors.values())
        self._tensors = _tensors_of(self._values)
        self._lists = any(isinstance(v, (list, tuple)) for v in self._values)
        self._ptrs, self._numels = list(map(_DATA_PTR, self._tensors)), list(map(_NUMEL, self._tensors))
        self.entries = entries
        # names, boxes, dtypes, strides and addresses, as tuples of ints and strs: built and hashed in
        # C (a Box is a dataclass hashed in Python, one call per tensor of a first pull)
        tensors = list(map(_TENSOR, entries))
        self.fingerprint = Fingerprint(
            tuple(
                zip(
                    map(_NAME, entries),
                    map(_OFFSETS, entries),
                    map(_SIZES, entries),
                    map(_DTYPE, entries),
                    map(_STRIDE, tensors),
                    map(_DATA_PTR, tensors),
                )
            )
        )
        return entries

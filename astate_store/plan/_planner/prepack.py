"""Pre-pack requests: contiguous or converted copies that publishers build for consumers.

A column slice of a row-major shard is one small run per row; a buffer of another float dtype
would be converted on every consumer. Consumers ask (``consumers/<id>`` in the catalog) for the
pieces the planner's cost model picks and for converted copies; each publisher builds the ones
it can serve in its snapshot slots at its next put. Both sides are pure functions here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from astate_store.model.dtypes import is_floating
from astate_store.model.layout import Box, TensorLayout
from astate_store.model.validation import Entry
from astate_store.plan.contracts import PackItem

__all__ = ["PackRequest", "Copy", "consumer_requests", "servable"]

# (publisher rank, tensor, box, dtype to convert to or None)
PackRequest = tuple[int, str, Box, "str | None"]


def consumer_requests(
    items: Iterable[PackItem], layouts: Mapping[str, TensorLayout], convert: Sequence[Entry], rotation: int
) -> list[PackRequest]:
    """What one consumer asks for: the planner's contiguous pack items, plus, per buffer of
    another float dtype, its intersection with each distinct published box from one replica
    (spread over replicas by the consumer's rotation)."""
    packs: list[PackRequest] = [(it.source.rank, it.source.name, it.box, None) for it in items]
    for e in convert:
        by_box: dict[Box, list[int]] = {}
        for s in layouts[e.name].shards:
            by_box.setdefault(s.box, []).append(s.rank)
        for box, ranks in sorted(by_box.items(), key=lambda kv: (kv[0].offsets, kv[0].sizes)):
            piece = e.box.intersect(box)
            if piece is not None:
                packs.append((sorted(ranks)[rotation % len(ranks)], e.name, piece, e.dtype))
    return packs


Copy = tuple[int, Box, "str | None"]  # (entry index, box inside it, dtype to convert to or None)


def servable(
    requests: Iterable[tuple[str, str, Box, str | None]], entries: Sequence[Entry]
) -> tuple[Copy, ...]:
    """The copies this publisher can build from its entries, one per (tensor, box, dtype) however
    many consumers ask for it: the box must lie inside one entry, and a conversion must be float
    to float. Sorted, so the same requests always give the same slot layout."""
    index: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        index.setdefault(e.name, []).append(i)
    out: set[Copy] = set()
    for _consumer, name, box, dtype in requests:
        for i in index.get(name, ()):
            e = entries[i]
            # A request from etcd is a stranger's word: its box must have the tensor's dims.
            if (
                box.ndim == e.box.ndim
                and e.box.intersect(box) == box
                and box.numel
                and (dtype is None or (is_floating(dtype) and is_floating(e.dtype)))
            ):
                out.add((i, box, None if dtype == e.dtype else dtype))
                break
    return tuple(sorted(out, key=lambda c: (c[0], c[1].offsets, c[1].sizes, c[2] or "")))

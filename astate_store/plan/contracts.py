"""The planner's public vocabulary: record dtypes, the cost model, the network model (where
publishers and consumers sit) and the pre-pack round-trip records. Every stage speaks these."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from astate_store.model.dtypes import itemsize
from astate_store.model.layout import Box, ShardRecord, contiguous_strides
from astate_store.plan._planner.templates import rel_offsets, run_template
from astate_store.plan._planner.util import sort_key

#: One read: copy ``length`` source bytes from ``src_offset`` of region ``src_region`` of
#: publisher ``src_rank`` to ``dst_offset`` of the consumer's buffer ``dst_region``. With
#: ``convert`` the bytes are ``length // itemsize(src_dtype)`` elements of ``src_dtype`` to be
#: written as ``dst_dtype`` (``length // isz_src * isz_dst`` destination bytes). ``tensor`` indexes
#: ``plan.tensors``; ``dst_index`` is the index of the destination record in the consumer's
#: request (for a read merged across records: the first one). ``src_dtype`` and ``dst_dtype`` are
#: dtype codes (``model.dtypes.DTYPE_NAMES``).
READ_DTYPE = np.dtype(
    [
        ("src_offset", "<i8"),
        ("dst_offset", "<i8"),
        ("length", "<i8"),
        ("src_rank", "<i4"),
        ("src_region", "<i4"),
        ("dst_region", "<i4"),
        ("tensor", "<i4"),
        ("dst_index", "<i4"),
        ("src_dtype", "u1"),
        ("dst_dtype", "u1"),
        ("convert", "?"),
    ],
    align=True,
)

#: A publisher-local copy run used to build a packed copy (``PackItem.copy_runs``).
COPY_DTYPE = np.dtype([("src_offset", "<i8"), ("dst_offset", "<i8"), ("length", "<i8")])


@dataclass(frozen=True)
class CostModel:
    """Costs the planner weighs (rates in 1e9 bytes per second).

    A piece is pre-packed when the reads it saves cost more than the publisher's copy:
    ``(runs_direct - runs_packed) * per_read_seconds > nbytes / (copy_gb_per_s * 1e9)``.
    The link time of the piece is the same either way (same bytes), so it does not enter the
    decision; ``link_gb_per_s`` is used by ``read_seconds`` estimates.
    """

    per_read_seconds: float = 5e-6
    copy_gb_per_s: float = 10.0
    link_gb_per_s: float = 50.0
    prepack: bool = True

    def pack_pays(self, saved_reads: Any, nbytes: Any) -> Any:
        """Whether packing pays (works elementwise on numpy arrays)."""
        if not self.prepack:
            return np.zeros(np.shape(saved_reads), dtype=bool)
        return np.asarray(saved_reads) * self.per_read_seconds > np.asarray(nbytes) / (
            self.copy_gb_per_s * 1e9
        )

    def read_seconds(self, reads: int, nbytes: int) -> float:
        """Serial estimate of one link moving ``nbytes`` in ``reads`` reads."""
        return reads * self.per_read_seconds + nbytes / (self.link_gb_per_s * 1e9)


@dataclass(frozen=True)
class Placement:
    """Where a publisher rank or a consumer sits. ``nic`` names the NIC / rail; equal ``nic`` on
    two hosts means the same rail. Two ranks with the same (host, nic) share a link."""

    host: str
    numa: int | None = None
    nic: str | None = None


@dataclass(frozen=True, init=False)
class Fabric:
    """The network model the planner balances on: placements of publisher ranks (``sources``)
    and consumers (``consumers``); either may be partial. Stored as sorted tuples so the object
    is hashable (it is part of the ``Planner`` fingerprint).

    Not to be confused with ``astate_store.transport.topology.Topology`` (this host's NUMA/NIC layout read
    from sysfs): a ``Fabric`` is the fleet-wide fluid model of who sits on which link."""

    sources: tuple
    consumers: tuple

    def __init__(
        self,
        sources: Mapping[int, Placement] | None = None,
        consumers: Mapping[Hashable, Placement] | None = None,
    ):
        object.__setattr__(self, "sources", tuple(sorted((int(k), v) for k, v in (sources or {}).items())))
        object.__setattr__(
            self,
            "consumers",
            tuple(sorted(((k, v) for k, v in (consumers or {}).items()), key=lambda kv: sort_key(kv[0]))),
        )

    def source_map(self) -> dict:
        return dict(self.sources)

    def consumer_map(self) -> dict:
        return dict(self.consumers)


@dataclass(frozen=True)
class PackItem:
    """Ask publisher ``source.rank`` to copy ``box`` (inside ``source.box``) of ``source`` into a
    contiguous row-major buffer that ``consumers`` will read instead of many small runs."""

    source: ShardRecord
    box: Box
    consumers: tuple

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.source.dtype)

    @property
    def key(self) -> tuple:
        """Identity of the copy (publishers can dedupe items from independent consumer plans)."""
        s = self.source
        return (s.name, s.rank, s.region, s.byte_offset, self.box.offsets, self.box.sizes)

    def packed_record(self, region: int, byte_offset: int) -> ShardRecord:
        """The contiguous record describing the built copy."""
        s = self.source
        return ShardRecord(
            s.name,
            s.dtype,
            s.global_shape,
            self.box,
            contiguous_strides(self.box.sizes),
            s.rank,
            int(region),
            int(byte_offset),
        )

    def packed(self, region: int, byte_offset: int) -> PackedShard:
        return PackedShard(self.packed_record(region, byte_offset), self.consumers)

    def copy_runs(self) -> np.ndarray:
        """Runs (``COPY_DTYPE``) that build the copy: ``src_offset`` is absolute in the source
        region, ``dst_offset`` relative to the start of the packed buffer."""
        s = self.source
        nd = len(self.box.sizes)
        isz = itemsize(s.dtype)
        if self.box.numel == 0:
            return np.zeros(0, COPY_DTYPE)
        tm = run_template(self.box.sizes, tuple(s.strides), contiguous_strides(self.box.sizes))
        src_rel, dst_rel = rel_offsets(tm, isz, isz)
        base = s.byte_offset + isz * sum(
            (self.box.offsets[d] - s.box.offsets[d]) * s.strides[d] for d in range(nd)
        )
        out = np.empty(len(src_rel), COPY_DTYPE)
        out["src_offset"] = base + src_rel
        out["dst_offset"] = dst_rel
        out["length"] = tm[1] * isz
        return out


@dataclass(frozen=True)
class PackedShard:
    """A packed copy published back: ``record`` (usually contiguous) serves ``consumers``."""

    record: ShardRecord
    consumers: tuple


#: Packed copies as callers pass them: ``PackedShard``s (or ``(record, consumers)`` pairs), or
#: consumer id -> records.
PackedInput = Union[None, Iterable[PackedShard], Mapping[Hashable, Sequence[ShardRecord]]]

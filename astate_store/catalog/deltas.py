"""Delta records (``schemas/delta.json``): a rank's change map of a version, as the catalog
writes and reads it. Pure: no etcd access here.

A publisher with ``delta=True`` writes one per put, next to its piece
(``versions/<step>/deltas/<epoch>/<rank>``, in the piece's transaction). Readers attach it to the
piece it belongs to; one that fails its schema, its key or its piece is skipped and counted like
any bad record, and the piece stays good: its consumers pull that version whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from astate_store.errors import CodecError
from astate_store.model import codec
from astate_store.model import delta_format as fmt

__all__ = ["Delta", "delta_record", "delta_from_record"]


@dataclass(frozen=True)
class Delta:
    """Where one rank's change map of one version lies in its staging region (docs/delta.md)."""

    base: int | None  # the version the changes are relative to; None: read every tile whole
    region: int  # the registered region holding the rows and the changes
    index_offset: int  # byte offset of the first index row in that region
    tiles: int  # index rows (32 bytes each)
    data_offset: int  # the encoded changes lie in [data_offset, data_offset + data_bytes)
    data_bytes: int
    changed: int  # elements changed since base (all of them without a base)
    elements: int  # elements of the rank's shards
    digest: int  # XXH3-64 of the tile digests in row order (0: none computed)

    @property
    def fraction(self) -> float:
        """The fraction of the rank's elements that changed (1.0 without a base)."""
        return 1.0 if self.base is None or not self.elements else self.changed / self.elements


def delta_record(step: int, epoch: int, rank: int, layout_id: str, d: Delta) -> dict[str, Any]:
    """The record fields (without ``schema``) of ``d`` for the piece (step, epoch, rank, layout)."""
    rec: dict[str, Any] = {
        "format": fmt.FORMAT,
        "step": step,
        "epoch": epoch,
        "rank": rank,
        "layout_id": layout_id,
        "region": d.region,
        "index_offset": d.index_offset,
        "tiles": d.tiles,
        "data_offset": d.data_offset,
        "data_bytes": d.data_bytes,
        "changed": d.changed,
        "elements": d.elements,
        "digest": "%016x" % d.digest,
    }
    if d.base is not None:
        rec["base"] = d.base
    return rec


def delta_from_record(value: bytes, step: int, epoch: int, rank: int, layout_id: str) -> Delta:
    """The delta record ``value`` read under ``versions/<step>/deltas/<epoch>/<rank>``, checked
    against its schema, its key and the piece it belongs to (same layout).

    Raises:
        CodecError: it fails its schema, or names another step, epoch, rank or layout, a base
            that is not older than its step, more changed elements than elements, or changes
            outside the region's addresses.
    """
    r = codec.decode("delta", value)
    if (r["step"], r["epoch"], r["rank"]) != (step, epoch, rank):
        raise CodecError(
            f"delta record of step {r['step']} epoch {r['epoch']} rank {r['rank']} under this key"
        )
    if r["layout_id"] != layout_id:
        raise CodecError(f"delta record of layout {r['layout_id']}, its piece's is {layout_id}")
    base = r.get("base")
    if base is not None and base >= step:
        raise CodecError(f"delta record's base {base} is not older than its step {step}")
    if r["changed"] > r["elements"]:
        raise CodecError(f"delta record says {r['changed']} of {r['elements']} elements changed")
    for name in ("index_offset", "data_offset"):
        if r[name] + (r["tiles"] * 32 if name == "index_offset" else r["data_bytes"]) >= 1 << 63:
            raise CodecError(f"delta record's {name} range passes 2^63")
    return Delta(
        base,
        r["region"],
        r["index_offset"],
        r["tiles"],
        r["data_offset"],
        r["data_bytes"],
        r["changed"],
        r["elements"],
        int(r["digest"], 16),
    )


def deltas_of(pieces: Mapping[int, Any]) -> dict[int, Delta]:
    """Per rank, the delta record of its piece (ranks without one left out)."""
    return {r: p.delta for r, p in pieces.items() if getattr(p, "delta", None) is not None}

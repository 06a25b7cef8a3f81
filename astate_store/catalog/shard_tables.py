"""The column-wise wire form of a rank's shards: manifests (boxes, leaseless and
content-addressed) and layouts (addresses and the transport descriptor of a live source).

Pure functions and data only, like :mod:`astate_store.catalog.records`, which re-exports every
name here; the catalog's other modules import them from there.

Writing: :func:`manifest_record`, then :func:`layout_record` against that manifest. Reading:
:func:`manifest_from_record`, then :func:`layout_from_record` (checked against the key's id).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astate_store.errors import CodecError, LayoutError
from astate_store.model.dtypes import DTYPE_CODES, DTYPE_NAMES
from astate_store.model.layout import (
    Box,
    GCPaused,
    ShardColumns,
    ShardRecord,
    contiguous_strides,
    frozen_instance,
)

__all__ = [
    "Layout",
    "LazyRecords",
    "Manifest",
    "manifest_record",
    "manifest_from_record",
    "layout_record",
    "layout_from_record",
    "manifest_id_of",
    "layout_id_of",
]


@dataclass(frozen=True)
class Layout:
    """A live source: its shards (boxes from its manifest, addresses from its layout record),
    its transport descriptor, and the pre-packed copies it built for any consumer."""

    layout_id: str
    epoch: int
    rank: int
    shards: Sequence[ShardRecord]  # a tuple, or (decoded) ``LazyRecords``
    transport: bytes
    packed: tuple[ShardRecord, ...] = ()
    manifest_id: str = ""
    # the shards column-wise (from the records; a first pull plans from these, not 10^4 records)
    columns: ShardColumns | None = field(default=None, compare=False, repr=False)


class LazyRecords(Sequence[ShardRecord]):
    """A decoded layout's shard records, built on first use from its checked columns (which
    cannot fail): a first pull planned from the columns (``plan/_planner/columns.py``) never needs
    them, and building one Python object per shard is most of what decoding would cost. Equal to
    (and hashes as) the tuple of its records; pickles as it."""

    __slots__ = ("_n", "_build", "_recs")

    def __init__(self, n: int, build: Callable[[], tuple[ShardRecord, ...]]) -> None:
        self._n, self._build, self._recs = n, build, None

    def records(self) -> tuple[ShardRecord, ...]:
        recs = self._recs
        if recs is None:  # two threads may both build: the same records, one of them kept
            recs = self._recs = self._build()
        return recs

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        return self.records()[i]

    def __iter__(self) -> Iterator[ShardRecord]:
        return iter(self.records())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyRecords):
            other = other.records()
        return self.records() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.records())

    def __reduce__(self) -> tuple[Any, ...]:
        return tuple, (self.records(),)

    def __repr__(self) -> str:
        return f"LazyRecords({self._n} shards{'' if self._recs is None else ', built'})"


_I64 = np.dtype("<i8")


def _i64(data: bytes, what: str, n: int | None = None) -> np.ndarray:
    if len(data) % 8:
        raise CodecError(f"{what}: {len(data)} bytes is not a whole number of int64 values")
    a = np.frombuffer(data, dtype=_I64)
    if n is not None and len(a) != n:
        raise CodecError(f"{what}: {len(a)} values, expected {n}")
    return a


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=12)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class Manifest:
    """What one rank holds, column-wise: shard i is ``names[i]`` of dtype ``DTYPE_NAMES[dtypes[i]]``
    with ``ndims[i]`` dims whose global shape, offsets and sizes start at ``starts[i]`` of the flat
    columns. Leaseless and content-addressed: a committed version is described by its manifests
    whichever ranks are alive."""

    manifest_id: str
    names: tuple[str, ...]
    dtypes: np.ndarray
    ndims: np.ndarray
    global_shapes: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.ndims, dtype=np.int64)])

    def records(
        self,
        rank: int,
        strides: np.ndarray | None = None,
        regions: np.ndarray | None = None,
        byte_offsets: np.ndarray | None = None,
    ) -> tuple[ShardRecord, ...]:
        """The shards as records of ``rank`` (addresses from a layout, else contiguous at 0)."""
        st = self.starts.tolist()
        gs, of, sz = self.global_shapes.tolist(), self.offsets.tolist(), self.sizes.tolist()
        strs = strides.tolist() if strides is not None else None
        regs = regions.tolist() if regions is not None else [0] * len(self.names)
        boffs = byte_offsets.tolist() if byte_offsets is not None else [0] * len(self.names)
        dts = [DTYPE_NAMES[c] for c in self.dtypes.tolist()]
        out = []
        # Checked columns (``_table``): the records are built without the dataclasses' __init__
        # (the columns were checked whole: per-record checks would repeat them once per shard on a
        # consumer's first step), the GC paused meanwhile.
        with GCPaused():
            for i, name in enumerate(self.names):
                a, b = st[i], st[i + 1]
                sizes = tuple(sz[a:b])
                rec_strides = tuple(strs[a:b]) if strs is not None else contiguous_strides(sizes)
                box = frozen_instance(Box, {"offsets": tuple(of[a:b]), "sizes": sizes})
                out.append(
                    frozen_instance(
                        ShardRecord,
                        {
                            "name": name,
                            "dtype": dts[i],
                            "global_shape": tuple(gs[a:b]),
                            "box": box,
                            "strides": rec_strides,
                            "rank": rank,
                            "region": regs[i],
                            "byte_offset": boffs[i],
                        },
                    )
                )
        return tuple(out)


def _columns(shards: Sequence[ShardRecord]) -> dict[str, Any]:
    """The manifest columns of ``shards`` (names, dtypes, ndims, global shapes, offsets, sizes)."""
    nd = [len(s.global_shape) for s in shards]
    flat = lambda get: np.fromiter((v for s in shards for v in get(s)), _I64, sum(nd)).tobytes()  # noqa: E731
    return {
        "names": [s.name for s in shards],
        "dtypes": bytes(DTYPE_CODES[s.dtype] for s in shards),
        "ndims": bytes(nd),
        "global_shapes": flat(lambda s: s.global_shape),
        "offsets": flat(lambda s: s.box.offsets),
        "sizes": flat(lambda s: s.box.sizes),
    }


def manifest_id_of(cols: Mapping[str, Any]) -> str:
    """The content-addressed id of a manifest's columns (what its key and ``manifest_id`` name)."""
    return _digest(
        "\0".join(cols["names"]).encode(),
        cols["dtypes"],
        cols["ndims"],
        cols["global_shapes"],
        cols["offsets"],
        cols["sizes"],
    )


def manifest_record(shards: Sequence[ShardRecord]) -> dict[str, Any]:
    """The ``manifest`` record of a rank's shards (boxes only; addresses live in the layout)."""
    cols = _columns(shards)
    return {"manifest_id": manifest_id_of(cols), **cols}


def _table(rec: Mapping[str, Any], what: str) -> tuple[np.ndarray, ...]:
    """Checked columns of a manifest-like record: (dtypes, ndims, global_shapes, offsets, sizes)."""
    n = len(rec["names"])
    dtypes = np.frombuffer(rec["dtypes"], np.uint8)
    ndims = np.frombuffer(rec["ndims"], np.uint8)
    if len(dtypes) != n or len(ndims) != n:
        raise CodecError(f"{what}: {n} names but {len(dtypes)} dtypes and {len(ndims)} ndims")
    if n and int(dtypes.max()) >= len(DTYPE_NAMES):
        raise CodecError(f"{what}: unknown dtype code {int(dtypes.max())}")
    total = int(ndims.sum(dtype=np.int64))
    gs = _i64(rec["global_shapes"], f"{what} global_shapes", total)
    of = _i64(rec["offsets"], f"{what} offsets", total)
    sz = _i64(rec["sizes"], f"{what} sizes", total)
    # of > gs - sz would overflow for huge values; gs - of cannot (both are >= 0 by then).
    if (gs < 0).any() or (of < 0).any() or (sz < 0).any() or (of > gs).any() or (sz > gs - of).any():
        raise CodecError(f"{what}: a box lies outside its tensor's global shape")
    return dtypes, ndims, gs, of, sz


def manifest_from_record(rec: Mapping[str, Any], key_id: str) -> Manifest:
    """A decoded ``manifest`` record, checked against its key (the content address).

    Raises:
        CodecError: columns that do not agree, boxes outside their tensors, or an id that is not
            the content's (a record that is not what its key says).
    """
    what = f"manifest {key_id}"
    if rec["manifest_id"] != key_id or manifest_id_of(rec) != key_id:
        raise CodecError(f"{what}: content does not match its id")
    dtypes, ndims, gs, of, sz = _table(rec, what)
    try:
        names = tuple(rec["names"])
        if any("\0" in n for n in names):  # the content address joins names with NUL
            raise CodecError(f"{what}: a tensor name holds a NUL character")
    except TypeError as exc:
        raise CodecError(f"{what}: bad names ({exc})") from None
    return Manifest(key_id, names, dtypes, ndims, gs, of, sz)


def layout_record(
    epoch: int,
    rank: int,
    manifest: Manifest | Mapping[str, Any],
    shards: Sequence[ShardRecord],
    transport: bytes,
    packed: Sequence[ShardRecord] = (),
) -> dict[str, Any]:
    """The ``layout`` record (addresses of the manifest's shards, in order, and packed copies)."""
    mid = manifest.manifest_id if isinstance(manifest, Manifest) else manifest["manifest_id"]
    nd = sum(len(s.strides) for s in shards)
    rec: dict[str, Any] = {
        "epoch": epoch,
        "rank": rank,
        "manifest_id": mid,
        "transport": transport,
        "strides": np.fromiter((v for s in shards for v in s.strides), _I64, nd).tobytes(),
        "regions": np.fromiter((s.region for s in shards), _I64, len(shards)).tobytes(),
        "byte_offsets": np.fromiter((s.byte_offset for s in shards), _I64, len(shards)).tobytes(),
    }
    if packed:
        cols = _columns(packed)
        cols["regions"] = np.fromiter((s.region for s in packed), _I64, len(packed)).tobytes()
        cols["byte_offsets"] = np.fromiter((s.byte_offset for s in packed), _I64, len(packed)).tobytes()
        rec["packed"] = cols
    rec["layout_id"] = layout_id_of(rec)
    return rec


def layout_id_of(rec: Mapping[str, Any]) -> str:
    """The content-addressed id of a layout record (its manifest, addresses and pre-packed copies)."""
    packed = rec.get("packed")
    extra = (manifest_id_of(packed).encode(), packed["regions"], packed["byte_offsets"]) if packed else ()
    return _digest(
        b"%d/%d" % (rec["epoch"], rec["rank"]),
        rec["manifest_id"].encode(),
        rec["transport"],
        rec["strides"],
        rec["regions"],
        rec["byte_offsets"],
        *extra,
    )


def layout_from_record(
    rec: Mapping[str, Any],
    manifest: Manifest,
    *,
    key_id: str,
    epoch: int | None = None,
    rank: int | None = None,
) -> Layout:
    """A decoded ``layout`` record with its manifest, checked against its key: the id is the
    content's, epoch and rank are the key's, and the columns fit the manifest.

    Raises:
        CodecError: the record is not what its key says, or its columns do not fit.
    """
    what = f"layout {key_id}"
    if rec["layout_id"] != key_id or layout_id_of(rec) != key_id:
        raise CodecError(f"{what}: content does not match its id")
    if (epoch is not None and rec["epoch"] != epoch) or (rank is not None and rec["rank"] != rank):
        raise CodecError(
            f"{what}: epoch/rank {rec['epoch']}/{rec['rank']} differ from its key {epoch}/{rank}"
        )
    if rec["manifest_id"] != manifest.manifest_id:
        raise CodecError(f"{what}: refers to manifest {rec['manifest_id']}, given {manifest.manifest_id}")
    n = len(manifest.names)
    strides = _i64(rec["strides"], f"{what} strides", int(manifest.ndims.sum(dtype=np.int64)))
    regions = _i64(rec["regions"], f"{what} regions", n)
    boffs = _i64(rec["byte_offsets"], f"{what} byte_offsets", n)
    if (strides < 0).any() or (regions < 0).any() or (boffs < 0).any():
        raise CodecError(f"{what}: negative strides, regions or byte offsets")
    try:
        rank_ = rec["rank"]
        shards = LazyRecords(n, lambda: manifest.records(rank_, strides, regions, boffs))
        columns = ShardColumns(
            manifest.names,
            manifest.dtypes,
            manifest.ndims,
            manifest.global_shapes,
            manifest.offsets,
            manifest.sizes,
            strides,
            regions,
            boffs,
        )
        packed: tuple[ShardRecord, ...] = ()
        if "packed" in rec:
            p = rec["packed"]
            dtypes, ndims, gs, of, sz = _table(p, f"{what} packed")
            m = len(p["names"])
            pregions = _i64(p["regions"], f"{what} packed regions", m)
            pboffs = _i64(p["byte_offsets"], f"{what} packed byte_offsets", m)
            if (pregions < 0).any() or (pboffs < 0).any():
                raise CodecError(f"{what}: negative packed regions or byte offsets")
            copies = Manifest("", tuple(p["names"]), dtypes, ndims, gs, of, sz)
            packed = copies.records(rec["rank"], None, pregions, pboffs)
    except (LayoutError, TypeError, OverflowError) as exc:  # shards the layout module refuses
        raise CodecError(f"{what}: bad shards ({exc})") from None
    return Layout(
        key_id, rec["epoch"], rec["rank"], shards, rec["transport"], packed, manifest.manifest_id, columns
    )

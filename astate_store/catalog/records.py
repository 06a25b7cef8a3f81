"""What the catalog's etcd records mean in Python: the frozen record types, the wire form of a
shard, content-addressed layout ids, the 20-digit key numbers, and decoding records read back.

Pure functions and data only: no etcd access here, so every role decodes a record the same way.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from astate_store.model import codec
from astate_store.errors import CatalogCorrupted, CodecError, LayoutError, VersionNotFound
from astate_store.model.layout import (
    DTYPES,
    Box,
    GCPaused,
    ShardColumns,
    ShardRecord,
    _frozen,
    contiguous_strides,
)

__all__ = ["Session", "Layout", "Piece", "Replica", "Version", "CheckpointEntry", "Manifest", "DTYPE_TABLE",
           "manifest_record", "manifest_from_record", "layout_record", "layout_from_record", "pad20",
           "parse_pad20", "is_record_id", "Skips", "SkipFn", "counter_value", "version_from_kvs"]

log = logging.getLogger("astate_store.catalog")


def pad20(v: int) -> str:
    """A step or epoch as it appears in keys and counters: 20 digits, so lexical order is numeric."""
    return "%020d" % v


_PAD20 = re.compile(r"[0-9]{20}")
_RECORD_ID = re.compile(r"[0-9a-f]{24}")


def parse_pad20(segment: str) -> int | None:
    """The number of a 20-digit key segment (a step, epoch, rank or round), or None when the
    segment is anything else (``int()`` alone would take ``" 7"``, ``"+7"`` or ``"1_0"``)."""
    return int(segment) if _PAD20.fullmatch(segment) else None


def is_record_id(v: object) -> bool:
    """Whether ``v`` has the form of a content-addressed manifest or layout id (24 hex digits)."""
    return isinstance(v, str) and _RECORD_ID.fullmatch(v) is not None


# (key, why, mod revision or None): how decoders report a record they skipped.
SkipFn = Callable[[str, str, "int | None"], None]


def numbered_records(kvs: Iterable[tuple[bytes, Any]], pre: str, kind: str, skips: "Skips", what: str
                     ) -> Iterator[tuple[str, int, dict[str, Any], int]]:
    """(key, number, record, mod revision) of each record under ``pre`` whose key ends in a 20-digit number and
    whose value decodes as ``kind``; the others are skipped (counted, logged once). Callers still
    check the record's own fields against the number."""
    for value, meta in kvs:
        key = meta.key.decode("utf-8", "replace")
        n = parse_pad20(key[len(pre):])
        if n is None:
            skips(key, f"not a {what} key (it ends in a 20-digit number)", meta.mod_revision)
            continue
        try:
            rec = codec.decode(kind, value)
        except CodecError as exc:
            skips(key, str(exc), meta.mod_revision)
            continue
        yield key, n, rec, meta.mod_revision


class Skips:
    """The bad records one catalog role skipped: every skip is counted; each (key, revision) is
    logged once, and at most ``_BURST`` lines per ``_WINDOW`` seconds (the rest are summed up in
    the next line), so a hostile or broken record — or a flood of them — does not flood the log."""

    _REMEMBER = 4096  # (key, revision) pairs remembered for logging once; older ones are forgotten
    _WINDOW, _BURST = 60.0, 10

    def __init__(self, namespace: str, what: str):
        self.namespace, self.what = namespace, what  # what: the records, as in "skipping <what> record"
        self.count = 0
        self._logged: OrderedDict[tuple[str, int | None], None] = OrderedDict()
        self._lock = threading.Lock()
        self._window_start, self._lines, self._unlogged = -1e9, 0, 0

    def __call__(self, key: str, why: str, revision: int | None = None) -> None:
        with self._lock:
            self.count += 1
            first = (key, revision) not in self._logged
            if first:
                self._logged[(key, revision)] = None
                while len(self._logged) > self._REMEMBER:
                    self._logged.popitem(last=False)
                now = time.monotonic()
                if now - self._window_start >= self._WINDOW:
                    self._window_start, self._lines = now, 0
                first = self._lines < self._BURST
                self._lines += first
                unlogged, self._unlogged = (self._unlogged, 0) if first else (0, self._unlogged + 1)
        if first:
            more = f" ({unlogged} more bad records not logged)" if unlogged else ""
            log.warning("namespace %s: skipping %s record %s: %s%s", self.namespace, self.what, key, why, more)


def counter_value(key: str, raw: bytes | None) -> int | None:
    """A counter record (``latest``, ``epoch``) read from ``key``.

    Raises:
        CatalogCorrupted: the value is not a counter (counters are authority records: nothing is
            decided on a guess).
    """
    try:
        return codec.decode_counter(raw)
    except CodecError as exc:
        raise CatalogCorrupted(f"the counter {key} is corrupted: {exc}", key=key) from None


@dataclass(frozen=True)
class Session:
    """A publisher group's membership: all ranks of one session share ``epoch``."""

    epoch: int
    session_id: str
    rank: int
    world_size: int
    lease_id: int


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
    cannot fail): a first pull planned from the columns (``plan.columns``) never needs them, and
    10^4 records cost ~0.1 s. Equal to (and hashes as) the tuple of its records; pickles as it."""

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


@dataclass(frozen=True)
class Piece:
    step: int
    epoch: int
    rank: int
    world_size: int
    layout_id: str
    base_offset: int
    manifest_id: str = ""
    slot_bases: tuple[int, ...] = ()  # every slot of the rank's staging pool (a prefault hint)


@dataclass(frozen=True)
class Replica:
    """A consumer re-serving a version from its buffers (P2P fan-out)."""

    step: int
    group: str
    member: str
    layout_id: str
    manifest_id: str = ""


@dataclass(frozen=True)
class Version:
    """A committed version as one consumer read it: commit, pieces, replicas, and (when asked)
    the layouts that are still alive (``missing``: publisher ranks whose layout lease is gone)."""

    step: int
    epoch: int
    world_size: int
    pieces: Mapping[int, Piece]
    replicas: Mapping[str, Replica] = field(default_factory=dict)
    layouts: Mapping[int, Layout] = field(default_factory=dict)
    replica_layouts: Mapping[str, Layout] = field(default_factory=dict)
    missing: frozenset[int] = frozenset()

    @property
    def layout_key(self) -> tuple[object, ...]:
        """Identifies the source layout: unchanged key means the cached plan still holds."""
        return (tuple(self.pieces[r].layout_id for r in sorted(self.pieces)),
                tuple((m, self.replicas[m].group, self.replicas[m].layout_id) for m in sorted(self.replica_layouts)))


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    uri: str
    world_size: int
    bytes: int
    written_at: float


# ---- column-wise shard tables (manifests and layouts) --------------------------------------

DTYPE_TABLE: tuple[str, ...] = tuple(DTYPES)  # wire code -> dtype name (the order of layout.DTYPES)
_DTYPE_CODE = {n: i for i, n in enumerate(DTYPE_TABLE)}
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
    """What one rank holds, column-wise: shard i is ``names[i]`` of dtype ``DTYPE_TABLE[dtypes[i]]``
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

    def records(self, rank: int, strides: np.ndarray | None = None, regions: np.ndarray | None = None,
                byte_offsets: np.ndarray | None = None) -> tuple[ShardRecord, ...]:
        """The shards as records of ``rank`` (addresses from a layout, else contiguous at 0)."""
        st = self.starts.tolist()
        gs, of, sz = self.global_shapes.tolist(), self.offsets.tolist(), self.sizes.tolist()
        strs = strides.tolist() if strides is not None else None
        regs = regions.tolist() if regions is not None else [0] * len(self.names)
        boffs = byte_offsets.tolist() if byte_offsets is not None else [0] * len(self.names)
        dts = [DTYPE_TABLE[c] for c in self.dtypes.tolist()]
        out = []
        # Checked columns (``_table``): the records are built without the dataclasses' __init__
        # (10^4 shards: 0.4 s of a consumer's first step went here), the GC paused meanwhile.
        with GCPaused():
            for i, name in enumerate(self.names):
                a, b = st[i], st[i + 1]
                sizes = tuple(sz[a:b])
                rec_strides = tuple(strs[a:b]) if strs is not None else contiguous_strides(sizes)
                box = _frozen(Box, {"offsets": tuple(of[a:b]), "sizes": sizes})
                out.append(_frozen(ShardRecord, {"name": name, "dtype": dts[i], "global_shape": tuple(gs[a:b]),
                                                 "box": box, "strides": rec_strides, "rank": rank,
                                                 "region": regs[i], "byte_offset": boffs[i]}))
        return tuple(out)


def _columns(shards: Sequence[ShardRecord]) -> dict[str, Any]:
    """The manifest columns of ``shards`` (names, dtypes, ndims, global shapes, offsets, sizes)."""
    nd = [len(s.global_shape) for s in shards]
    flat = lambda get: np.fromiter((v for s in shards for v in get(s)), _I64, sum(nd)).tobytes()  # noqa: E731
    return {"names": [s.name for s in shards],
            "dtypes": bytes(_DTYPE_CODE[s.dtype] for s in shards),
            "ndims": bytes(nd),
            "global_shapes": flat(lambda s: s.global_shape),
            "offsets": flat(lambda s: s.box.offsets),
            "sizes": flat(lambda s: s.box.sizes)}


def _columns_id(cols: Mapping[str, Any]) -> str:
    return _digest("\0".join(cols["names"]).encode(), cols["dtypes"], cols["ndims"], cols["global_shapes"],
                   cols["offsets"], cols["sizes"])


def manifest_record(shards: Sequence[ShardRecord]) -> dict[str, Any]:
    """The ``manifest`` record of a rank's shards (boxes only; addresses live in the layout)."""
    cols = _columns(shards)
    return {"manifest_id": _columns_id(cols), **cols}


def _table(rec: Mapping[str, Any], what: str) -> tuple[np.ndarray, ...]:
    """Checked columns of a manifest-like record: (dtypes, ndims, global_shapes, offsets, sizes)."""
    n = len(rec["names"])
    dtypes = np.frombuffer(rec["dtypes"], np.uint8)
    ndims = np.frombuffer(rec["ndims"], np.uint8)
    if len(dtypes) != n or len(ndims) != n:
        raise CodecError(f"{what}: {n} names but {len(dtypes)} dtypes and {len(ndims)} ndims")
    if n and int(dtypes.max()) >= len(DTYPE_TABLE):
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
    if rec["manifest_id"] != key_id or _columns_id(rec) != key_id:
        raise CodecError(f"{what}: content does not match its id")
    dtypes, ndims, gs, of, sz = _table(rec, what)
    try:
        names = tuple(rec["names"])
        if any("\0" in n for n in names):  # the content address joins names with NUL
            raise CodecError(f"{what}: a tensor name holds a NUL character")
    except TypeError as exc:
        raise CodecError(f"{what}: bad names ({exc})") from None
    return Manifest(key_id, names, dtypes, ndims, gs, of, sz)


def layout_record(epoch: int, rank: int, manifest: Manifest | Mapping[str, Any], shards: Sequence[ShardRecord],
                  transport: bytes, packed: Sequence[ShardRecord] = ()) -> dict[str, Any]:
    """The ``layout`` record (addresses of the manifest's shards, in order, and packed copies)."""
    mid = manifest.manifest_id if isinstance(manifest, Manifest) else manifest["manifest_id"]
    nd = sum(len(s.strides) for s in shards)
    rec: dict[str, Any] = {
        "epoch": epoch, "rank": rank, "manifest_id": mid, "transport": transport,
        "strides": np.fromiter((v for s in shards for v in s.strides), _I64, nd).tobytes(),
        "regions": np.fromiter((s.region for s in shards), _I64, len(shards)).tobytes(),
        "byte_offsets": np.fromiter((s.byte_offset for s in shards), _I64, len(shards)).tobytes()}
    if packed:
        cols = _columns(packed)
        cols["regions"] = np.fromiter((s.region for s in packed), _I64, len(packed)).tobytes()
        cols["byte_offsets"] = np.fromiter((s.byte_offset for s in packed), _I64, len(packed)).tobytes()
        rec["packed"] = cols
    rec["layout_id"] = _layout_id(rec)
    return rec


def _layout_id(rec: Mapping[str, Any]) -> str:
    packed = rec.get("packed")
    extra = (_columns_id(packed).encode(), packed["regions"], packed["byte_offsets"]) if packed else ()
    return _digest(b"%d/%d" % (rec["epoch"], rec["rank"]), rec["manifest_id"].encode(), rec["transport"],
                   rec["strides"], rec["regions"], rec["byte_offsets"], *extra)


def layout_from_record(rec: Mapping[str, Any], manifest: Manifest, *, key_id: str, epoch: int | None = None,
                       rank: int | None = None) -> Layout:
    """A decoded ``layout`` record with its manifest, checked against its key: the id is the
    content's, epoch and rank are the key's, and the columns fit the manifest.

    Raises:
        CodecError: the record is not what its key says, or its columns do not fit.
    """
    what = f"layout {key_id}"
    if rec["layout_id"] != key_id or _layout_id(rec) != key_id:
        raise CodecError(f"{what}: content does not match its id")
    if (epoch is not None and rec["epoch"] != epoch) or (rank is not None and rec["rank"] != rank):
        raise CodecError(f"{what}: epoch/rank {rec['epoch']}/{rec['rank']} differ from its key {epoch}/{rank}")
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
        columns = ShardColumns(manifest.names, manifest.dtypes, manifest.ndims, manifest.global_shapes,
                               manifest.offsets, manifest.sizes, strides, regions, boffs)
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
    return Layout(key_id, rec["epoch"], rec["rank"], shards, rec["transport"], packed, manifest.manifest_id, columns)



def version_from_kvs(namespace: str, step: int, kvs: Iterable[tuple[bytes, Any]],
                     skip: SkipFn | None = None) -> Version:
    """The :class:`Version` of ``step`` from the (value, meta) pairs under ``versions/<step>/``.

    Every record is checked against its schema and its key. Only pieces of the committing epoch
    and ranks count: a fenced session may have left pieces of the same step behind. A record
    that is not needed to trust the version (a replica, a piece of another epoch or of a rank
    outside the world, a key that is none of these) and is bad is skipped and reported to
    ``skip`` (key, why, mod revision); its source then simply is not there.

    Raises:
        VersionNotFound: no commit record among ``kvs``.
        CatalogCorrupted: the commit record is bad or not this step's, or a piece of the
            committing session is missing or bad (the version cannot be trusted as a whole).
    """
    prefix = f"/astate/{namespace}/versions/{pad20(step)}/"
    report: SkipFn = skip if skip is not None else (lambda _k, _w, _r: None)
    commit: dict[str, Any] | None = None
    commit_key = prefix + "commit"
    pieces_raw: dict[tuple[int, int], tuple[str, bytes, int | None]] = {}
    replicas: dict[str, Replica] = {}
    for value, meta in kvs:
        raw_key = meta.key
        k = raw_key.decode("utf-8", "replace") if isinstance(raw_key, (bytes, bytearray)) else str(raw_key)
        rev = getattr(meta, "mod_revision", None)
        if not k.startswith(prefix):
            report(k, "not a key of this version", rev)
            continue
        tail = k[len(prefix):].split("/")
        if tail == ["commit"]:
            try:
                commit = codec.decode("commit", value)
            except CodecError as exc:
                raise CatalogCorrupted(f"namespace {namespace!r}: the commit record {k} is corrupted: {exc}",
                                       key=k) from None
            if commit["step"] != step:
                raise CatalogCorrupted(f"namespace {namespace!r}: the commit record {k} is of step {commit['step']}",
                                       key=k)
        elif len(tail) == 3 and tail[0] == "pieces":
            e, r = parse_pad20(tail[1]), parse_pad20(tail[2])
            if e is None or r is None:
                report(k, "not a piece key (epoch and rank are 20 digits)", rev)
            else:
                pieces_raw[(e, r)] = (k, value, rev)
        elif len(tail) == 3 and tail[0] == "replicas" and tail[1] and tail[2]:
            try:
                rp = codec.decode("replica", value)
            except CodecError as exc:
                report(k, str(exc), rev)
                continue
            why = ("record of another step, group or member" if (rp["step"], rp["group"], rp["member"]) !=
                   (step, tail[1], tail[2]) else
                   "its layout id is not a content address" if not is_record_id(rp["layout_id"]) else None)
            if why is not None:
                report(k, why, rev)
                continue
            replicas[rp["member"]] = Replica(step, rp["group"], rp["member"], rp["layout_id"], rp["manifest_id"])
        else:
            report(k, "not a key of a version (commit, pieces/<epoch>/<rank>, replicas/<group>/<member>)", rev)
    if commit is None:
        raise VersionNotFound(f"namespace {namespace!r}: step {step} is not committed")
    epoch, world = commit["epoch"], commit["world_size"]
    pieces: dict[int, Piece] = {}
    bad: list[str] = []
    for (e, r), (k, value, rev) in sorted(pieces_raw.items()):
        if e != epoch:
            continue  # a fenced session's leftover: not read
        if r >= world:
            report(k, f"a piece of rank {r}, outside the committed world size {world}", rev)
            continue
        try:
            p = codec.decode("piece", value)
        except CodecError as exc:
            report(k, str(exc), rev)
            bad.append(k)
            continue
        if (p["step"], p["epoch"], p["rank"]) != (step, epoch, r):
            report(k, f"piece of step {p['step']} epoch {p['epoch']} rank {p['rank']} under this key", rev)
            bad.append(k)
        elif p["world_size"] != world:  # the piece or the commit is wrong: the commit is named
            report(k, f"piece of a world of {p['world_size']}, the commit says {world}", rev)
        elif not is_record_id(p["layout_id"]):
            report(k, "its layout id is not a content address", rev)
            bad.append(k)
        else:
            pieces[r] = Piece(step, epoch, r, world, p["layout_id"], p["base_offset"], p["manifest_id"],
                              tuple(p.get("slot_bases", ())))
    if len(pieces) != world:
        # world can be anything a record says: never materialize range(world).
        missing = [r for r in range(min(world, len(pieces) + 8)) if r not in pieces][:8]
        raise CatalogCorrupted(
            f"namespace {namespace!r}: step {step} is committed (epoch {epoch}, world size {world}) but pieces "
            f"of ranks {missing}{' ...' if world - len(pieces) > len(missing) else ''} are missing or bad"
            + (f" ({', '.join(bad[:4])})" if bad else ""), key=bad[0] if bad else commit_key)
    return Version(step, epoch, world, pieces, replicas)

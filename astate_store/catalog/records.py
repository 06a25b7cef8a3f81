"""What the catalog's etcd records mean in Python: the frozen record types, the 20-digit key
numbers, skipped-record reporting, and decoding a version from its records read back.

The column-wise wire form of shards (manifests, layouts, content-addressed ids) lives in
:mod:`astate_store.catalog.shard_tables`.

Pure functions and data only: no etcd access here, so every role decodes a record the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from astate_store.catalog.deltas import Delta, delta_from_record
from astate_store.catalog.shard_tables import Layout
from astate_store.errors import CatalogCorrupted, CodecError, VersionNotFound
from astate_store.model import codec

__all__ = [
    "Session",
    "Piece",
    "Replica",
    "Version",
    "CheckpointEntry",
    "pad20",
    "parse_pad20",
    "is_record_id",
    "Skips",
    "SkipFn",
    "counter_value",
    "version_from_kvs",
]

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


def numbered_records(
    kvs: Iterable[tuple[bytes, Any]], pre: str, kind: str, skips: Skips, what: str
) -> Iterator[tuple[str, int, dict[str, Any], int]]:
    """(key, number, record, mod revision) of each record under ``pre`` whose key ends in a
    20-digit number and whose value decodes as ``kind``; the others are skipped (counted, logged
    once). Callers still check the record's own fields against the number."""
    for value, meta in kvs:
        key = meta.key.decode("utf-8", "replace")
        n = parse_pad20(key[len(pre) :])
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
            log.warning(
                "namespace %s: skipping %s record %s: %s%s", self.namespace, self.what, key, why, more
            )


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
class Piece:
    step: int
    epoch: int
    rank: int
    world_size: int
    layout_id: str
    base_offset: int
    manifest_id: str = ""
    slot_bases: tuple[int, ...] = ()  # every slot of the rank's staging pool (a prefault hint)
    # the slot's step word: (region, offset, token); None: none (in place, a device pool, older writer)
    step_word: tuple[int, int, int] | None = None
    # the rank's change map of this version (catalog/deltas.py); None: none, or a bad record skipped
    delta: Delta | None = None


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
        return (
            tuple(self.pieces[r].layout_id for r in sorted(self.pieces)),
            tuple(
                (m, self.replicas[m].group, self.replicas[m].layout_id) for m in sorted(self.replica_layouts)
            ),
        )


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    uri: str
    world_size: int
    bytes: int
    written_at: float


def version_from_kvs(
    namespace: str, step: int, kvs: Iterable[tuple[bytes, Any]], skip: SkipFn | None = None
) -> Version:
    """The :class:`Version` of ``step`` from the (value, meta) pairs under ``versions/<step>/``.

    Every record is checked against its schema and its key. Only pieces of the committing epoch
    and ranks count: a fenced session may have left pieces of the same step behind. A record
    that is not needed to trust the version (a replica, a piece of another epoch or of a rank
    outside the world, a key that is none of these) and is bad is skipped and reported to
    ``skip`` (key, why, mod revision); its source then simply is not there.

    Call sequence:

    1. :func:`_sort_kv` files each pair by its key's kind: the commit (:func:`_commit_record`,
       raises when bad), a piece (kept undecoded: which pieces count depends on the commit,
       :func:`_piece_key`), a replica (:func:`_replica_record`), or a skipped key;
    2. no commit among them: :class:`VersionNotFound`;
    3. :func:`_piece_record` decodes and checks each piece of the committing epoch;
    4. :func:`_require_every_rank`: a rank without a good piece makes the version untrusted.

    Raises:
        VersionNotFound: no commit record among ``kvs``.
        CatalogCorrupted: the commit record is bad or not this step's, or a piece of the
            committing session is missing or bad (the version cannot be trusted as a whole).
    """
    found = _VersionKvs(
        namespace,
        step,
        f"/astate/{namespace}/versions/{pad20(step)}/",
        skip if skip is not None else (lambda _k, _w, _r: None),
    )
    for value, meta in kvs:
        _sort_kv(found, value, meta)
    if found.commit is None:
        raise VersionNotFound(f"namespace {namespace!r}: step {step} is not committed")
    epoch, world = found.commit["epoch"], found.commit["world_size"]
    pieces: dict[int, Piece] = {}
    bad: list[str] = []
    for (e, r), (k, value, rev) in sorted(found.pieces_raw.items()):
        if e != epoch:
            continue  # a fenced session's leftover: not read
        piece, is_bad = _piece_record(found, epoch, world, r, k, value, rev)
        if piece is not None:
            pieces[r] = _with_delta(found, piece)
        elif is_bad:
            bad.append(k)
    _require_every_rank(found, epoch, world, pieces, bad)
    return Version(step, epoch, world, pieces, found.replicas)


@dataclass
class _VersionKvs:
    """What :func:`version_from_kvs` gathered from one version's keys, before the commit is known."""

    namespace: str
    step: int
    prefix: str  # /astate/<namespace>/versions/<step>/
    report: SkipFn
    commit: dict[str, Any] | None = None
    # (epoch, rank) -> (key, undecoded value, mod revision)
    pieces_raw: dict[tuple[int, int], tuple[str, bytes, int | None]] = field(default_factory=dict)
    deltas_raw: dict[tuple[int, int], tuple[str, bytes, int | None]] = field(default_factory=dict)  # likewise
    replicas: dict[str, Replica] = field(default_factory=dict)  # member -> replica


def _sort_kv(found: _VersionKvs, value: bytes, meta: Any) -> None:
    """File one (value, meta) pair by its key's kind: commit, piece, replica, or skipped."""
    raw_key = meta.key
    k = raw_key.decode("utf-8", "replace") if isinstance(raw_key, (bytes, bytearray)) else str(raw_key)
    rev = getattr(meta, "mod_revision", None)
    if not k.startswith(found.prefix):
        found.report(k, "not a key of this version", rev)
        return
    tail = k[len(found.prefix) :].split("/")
    if tail == ["commit"]:
        found.commit = _commit_record(found, k, value)
    elif len(tail) == 3 and tail[0] == "pieces":
        er = _piece_key(tail)
        if er is None:
            found.report(k, "not a piece key (epoch and rank are 20 digits)", rev)
        else:
            found.pieces_raw[er] = (k, value, rev)
    elif len(tail) == 3 and tail[0] == "deltas":
        er = _piece_key(tail)
        if er is None:
            found.report(k, "not a delta key (epoch and rank are 20 digits)", rev)
        else:
            found.deltas_raw[er] = (k, value, rev)
    elif len(tail) == 3 and tail[0] == "replicas" and tail[1] and tail[2]:
        replica = _replica_record(found, tail[1], tail[2], k, value, rev)
        if replica is not None:
            found.replicas[replica.member] = replica
    else:
        why = (
            "not a key of a version (commit, pieces/<epoch>/<rank>, deltas/<epoch>/<rank>, "
            "replicas/<group>/<member>)"
        )
        found.report(k, why, rev)


def _commit_record(found: _VersionKvs, k: str, value: bytes) -> dict[str, Any]:
    """The decoded commit record at ``k``; a bad one, or one of another step, raises (it is the authority)."""
    try:
        commit = codec.decode("commit", value)
    except CodecError as exc:
        raise CatalogCorrupted(
            f"namespace {found.namespace!r}: the commit record {k} is corrupted: {exc}", key=k
        ) from None
    if commit["step"] != found.step:
        raise CatalogCorrupted(
            f"namespace {found.namespace!r}: the commit record {k} is of step {commit['step']}", key=k
        )
    return commit


def _piece_key(tail: list[str]) -> tuple[int, int] | None:
    """(epoch, rank) of a ``pieces/<epoch>/<rank>`` key tail; None unless both are 20 digits."""
    e, r = parse_pad20(tail[1]), parse_pad20(tail[2])
    return None if e is None or r is None else (e, r)


def _replica_record(
    found: _VersionKvs, group: str, member: str, k: str, value: bytes, rev: int | None
) -> Replica | None:
    """The replica at ``replicas/<group>/<member>``, or None (reported) when bad or not this key's."""
    try:
        rp = codec.decode("replica", value)
    except CodecError as exc:
        found.report(k, str(exc), rev)
        return None
    if (rp["step"], rp["group"], rp["member"]) != (found.step, group, member):
        found.report(k, "record of another step, group or member", rev)
        return None
    if not is_record_id(rp["layout_id"]):
        found.report(k, "its layout id is not a content address", rev)
        return None
    return Replica(found.step, rp["group"], rp["member"], rp["layout_id"], rp["manifest_id"])


def _piece_record(
    found: _VersionKvs, epoch: int, world: int, r: int, k: str, value: bytes, rev: int | None
) -> tuple[Piece | None, bool]:
    """(the piece of rank ``r`` of the committing epoch, None) or (None, whether it counts as bad).

    Bad pieces are named in the error when ranks are missing. A rank outside the world and a
    piece whose world size disagrees with the commit are reported but not named bad.
    """
    if r >= world:
        found.report(k, f"a piece of rank {r}, outside the committed world size {world}", rev)
        return None, False
    try:
        p = codec.decode("piece", value)
    except CodecError as exc:
        found.report(k, str(exc), rev)
        return None, True
    if (p["step"], p["epoch"], p["rank"]) != (found.step, epoch, r):
        found.report(k, f"piece of step {p['step']} epoch {p['epoch']} rank {p['rank']} under this key", rev)
        return None, True
    if p["world_size"] != world:  # the piece or the commit is wrong: the commit is named
        found.report(k, f"piece of a world of {p['world_size']}, the commit says {world}", rev)
        return None, False
    if not is_record_id(p["layout_id"]):
        found.report(k, "its layout id is not a content address", rev)
        return None, True
    return Piece(
        found.step,
        epoch,
        r,
        world,
        p["layout_id"],
        p["base_offset"],
        p["manifest_id"],
        tuple(p.get("slot_bases", ())),
        _step_word(found, k, p.get("step_word"), rev),
    ), False


def _with_delta(found: _VersionKvs, piece: Piece) -> Piece:
    """The piece with its delta record, when it has a good one (a bad one is reported: the piece
    stays good, and its readers pull it whole)."""
    raw = found.deltas_raw.get((piece.epoch, piece.rank))
    if raw is None:
        return piece
    k, value, rev = raw
    try:
        d = delta_from_record(value, piece.step, piece.epoch, piece.rank, piece.layout_id)
    except CodecError as exc:
        found.report(k, str(exc), rev)
        return piece
    return dataclasses.replace(piece, delta=d)


def _step_word(
    found: _VersionKvs, k: str, w: Mapping[str, int] | None, rev: int | None
) -> tuple[int, int, int] | None:
    """A piece's step word as (region, offset, token); None when absent, or when its token is out
    of range (reported; the piece stays good, and its reader asks etcd as for a piece without one)."""
    if w is None:
        return None
    if w["token"] >= 1 << 53:
        found.report(k, f"step word token {w['token']} is not below 2^53: ignored", rev)
        return None
    return w["region"], w["offset"], w["token"]


def _require_every_rank(
    found: _VersionKvs, epoch: int, world: int, pieces: Mapping[int, Piece], bad: list[str]
) -> None:
    """Raise :class:`CatalogCorrupted` unless every rank of the committed world has a good piece."""
    if len(pieces) == world:
        return
    # world can be anything a record says: never materialize range(world).
    missing = [r for r in range(min(world, len(pieces) + 8)) if r not in pieces][:8]
    more = " ..." if world - len(pieces) > len(missing) else ""
    named = f" ({', '.join(bad[:4])})" if bad else ""
    raise CatalogCorrupted(
        f"namespace {found.namespace!r}: step {found.step} is committed (epoch {epoch}, world size {world}) "
        f"but pieces of ranks {missing}{more} are missing or bad{named}",
        key=bad[0] if bad else found.prefix + "commit",
    )

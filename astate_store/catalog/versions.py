"""Versions: publishing manifests, layouts and pieces, committing a step, retention, and reading
committed versions.

A committed version is self-describing and immutable until retention drops it: its pieces
(``versions/<step>/pieces/<epoch>/<rank>``, no lease) name each rank's *manifest* — what the rank
holds, boxes only, under ``manifests/<id>`` without a lease — and its *layout* — how to reach
it now, under ``layouts/<epoch>/<rank>/<id>`` on the rank's lease (liveness). Both are
content-addressed blobs of any size (``blobs``), written once and referenced from then on.

Metadata per step is O(1) round trips whatever the number of tensors and consumers: one
transaction writes a rank's piece and commits the step when that piece completes it;
retention runs on a background thread; consumers learn of commits from a watch on ``latest``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Mapping, Sequence

from pyetcd import transactions as tx

from .. import codec
from ..errors import CatalogCorrupted, CatalogError, CodecError, StaleStepError, VersionNotFound, WaitTimeout
from ..layout import ShardRecord, check_step
from .background import own_job
from .blobs import CHUNK_BYTES, blob_from_kvs, blob_requests
from .client import EtcdClient, range_end
from .records import (
    Layout,
    Manifest,
    Skips,
    Version,
    counter_value,
    layout_from_record,
    layout_record,
    manifest_from_record,
    manifest_record,
    pad20,
    parse_pad20,
    version_from_kvs,
)
from .sessions import Sessions, read_counter

__all__ = ["Versions"]

log = logging.getLogger("astate_store.catalog")

# Blob range reads per transaction: a response stays well inside the client's receive limit.
_BLOBS_PER_TXN = 16
# Per-step key families that retention drops together with the version itself.
_PER_STEP = ("versions", "readers", "retired", "torn", "delivered", "meta")
# Manifests change only when a rank's shapes change: collecting them every few dropped steps is plenty.
_GC_EVERY = 16
# Up to this many other ranks the commit compares each piece key (one round trip); past it
# (etcd allows 128 operations per transaction) the piece transaction counts the pieces and the
# rank that completes the set commits in a second transaction.
_MAX_PIECE_COMPARES = 96


class Versions:
    """Publishing and reading committed versions; keeps the newest ``retention`` of them."""

    def __init__(self, client: EtcdClient, sessions: Sessions, retention: int,
                 runner: "Callable[[str, Callable[[], None]], Any] | None" = None):
        self.client, self.sessions, self.retention = client, sessions, retention
        # Layouts by the key they were read and verified at (layouts/<epoch>/<rank>/<id>, or
        # layouts/replicas/<member>/<id>): the id is the content's, epoch and rank (or the
        # member) are the key's, so a record naming a layout can only get the one at its own key.
        self._layouts: dict[str, Layout] = {}
        self._manifests: dict[str, Manifest] = {}  # by manifest id (verified: the id is the content's)
        self._written: dict[str, str] = {}  # layout id -> manifest id, of layouts this process wrote
        self._written_manifests: set[str] = set()
        # (replica manifest id, publisher manifest ids) -> why the replica does not fit the version, or ""
        self._fits: dict[tuple[str, tuple[str, ...]], str] = {}
        self.skips = Skips(client.namespace, "bad")  # records that failed their schema or key checks
        self._latest = _LatestWatch(client, self.skips)
        # ``runner`` (name, fn) -> an object with poke / wait_idle / close: a thread shared by many
        # namespaces (sessions_hub.py); by default this namespace's own lazily started thread.
        self._retention = (runner or own_job)(f"astate-retention-{client.namespace}", self._apply_retention)
        self._drops = 0
        # Steps in the commits/ index as of the last listing (epoch, count), and commits made here
        # since: a single-rank session makes every commit of its epoch itself, so retention lists
        # the index again only once it may hold more than ``retention`` steps (not per commit).
        self._listed: tuple[int, int] | None = None
        self._unlisted = 0
        self._count_lock = threading.Lock()

    @property
    def skipped_records(self) -> int:
        return self.skips.count

    # ---- publishing -----------------------------------------------------------------------

    def _write_blob(self, what: str, key: str, data: bytes, lease: int | None) -> None:
        """Chunks first, then the head in a fenced transaction: readers see all or nothing."""
        chunks, head = blob_requests(key, data, lease)
        for ops in chunks:
            self.client.txn(f"{what} chunk", [], ops)
        ok, _ = self.client.txn(what, self.sessions.fence(), [head])
        if not ok:
            raise self.sessions.fenced_error(what)

    def write_layout(self, shards: Sequence[ShardRecord], transport: bytes, packed: Sequence[ShardRecord] = ()
                     ) -> str:
        """Store this rank's manifest and layout once each (content-addressed); returns the
        layout id. ``packed`` lists the contiguous or converted copies built for consumers.

        Raises:
            StaleSessionError: this session was fenced or this rank's lease expired.
            CatalogRejected: etcd refused a write (e.g. permissions).
        """
        s = self.sessions.require()
        man = manifest_record(shards)
        rec = layout_record(s.epoch, s.rank, man, shards, transport, packed)
        lid, mid = rec["layout_id"], man["manifest_id"]
        if lid in self._written:
            return lid
        key = self.client.key("layouts", pad20(s.epoch), pad20(s.rank), lid)
        blobs = [] if mid in self._written_manifests else \
            [blob_requests(self.client.key("manifests", mid), codec.encode("manifest", man), None)]
        blobs.append(blob_requests(key, codec.encode("layout", rec), s.lease_id))
        # Chunks first, then both heads in one fenced transaction (a session's first put was two
        # round trips here): the manifest's head is in before any layout names it.
        for chunks, _ in blobs:
            for ops in chunks:
                self.client.txn("write layout chunk", [], ops)
        heads = [head for _, head in blobs]
        # two heads inlining up to CHUNK_BYTES each could pass etcd's request limit: apart then
        groups = [heads] if sum(len(h.value) for h in heads) <= CHUNK_BYTES else [[h] for h in heads]
        for group in groups:
            ok, _ = self.client.txn("write layout", self.sessions.fence(), group)
            if not ok:
                raise self.sessions.fenced_error("write layout")
        self._written_manifests.add(mid)
        self._written[lid] = mid
        self._manifests.setdefault(mid, manifest_from_record(man, mid))
        return lid

    def _ensure_manifest(self, mid: str, man: Mapping[str, Any], *, force: bool = False) -> None:
        if mid in self._written_manifests and not force:
            return
        self._write_blob("write manifest", self.client.key("manifests", mid), codec.encode("manifest", man), None)
        self._written_manifests.add(mid)

    def put_piece(self, step: int, layout_id: str, base_offset: int = 0, meta: bytes | None = None,
                  slot_bases: Sequence[int] = ()) -> bool:
        """Write this rank's piece of ``step`` (and its ``meta``, the msgpack of ``put(meta=...)``)
        and, when this piece completes the set, commit it in the same transaction; True if the
        version is committed. ``slot_bases``: the staging pool's slot offsets, for consumers to
        prefault ahead (see ``schemas/piece.json``).

        Raises:
            CatalogError: ``step`` is not an int in [0, 1e19), or ``layout_id`` was not written here.
            StaleStepError: a newer step is already committed: ``step`` can never commit.
            StaleSessionError: this session was fenced or this rank's lease expired.
        """
        self.sessions.require()
        step = check_step(step, CatalogError)
        mid = self._written.get(layout_id)
        if mid is None:
            raise CatalogError(f"layout {layout_id} was not written by this process (write_layout first)")
        for _attempt in range(2):
            committed = self._piece_result(step, self._piece_txn(step, layout_id, mid, base_offset, meta,
                                                                 slot_bases))
            if committed is not None:
                return committed
            # The manifest is gone (retention collected it while unused): write it again, once.
            self._rewrite_manifest(mid)
        raise CatalogError(f"step {step}: the manifest of layout {layout_id} keeps disappearing")

    def _rewrite_manifest(self, mid: str) -> None:
        cached = self._manifests[mid]
        shards = cached.records(0)
        self._ensure_manifest(mid, manifest_record(shards), force=True)

    def _piece_txn(self, step: int, lid: str, mid: str, base: int, meta: bytes | None,
                   slot_bases: Sequence[int] = ()) -> Any:
        """One transaction: the piece (with its meta), and the commit when every other rank's
        piece is there. etcd serializes transactions, so the last rank's transaction sees all
        the pieces."""
        s, k = self.sessions.require(), self.client.key
        rec = {"step": step, "epoch": s.epoch, "rank": s.rank, "world_size": s.world_size, "layout_id": lid,
               "base_offset": base, "manifest_id": mid}
        if slot_bases:
            rec["slot_bases"] = list(slot_bases)
        piece = codec.encode("piece", rec)
        pkey = k("versions", pad20(step), "pieces", pad20(s.epoch), pad20(s.rank))
        writes = [tx.Put(pkey, piece)]
        if meta is not None:
            writes.append(tx.Put(k("meta", pad20(step), pad20(s.epoch), pad20(s.rank)),
                                 codec.encode("meta", {"step": step, "epoch": s.epoch, "rank": s.rank, "data": meta})))
        mine = [*self.sessions.fence(), tx.Version(k("manifests", mid)) > 0,
                tx.Value(k("latest")) < codec.encode_counter(step + 1)]  # latest <= step (empty is smallest)
        probe = [tx.Get(k("epoch")), tx.Get(k("latest")), self.client.count_op(k("manifests", mid), prefix=False)]
        if s.world_size - 1 <= _MAX_PIECE_COMPARES:
            others = [tx.Version(k("versions", pad20(step), "pieces", pad20(s.epoch), pad20(r))) > 0
                      for r in range(s.world_size) if r != s.rank]
            commit = codec.encode("commit", {"step": step, "epoch": s.epoch, "world_size": s.world_size,
                                             "committed_at": time.time()})
            return self.client.txn_raw(
                f"piece of step {step}", [*mine, *others],
                [*writes, tx.Put(k("versions", pad20(step), "commit"), commit),
                 tx.Put(k("commits", pad20(step)), b""), tx.Put(k("latest"), codec.encode_counter(step))],
                [tx.Txn(mine, writes, []), *probe])
        # The failure branch starts with a transaction that never succeeds: nothing was written.
        never = tx.Txn([tx.Version(k("epoch")) < 0], [], [])
        count = self.client.count_op(k("versions", pad20(step), "pieces", pad20(s.epoch)) + "/")
        return self.client.txn_raw(f"piece of step {step}", mine, [*writes, count], [never, *probe])

    def _piece_result(self, step: int, resp: Any) -> bool | None:
        """Read a piece transaction's answer; None when the manifest must be written again."""
        s = self.sessions.require()
        counting = s.world_size - 1 > _MAX_PIECE_COMPARES
        if resp.succeeded and not counting:
            self._committed(step)
            return True
        if resp.succeeded:  # the rank whose piece completes the set commits
            n = int(resp.responses[-1].response_range.count)  # the count follows the writes
            return n >= s.world_size and self._commit_counted(step)
        if resp.responses[0].response_txn.succeeded:
            return False  # piece written; other ranks' pieces are still missing
        epoch_kv, latest_kv = resp.responses[1].response_range.kvs, resp.responses[2].response_range.kvs
        epoch_now = counter_value(self.client.key("epoch"), epoch_kv[0].value) if epoch_kv else None
        mkey = self.client.key("members", pad20(s.epoch), pad20(s.rank))
        member = self.client.call("get member", lambda: self.client.raw.get(mkey))[0]
        if epoch_now != s.epoch or member is None:
            raise self.sessions.fenced_error(f"piece of step {step}")
        if int(resp.responses[3].response_range.count) == 0:
            return None  # the manifest key is missing
        latest = counter_value(self.client.key("latest"), latest_kv[0].value) if latest_kv else None
        if latest is not None and latest > step:
            raise StaleStepError(
                f"namespace {self.client.namespace!r}: step {step} can never commit: step {latest} is already "
                "committed and steps only move forward; number new steps from latest()+1 (after a restart, "
                "recover() republishes the newest state first)")
        raise CatalogError(f"namespace {self.client.namespace!r}: piece of step {step} was refused for no known "
                           "reason (epoch, member, manifest and latest all check out)")

    def _commit_counted(self, step: int) -> bool:
        s, k = self.sessions.require(), self.client.key
        commit = codec.encode("commit", {"step": step, "epoch": s.epoch, "world_size": s.world_size,
                                         "committed_at": time.time()})
        ok, _ = self.client.txn(f"commit {step}", [*self.sessions.fence(),
                                                   tx.Value(k("latest")) < codec.encode_counter(step + 1)],
                                [tx.Put(k("versions", pad20(step), "commit"), commit),
                                 tx.Put(k("commits", pad20(step)), b""),
                                 tx.Put(k("latest"), codec.encode_counter(step))])
        if ok:
            self._committed(step)
        return bool(ok)

    def _committed(self, step: int) -> None:
        s = self.sessions.require()
        log.info("namespace %s: committed step %d (epoch %d)", self.client.namespace, step, s.epoch)
        with self._count_lock:
            self._unlisted += 1
        self._retention.poke()

    def _within_retention(self) -> bool:
        """Whether the commits/ index surely holds at most ``retention`` steps without listing it:
        the last listing's count plus this process's commits since, in the same single-rank
        session (no other process commits in it; a count too high only lists sooner)."""
        s = self.sessions.current
        with self._count_lock:
            n, self._unlisted = self._unlisted, 0
            if s is None or s.world_size != 1 or self._listed is None or self._listed[0] != s.epoch:
                self._listed = None
                return False
            count = self._listed[1] + n
            if count > self.retention:
                return False
            self._listed = (s.epoch, count)
            return True

    # ---- retention (background) ------------------------------------------------------------

    def _apply_retention(self) -> None:
        """Drop versions beyond ``retention`` (each with its readers and markers, one transaction
        per step; the ``commits/`` index keeps this O(retention), not O(ranks)); every
        ``_GC_EVERY`` drops, also the manifests no retained version names."""
        if self._within_retention():
            return
        c = self.client
        s = self.sessions.current
        pre = c.key("commits") + "/"
        kvs = c.call("list commits", lambda: list(c.raw.get_prefix(pre, keys_only=True)))
        steps = sorted(self._committed_index(pre, kvs))
        drop = steps[: max(0, len(steps) - self.retention)]
        if s is not None:
            with self._count_lock:  # commits made while listing are counted on top (too high at worst)
                self._listed = (s.epoch, len(steps) - len(drop))
        for old in drop:
            c.txn("retention", [], [tx.Delete(p, range_end(p)) for p in (c.key(f, pad20(old), "") for f in _PER_STEP)]
                  + [tx.Delete(pre + pad20(old))])
        self._drops += len(drop)
        if drop and self._drops >= _GC_EVERY:
            self._drops = 0
            self._collect_manifests()

    def _committed_index(self, pre: str, kvs: Sequence[tuple[Any, Any]]) -> list[int]:
        """The steps of the ``commits/`` index that name a committed version. Keys that are not
        20-digit steps, and entries without a commit record (nobody's commit writes one alone),
        are skipped — and the latter deleted — so that they never push real versions out."""
        c = self.client
        steps = []
        for _v, m in kvs:
            key = m.key.decode("utf-8", "replace")
            step = parse_pad20(key[len(pre):])
            if step is None:
                self.skips(key, "not a commit index key (the step is 20 digits)", m.mod_revision)
            else:
                steps.append(step)
        if len(steps) <= self.retention:
            return steps
        real = []
        for i in range(0, len(steps), 64):
            batch = steps[i:i + 64]
            resp = c.txn_raw("check commit index", [], [
                c.count_op(c.key("versions", pad20(s), "commit"), prefix=False) for s in batch])
            for s, r in zip(batch, resp.responses):
                if int(r.response_range.count):
                    real.append(s)
                else:  # (another process's retention may have just dropped both: then nothing is deleted)
                    key = pre + pad20(s)
                    if c.call("drop index entry", lambda: c.raw.delete(key)):
                        self.skips(key, "an index entry without a commit record (deleted)")
        return real

    def _collect_manifests(self) -> None:
        """Delete manifests that no retained version names and that are older than every retained
        commit (a newer one may be about to be named by a piece)."""
        c = self.client
        vpre = c.key("versions") + "/"
        kvs, _ = c.get_prefix_rev(vpre)
        named, oldest, unsure = set(), None, False
        for value, meta in kvs:
            key = meta.key.decode("utf-8", "replace")
            tail = key[len(vpre):].split("/")
            if tail[1:] == ["commit"]:
                oldest = meta.create_revision if oldest is None else min(oldest, meta.create_revision)
            elif len(tail) == 4 and tail[1] == "pieces":
                try:
                    named.add(codec.decode("piece", value)["manifest_id"])
                except CodecError as exc:
                    # Which manifest this piece named is unknown: collect nothing this time.
                    self.skips(key, str(exc), meta.mod_revision)
                    unsure = True
        if oldest is None or unsure:
            return
        pre = c.key("manifests") + "/"
        heads = c.call("list manifests", lambda: list(c.raw.get_prefix(pre, keys_only=True)))
        for _v, meta in heads:
            mid = meta.key.decode("utf-8", "replace")[len(pre):]
            if "/" not in mid and mid not in named and meta.create_revision < oldest:
                key = pre + mid
                c.txn("drop manifest", [], [tx.Delete(key), tx.Delete(key + "/", range_end(key + "/"))])

    # ---- reading --------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose metadata is still held, oldest first."""
        pre = self.client.key("versions") + "/"
        kvs = self.client.call("list versions", lambda: list(self.client.raw.get_prefix(pre, keys_only=True)))
        steps = []
        for _v, m in kvs:
            tail = m.key.decode("utf-8", "replace")[len(pre):].split("/")
            if tail[1:] == ["commit"]:
                step = parse_pad20(tail[0])
                if step is None:
                    self.skips(pre + "/".join(tail), "not a version key (the step is 20 digits)", m.mod_revision)
                else:
                    steps.append(step)
        return sorted(steps)

    def latest(self) -> int | None:
        """The newest committed step, or None before the first commit (one etcd read).

        Raises:
            CatalogCorrupted: the ``latest`` key holds something that is not a counter.
        """
        return read_counter(self.client, "latest")[0]

    def wait_for(self, min_step: int | None = None, timeout: float | None = None) -> int:
        """Block until a committed version >= ``min_step`` exists (any version when None);
        returns the newest committed step known. A watch on ``latest`` keeps it current, so a
        steady-state call makes no etcd request.

        Raises:
            WaitTimeout: none appeared within ``timeout`` seconds.
        """
        return self._latest.wait(min_step, timeout)

    @property
    def waits_seen(self) -> tuple[int | None, ...]:
        """The newest step known each time a :meth:`wait_for` blocked (the last 16): what a waiter
        had seen when it decided to keep waiting. For tools and tests."""
        return tuple(self._latest.blocked_at)

    def flush_retention(self, timeout: float = 30.0) -> bool:
        """Wait until the background retention has caught up with every commit so far; True
        when it has (for tools and tests: nothing needs to wait for retention)."""
        return self._retention.wait_idle(timeout)

    def read_version(self, step: int) -> Version:
        """Commit and pieces of a committed step, in one round trip (no reader registration).

        Raises:
            VersionNotFound: the step is not committed (or its metadata was dropped by retention).
            CatalogCorrupted: its commit record, or a piece of the committing session, is bad.
        """
        kvs, _ = self.client.get_prefix_rev(self.client.key("versions", pad20(step)) + "/")
        return version_from_kvs(self.client.namespace, step, kvs, self.skips)

    def delete_step(self, step: int) -> None:
        """Drop committed ``step`` now, as retention would (its pieces, commit, meta, readers and
        markers, one transaction). The newest step stays: ``latest`` must keep naming a version.

        Raises:
            VersionNotFound: ``step`` is not committed (or already dropped).
            CatalogError: ``step`` is the newest committed step.
        """
        c, step = self.client, check_step(step, CatalogError)
        if step == self.latest():
            raise CatalogError(f"namespace {c.namespace!r}: step {step} is the newest committed step and cannot be "
                               "deleted alone (delete the whole namespace instead)")
        commit = c.key("versions", pad20(step), "commit")
        ok, _ = c.txn(f"delete step {step}", [tx.Version(commit) > 0],
                      [tx.Delete(p, range_end(p)) for p in (c.key(f, pad20(step), "") for f in _PER_STEP)]
                      + [tx.Delete(c.key("commits", pad20(step)))])
        if not ok:
            raise VersionNotFound(f"namespace {c.namespace!r}: step {step} is not committed")
        log.info("namespace %s: deleted step %d", c.namespace, step)

    def read_meta(self, step: int, rank: int) -> bytes | None:
        """The meta bytes rank ``rank`` put with committed ``step`` (None: it gave none). Only the
        committing epoch's record counts: a fenced session's leftover is not this version's.

        Raises:
            VersionNotFound: the step is not committed (or retention dropped it).
            CatalogCorrupted: its commit or meta record is bad (skipped, counted and logged too).
        """
        c, step = self.client, check_step(step, CatalogError)
        ckey = c.key("versions", pad20(step), "commit")
        raw, _m = c.call("get commit", lambda: c.raw.get(ckey))
        if raw is None:
            raise VersionNotFound(f"namespace {c.namespace!r}: step {step} is not committed")
        commit = self._checked(ckey, lambda: codec.decode("commit", raw))
        mkey = c.key("meta", pad20(step), pad20(commit["epoch"]), pad20(rank))
        value, _m = c.call("get meta", lambda: c.raw.get(mkey))
        if value is None:
            return None
        rec = self._checked(mkey, lambda: codec.decode("meta", value))
        if (rec["step"], rec["epoch"], rec["rank"]) != (step, commit["epoch"], rank):
            self.skips(mkey, f"meta of step {rec['step']} epoch {rec['epoch']} rank {rec['rank']} under this key")
            raise CatalogCorrupted(f"namespace {c.namespace!r}: meta record {mkey} names another version or rank",
                                   key=mkey)
        return bytes(rec["data"])

    def _checked(self, key: str, decode: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return decode()
        except CodecError as exc:
            self._skip(key, exc)
            raise CatalogCorrupted(f"namespace {self.client.namespace!r}: record {key} is corrupted: {exc}",
                                   key=key) from None

    def _read_blobs(self, keys: Sequence[str]) -> dict[str, bytes | None]:
        """Blobs by key, ``_BLOBS_PER_TXN`` range reads per transaction; a bad one is None (skipped)."""
        out: dict[str, bytes | None] = {}
        for i in range(0, len(keys), _BLOBS_PER_TXN):
            batch = keys[i:i + _BLOBS_PER_TXN]
            _ok, resp = self.client.txn("get blobs", [], [tx.Get(k, range_end(k)) for k in batch])
            for key, kvs in zip(batch, resp):
                try:
                    out[key] = blob_from_kvs(key, _checked_blob_kvs(key, kvs))
                except (CodecError, ValueError) as exc:  # ValueError: e.g. a key that is not UTF-8
                    self._skip(key, exc)
                    out[key] = None
        return out

    def _skip(self, key: str, exc: Exception) -> None:
        self.skips(key, str(exc))

    def manifests_of(self, version: Version) -> dict[int, Manifest]:
        """Every rank's manifest of a committed version (leaseless: whichever ranks are alive).

        Raises:
            CatalogError: a manifest the version names is missing or bad.
        """
        self._fetch_manifests({p.manifest_id: self.client.key("manifests", p.manifest_id)
                               for p in version.pieces.values()})
        missing = sorted(r for r, p in version.pieces.items() if p.manifest_id not in self._manifests)
        if missing:
            raise CatalogError(f"namespace {self.client.namespace!r}: step {version.step}: manifests of ranks "
                               f"{missing} are missing or bad")
        return {r: self._manifests[p.manifest_id] for r, p in version.pieces.items()}

    def _fetch_manifests(self, want: Mapping[str, str]) -> None:
        todo = {mid: key for mid, key in want.items() if mid not in self._manifests}
        for key, data in self._read_blobs(list(todo.values())).items():
            mid = key.rsplit("/", 1)[1]
            if data is not None:
                self._decode(key, lambda: self._manifests.__setitem__(
                    mid, manifest_from_record(codec.decode("manifest", data), mid)))

    def _decode(self, key: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except CodecError as exc:
            self._skip(key, exc)

    def layouts_of(self, version: Version) -> Version:
        """The version with the layouts of its live sources (cached by key: layouts are immutable
        and verified against the key they were read at). A publisher whose layout lease expired
        (the rank died) — or whose layout is bad — is listed in ``missing``; a re-serving consumer
        that died, whose records are bad, or whose tensors are not the version's, is left out."""
        k = self.client.key
        manifests = {p.manifest_id: k("manifests", p.manifest_id) for p in version.pieces.values()}
        manifests.update({rp.manifest_id: k("layouts", "replicas", m, rp.manifest_id)
                          for m, rp in version.replicas.items()})
        self._fetch_manifests(manifests)
        pkeys = {r: k("layouts", pad20(p.epoch), pad20(p.rank), p.layout_id) for r, p in version.pieces.items()}
        rkeys = {m: k("layouts", "replicas", m, rp.layout_id) for m, rp in version.replicas.items()}
        want: dict[str, tuple[str, int | None, int | None]] = {}  # layout key -> (manifest id, epoch, rank)
        for r, p in version.pieces.items():
            if pkeys[r] not in self._layouts:
                want[pkeys[r]] = (p.manifest_id, p.epoch, p.rank)
        for m, rp in version.replicas.items():
            if rkeys[m] not in self._layouts:
                want[rkeys[m]] = (rp.manifest_id, 0, 0)
        for key, data in self._read_blobs(list(want)).items():
            mid, epoch, rank = want[key]
            if data is not None and mid in self._manifests:
                self._decode(key, lambda: self._cache_layout(key, data, self._manifests[mid], epoch, rank))
        layouts = {r: self._layouts[pkeys[r]] for r, p in version.pieces.items()
                   if self._usable(pkeys[r], p.manifest_id)}
        pub = tuple(sorted({p.manifest_id for p in version.pieces.values()})) if version.replicas else ()
        rlayouts = {m: self._layouts[rkeys[m]] for m, rp in version.replicas.items()
                    if self._usable(rkeys[m], rp.manifest_id) and self._replica_fits(pub, rkeys[m], rp.manifest_id)}
        missing = frozenset(r for r in version.pieces if r not in layouts)
        return Version(version.step, version.epoch, version.world_size, version.pieces, version.replicas,
                       layouts, rlayouts, missing)

    def _usable(self, key: str, manifest_id: str) -> bool:
        """Whether the layout read at ``key`` is cached and describes the manifest its record names."""
        lay = self._layouts.get(key)
        if lay is None:
            return False
        if lay.manifest_id != manifest_id:
            self.skips(key, f"the record naming this layout names manifest {manifest_id}, the layout "
                            f"{lay.manifest_id}")
            return False
        return True

    def _replica_fits(self, pub: tuple[str, ...], key: str, manifest_id: str) -> bool:
        """Whether a re-serving consumer's tensors are tensors of the version (whose publishers'
        manifests are ``pub``), of the same global shapes (dtypes may differ: buffers pulled with a
        conversion). Skipped (counted) if not."""
        if any(mid not in self._manifests for mid in pub):
            return True  # the version's own tensors are unknown here: nothing to compare with
        why = self._fits.get((manifest_id, pub))
        if why is None:
            shapes: dict[str, tuple[int, ...]] = {}
            for mid in pub:
                shapes.update(_global_shapes(self._manifests[mid]))
            why = ""
            for name, shape in _global_shapes(self._manifests[manifest_id]).items():
                if shapes.get(name) != shape:
                    why = (f"re-serves {name!r} of global shape {shape}, the version's is "
                           f"{shapes.get(name, 'absent')}")
                    break
            if len(self._fits) > 256:
                self._fits.clear()
            self._fits[(manifest_id, pub)] = why
        if why:
            self.skips(key, why)
        return not why

    def _cache_layout(self, key: str, data: bytes, manifest: Manifest, epoch: int | None, rank: int | None) -> None:
        lid = key.rsplit("/", 1)[1]
        rec = codec.decode("layout", data)
        self._layouts[key] = layout_from_record(rec, manifest, key_id=lid, epoch=epoch, rank=rank)

    def close(self) -> None:
        self._latest.close()
        self._retention.close()


def _global_shapes(m: Manifest) -> dict[str, tuple[int, ...]]:
    """Tensor name -> global shape of a manifest's shards."""
    st, gs = m.starts.tolist(), m.global_shapes.tolist()
    return {n: tuple(gs[st[i]:st[i + 1]]) for i, n in enumerate(m.names)}


def _checked_blob_kvs(key: str, kvs: Sequence[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
    """The (value, meta) pairs of one blob range read, checked before they are put together: keys
    are UTF-8, and the head asks for no more chunks than are there (so a head claiming 10^15
    chunks is refused before anything is sized by it).

    Raises:
        CodecError: either does not hold.
    """
    chunks = 0
    for _v, meta in kvs:
        try:
            k = meta.key.decode()
        except UnicodeDecodeError:
            raise CodecError(f"blob {key}: a key under it is not UTF-8 ({bytes(meta.key)[:60]!r})") from None
        if k.startswith(key + "/"):
            chunks += 1
    head = next((v for v, meta in kvs if meta.key == key.encode()), None)
    if head is not None:
        n = codec.decode("blob", head)["chunks"]
        if n > chunks:
            raise CodecError(f"blob {key}: the head names {n} chunks, {chunks} are there")
    return list(kvs)


class _LatestWatch:
    """The newest committed step, kept current by a watch on ``latest``. Re-established (with
    one read) when the watch stream breaks, and re-read after a quiet wait of 5 s in case a
    watch is stuck without saying so. A value that is not a counter is skipped (counted in
    ``skips``) on the watch; :meth:`wait` raises ``CatalogCorrupted`` when a read finds one."""

    def __init__(self, client: EtcdClient, skips: Skips | None = None):
        self.client = client
        self.skips = skips
        self.key = client.key("latest")
        self._cond = threading.Condition()
        self._value: int | None = None
        self._watch: Any = None
        self._alive = False
        self.blocked_at: deque[int | None] = deque(maxlen=16)

    def _on_event(self, resp: Any) -> None:
        with self._cond:
            if isinstance(resp, Exception):
                self._alive = False  # the stream ended (etcd restart, compaction): re-watch on next wait
            else:
                for ev in getattr(resp, "events", ()):
                    try:
                        v = codec.decode_counter(ev.value)
                    except CodecError as exc:
                        if self.skips is not None:
                            self.skips(self.key, f"not a counter: {exc}", getattr(ev, "mod_revision", None))
                        continue
                    if v is not None and (self._value is None or v > self._value):
                        self._value = v
            self._cond.notify_all()

    def _refresh(self) -> None:
        """Read ``latest`` and (re)start the watch right after the revision read."""
        resp = self.client.call("get latest", lambda: self.client.raw.get_response(self.key))
        value = counter_value(self.key, resp.kvs[0].value) if resp.kvs else None
        rev = int(resp.header.revision)
        with self._cond:
            if value is not None and (self._value is None or value > self._value):
                self._value = value
            if not self._alive:
                old, self._watch = self._watch, None
                if old is not None:
                    try:
                        self.client.raw.cancel_watch(old)
                    except Exception:  # the old stream is already gone
                        pass
                self._watch = self.client.call("watch latest", lambda: self.client.raw.add_watch_callback(
                    self.key, self._on_event, start_revision=rev + 1))
                self._alive = True

    def wait(self, min_step: int | None, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self._alive:
                self._refresh()
            with self._cond:
                v = self._value
                if v is not None and (min_step is None or v >= min_step):
                    return v
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    want = "any version" if min_step is None else f"a version >= {min_step}"
                    raise WaitTimeout(f"namespace {self.client.namespace!r}: {want} was not committed within "
                                      f"{timeout}s (latest is {v})")
                self.blocked_at.append(v)
                woke = self._cond.wait(5.0 if remaining is None else min(remaining, 5.0))
            if not woke:
                self._refresh()  # a quiet 5 s: make sure the watch did not silently miss a commit

    def close(self) -> None:
        with self._cond:
            w, self._watch, self._alive = self._watch, None, False
        if w is not None:
            try:
                self.client.raw.cancel_watch(w)
            except Exception:  # closing: the stream may already be gone
                pass

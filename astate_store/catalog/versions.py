"""Versions: publishing manifests, layouts and pieces, and committing a step; retention
(``retention.py``), reading (``version_reads.py``) and the ``latest`` watch (``latest.py``) are
their own modules.

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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pyetcd import transactions as tx

from astate_store.catalog.background import own_job
from astate_store.catalog.blobs import CHUNK_BYTES, blob_requests
from astate_store.catalog.deltas import Delta, delta_record
from astate_store.catalog.latest import LatestWatch
from astate_store.catalog.records import Skips, counter_value, pad20, parse_pad20
from astate_store.catalog.retention import PER_STEP, Retention
from astate_store.catalog.sessions import Sessions, read_counter
from astate_store.catalog.shard_tables import layout_record, manifest_from_record, manifest_record
from astate_store.catalog.version_reads import VersionReads
from astate_store.errors import CatalogError, StaleStepError, VersionNotFound
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.model import codec
from astate_store.model.layout import ShardRecord, check_step

__all__ = ["Versions"]

log = logging.getLogger("astate_store.catalog")

# Up to this many other ranks the commit compares each piece key (one round trip); past it
# (etcd allows 128 operations per transaction) the piece transaction counts the pieces and the
# rank that completes the set commits in a second transaction.
_MAX_PIECE_COMPARES = 96


class Versions:
    """Publishing and reading committed versions; keeps the newest ``retention`` of them."""

    def __init__(
        self,
        client: EtcdClient,
        sessions: Sessions,
        retention: int,
        runner: Callable[[str, Callable[[], None]], Any] | None = None,
    ):
        self.client, self.sessions, self.retention = client, sessions, retention
        self._written: dict[str, str] = {}  # layout id -> manifest id, of layouts this process wrote
        self._written_manifests: set[str] = set()
        self.skips = Skips(client.namespace, "bad")  # records that failed their schema or key checks
        # Reading is its own role; its manifest cache is shared, so a manifest written here is known.
        self.reads = VersionReads(client, self.skips)
        self._manifests = self.reads._manifests
        self.read_version, self.read_meta = self.reads.read_version, self.reads.read_meta
        self.manifests_of, self.layouts_of = self.reads.manifests_of, self.reads.layouts_of
        self._latest = LatestWatch(client, self.skips)
        # ``runner`` (name, fn) -> an object with poke / wait_idle / close: a thread shared by many
        # namespaces (hub.py); by default this namespace's own lazily started thread.
        self._retainer = Retention(client, sessions, retention, self.skips)
        self._retention = (runner or own_job)(f"astate-retention-{client.namespace}", self._retainer.apply)

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

    def write_layout(
        self, shards: Sequence[ShardRecord], transport: bytes, packed: Sequence[ShardRecord] = ()
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
        blobs = (
            []
            if mid in self._written_manifests
            else [blob_requests(self.client.key("manifests", mid), codec.encode("manifest", man), None)]
        )
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
        self._write_blob(
            "write manifest", self.client.key("manifests", mid), codec.encode("manifest", man), None
        )
        self._written_manifests.add(mid)

    def put_piece(
        self,
        step: int,
        layout_id: str,
        base_offset: int = 0,
        meta: bytes | None = None,
        slot_bases: Sequence[int] = (),
        *,
        step_word: tuple[int, int, int] | None = None,
        delta: Delta | None = None,
    ) -> bool:
        """Write this rank's piece of ``step`` (and its ``meta``, the msgpack of ``put(meta=...)``)
        and, when this piece completes the set, commit it in the same transaction; True if the
        version is committed. ``slot_bases``: the staging pool's slot offsets, for consumers to
        prefault ahead; ``step_word``: (region, offset, token) of the slot's step word (both in
        ``schemas/piece.json``); ``delta``: the rank's change map of the step, written next to the
        piece in the same transaction (``schemas/delta.json``, docs/delta.md).

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
            committed = self._piece_result(
                step, self._piece_txn(step, layout_id, mid, base_offset, meta, slot_bases, step_word, delta)
            )
            if committed is not None:
                return committed
            # The manifest is gone (retention collected it while unused): write it again, once.
            self._rewrite_manifest(mid)
        raise CatalogError(f"step {step}: the manifest of layout {layout_id} keeps disappearing")

    def _rewrite_manifest(self, mid: str) -> None:
        cached = self._manifests[mid]
        shards = cached.records(0)
        self._ensure_manifest(mid, manifest_record(shards), force=True)

    def _piece_txn(
        self,
        step: int,
        lid: str,
        mid: str,
        base: int,
        meta: bytes | None,
        slot_bases: Sequence[int] = (),
        step_word: tuple[int, int, int] | None = None,
        delta: Delta | None = None,
    ) -> Any:
        """One transaction: the piece (with its meta), and the commit when every other rank's
        piece is there. etcd serializes transactions, so the last rank's transaction sees all
        the pieces."""
        s, k = self.sessions.require(), self.client.key
        rec = {
            "step": step,
            "epoch": s.epoch,
            "rank": s.rank,
            "world_size": s.world_size,
            "layout_id": lid,
            "base_offset": base,
            "manifest_id": mid,
        }
        if slot_bases:
            rec["slot_bases"] = list(slot_bases)
        if step_word is not None:
            rec["step_word"] = dict(zip(("region", "offset", "token"), step_word))
        piece = codec.encode("piece", rec)
        pkey = k("versions", pad20(step), "pieces", pad20(s.epoch), pad20(s.rank))
        writes = [tx.Put(pkey, piece)]
        if delta is not None:
            drec = codec.encode("delta", delta_record(step, s.epoch, s.rank, lid, delta))
            writes.append(tx.Put(k("versions", pad20(step), "deltas", pad20(s.epoch), pad20(s.rank)), drec))
        if meta is not None:
            writes.append(
                tx.Put(
                    k("meta", pad20(step), pad20(s.epoch), pad20(s.rank)),
                    codec.encode("meta", {"step": step, "epoch": s.epoch, "rank": s.rank, "data": meta}),
                )
            )
        mine = [
            *self.sessions.fence(),
            tx.Version(k("manifests", mid)) > 0,
            tx.Value(k("latest")) < codec.encode_counter(step + 1),
        ]  # latest <= step (empty is smallest)
        probe = [
            tx.Get(k("epoch")),
            tx.Get(k("latest")),
            self.client.count_op(k("manifests", mid), prefix=False),
        ]
        if s.world_size - 1 <= _MAX_PIECE_COMPARES:
            others = [
                tx.Version(k("versions", pad20(step), "pieces", pad20(s.epoch), pad20(r))) > 0
                for r in range(s.world_size)
                if r != s.rank
            ]
            commit = codec.encode(
                "commit",
                {"step": step, "epoch": s.epoch, "world_size": s.world_size, "committed_at": time.time()},
            )
            return self.client.txn_raw(
                f"piece of step {step}",
                [*mine, *others],
                [
                    *writes,
                    tx.Put(k("versions", pad20(step), "commit"), commit),
                    tx.Put(k("commits", pad20(step)), b""),
                    tx.Put(k("latest"), codec.encode_counter(step)),
                ],
                [tx.Txn(mine, writes, []), *probe],
            )
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
                f"namespace {self.client.namespace!r}: step {step} can never commit: step {latest} is "
                "already committed and steps only move forward; number new steps from latest()+1 "
                "(after a restart, recover() republishes the newest state first)"
            )
        raise CatalogError(
            f"namespace {self.client.namespace!r}: piece of step {step} was refused for no known "
            "reason (epoch, member, manifest and latest all check out)"
        )

    def _commit_counted(self, step: int) -> bool:
        s, k = self.sessions.require(), self.client.key
        commit = codec.encode(
            "commit",
            {"step": step, "epoch": s.epoch, "world_size": s.world_size, "committed_at": time.time()},
        )
        ok, _ = self.client.txn(
            f"commit {step}",
            [*self.sessions.fence(), tx.Value(k("latest")) < codec.encode_counter(step + 1)],
            [
                tx.Put(k("versions", pad20(step), "commit"), commit),
                tx.Put(k("commits", pad20(step)), b""),
                tx.Put(k("latest"), codec.encode_counter(step)),
            ],
        )
        if ok:
            self._committed(step)
        return bool(ok)

    def _committed(self, step: int) -> None:
        s = self.sessions.require()
        log.info("namespace %s: committed step %d (epoch %d)", self.client.namespace, step, s.epoch)
        self._retainer.note_commit()
        self._retention.poke()

    # ---- reading --------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose metadata is still held, oldest first."""
        pre = self.client.key("versions") + "/"
        kvs = self.client.call("list versions", lambda: list(self.client.raw.get_prefix(pre, keys_only=True)))
        steps = []
        for _v, m in kvs:
            tail = m.key.decode("utf-8", "replace")[len(pre) :].split("/")
            if tail[1:] == ["commit"]:
                step = parse_pad20(tail[0])
                if step is None:
                    self.skips(
                        pre + "/".join(tail), "not a version key (the step is 20 digits)", m.mod_revision
                    )
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

    def flush_retention(self, timeout: float = 30.0) -> bool:
        """Wait until the background retention has caught up with every commit so far; True
        when it has (for tools and tests: nothing needs to wait for retention)."""
        return self._retention.wait_idle(timeout)

    def delete_step(self, step: int) -> None:
        """Drop committed ``step`` now, as retention would (its pieces, commit, meta, readers and
        markers, one transaction). The newest step stays: ``latest`` must keep naming a version.

        Raises:
            VersionNotFound: ``step`` is not committed (or already dropped).
            CatalogError: ``step`` is the newest committed step.
        """
        c, step = self.client, check_step(step, CatalogError)
        if step == self.latest():
            raise CatalogError(
                f"namespace {c.namespace!r}: step {step} is the newest committed step and cannot be "
                "deleted alone (delete the whole namespace instead)"
            )
        commit = c.key("versions", pad20(step), "commit")
        ok, _ = c.txn(
            f"delete step {step}",
            [tx.Version(commit) > 0],
            [tx.Delete(p, range_end(p)) for p in (c.key(f, pad20(step), "") for f in PER_STEP)]
            + [tx.Delete(c.key("commits", pad20(step)))],
        )
        if not ok:
            raise VersionNotFound(f"namespace {c.namespace!r}: step {step} is not committed")
        log.info("namespace %s: deleted step %d", c.namespace, step)

    def close(self) -> None:
        self._latest.close()
        self._retention.close()

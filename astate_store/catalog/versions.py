"""Versions: publishing layouts and pieces, committing a step, retention, and reading commits.

A step is committed by one etcd transaction once every rank of the session wrote its piece;
``latest`` only moves forward. Layouts are content-addressed and immutable, so both the ids
written and the layouts read are cached for the life of this object.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from pyetcd import transactions as tx

from .. import codec
from ..errors import CatalogError, WaitTimeout
from ..layout import ShardRecord, check_step
from .client import EtcdClient, range_end
from .records import Layout, Version, layout_from_record, layout_id_of, pad20, shard_to_wire, version_from_kvs
from .sessions import Sessions

__all__ = ["Versions"]

log = logging.getLogger("astate_store.catalog")

# Layout reads per transaction: keeps one response well inside etcd's request size limit.
_LAYOUTS_PER_TXN = 16
# Per-step key families that retention drops together with the version itself.
_PER_STEP = ("versions", "readers", "retired", "torn", "delivered")


class Versions:
    """Publishing and reading committed versions; keeps the newest ``retention`` of them."""

    def __init__(self, client: EtcdClient, sessions: Sessions, retention: int):
        self.client, self.sessions, self.retention = client, sessions, retention
        self._layout_cache: dict[str, Layout] = {}
        self._written_layouts: dict[str, bytes] = {}

    # ---- publishing -----------------------------------------------------------------------

    def write_layout(self, shards: Sequence[ShardRecord], transport: bytes,
                     packed: Sequence[tuple[str, ShardRecord]] = ()) -> str:
        """Store this rank's layout once (content-addressed); returns its id. ``packed`` lists
        contiguous copies built for single consumers (pre-packing).

        Raises:
            StaleSessionError: this session was fenced or this rank's lease expired.
        """
        s = self.sessions.require()
        lid = layout_id_of(s.epoch, s.rank, shards, transport, packed)
        if lid in self._written_layouts:
            return lid
        rec: dict[str, Any] = {"layout_id": lid, "epoch": s.epoch, "rank": s.rank,
                               "shards": [shard_to_wire(x) for x in shards], "transport": transport}
        if packed:
            rec["packed"] = [{"consumer": c, "shard": shard_to_wire(x)} for c, x in packed]
        value = codec.encode("layout", rec)
        ok, _ = self.client.txn("write layout", self.sessions.fence(), [
            tx.Put(self.client.key("layouts", pad20(s.epoch), pad20(s.rank), lid), value, lease=s.lease_id)])
        if not ok:
            raise self.sessions.fenced_error("layout write")
        self._written_layouts[lid] = value
        return lid

    def put_piece(self, step: int, layout_id: str, base_offset: int = 0) -> bool:
        """Write this rank's piece of ``step`` and try to commit; returns True if the version
        is committed (by this or another rank's transaction).

        Raises:
            CatalogError: ``step`` is not an int in [0, 1e19).
            StaleSessionError: this session was fenced or this rank's lease expired.
        """
        s = self.sessions.require()
        step = check_step(step, CatalogError)
        piece = codec.encode("piece", {"step": step, "epoch": s.epoch, "rank": s.rank, "world_size": s.world_size,
                                       "layout_id": layout_id, "base_offset": base_offset})
        ok, _ = self.client.txn("write piece", self.sessions.fence(), [
            tx.Put(self.client.key("versions", pad20(step), "pieces", pad20(s.epoch), pad20(s.rank)), piece)])
        if not ok:
            raise self.sessions.fenced_error(f"piece of step {step}")
        return self.try_commit(step)

    def try_commit(self, step: int) -> bool:
        """Commit ``step`` if all pieces of this session are present (an etcd transaction).

        Concurrent calls from several ranks are safe: the comparisons make every winner
        write the same commit, and ``latest`` only moves forward. The winner applies retention.
        """
        s = self.sessions.require()
        k = self.client.key
        pieces = [tx.Version(k("versions", pad20(step), "pieces", pad20(s.epoch), pad20(r))) > 0
                  for r in range(s.world_size)]
        # latest <= step, as a bytewise compare against step + 1 (an empty latest is smallest).
        forward = tx.Value(k("latest")) < codec.encode_counter(step + 1)
        commit = codec.encode("commit", {"step": step, "epoch": s.epoch, "world_size": s.world_size,
                                         "committed_at": time.time()})
        ok, resp = self.client.txn(f"commit {step}", [*self.sessions.fence(), *pieces, forward], [
            tx.Put(k("versions", pad20(step), "commit"), commit),
            tx.Put(k("latest"), codec.encode_counter(step)),
        ], [tx.Get(k("epoch")), tx.Get(k("latest")), tx.Get(k("versions", pad20(step), "commit"))])
        if ok:
            log.info("namespace %s: committed step %d (epoch %d)", self.client.namespace, step, s.epoch)
            self._apply_retention()
            return True
        # Failed: tell "fenced" (an error) from "a newer step won" (False) from "already committed".
        epoch_now = codec.decode_counter(resp[0][0][0]) if resp[0] else None
        if epoch_now != s.epoch:
            raise self.sessions.fenced_error(f"commit of step {step}")
        latest = codec.decode_counter(resp[1][0][0]) if resp[1] else None
        if latest is not None and latest > step:
            log.warning("namespace %s: step %d superseded by committed step %d", self.client.namespace, step, latest)
            return False
        return bool(resp[2]) and codec.decode("commit", resp[2][0][0])["epoch"] == s.epoch

    def _apply_retention(self) -> None:
        steps = self.committed_steps()
        for old in steps[: max(0, len(steps) - self.retention)]:
            # One transaction per dropped step: its readers and markers go with its metadata.
            self.client.txn("retention", [], [
                tx.Delete(p, range_end(p)) for p in (self.client.key(fam, pad20(old), "") for fam in _PER_STEP)])

    # ---- reading --------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose metadata is still held, oldest first."""
        pre = self.client.key("versions") + "/"
        kvs = self.client.call("list versions", lambda: list(self.client.raw.get_prefix(pre, keys_only=True)))
        out = []
        for _v, meta in kvs:
            k = meta.key.decode()
            if k.endswith("/commit"):
                out.append(int(k[len(pre):].split("/", 1)[0]))
        return sorted(out)

    def latest(self) -> int | None:
        """The newest committed step, or None before the first commit."""
        return self.client.get_counter("latest")[0]

    def wait_for(self, min_step: int | None = None, timeout: float | None = None) -> int:
        """Block until a committed version >= ``min_step`` exists (any version when None);
        returns the newest committed step. Built on an etcd watch of ``latest``.

        Raises:
            WaitTimeout: none appeared within ``timeout`` seconds.
        """
        key = self.client.key("latest")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            resp = self.client.call("get latest", lambda: self.client.raw.get_response(key))
            latest = codec.decode_counter(resp.kvs[0].value) if resp.kvs else None
            rev = int(resp.header.revision)
            if latest is not None and (min_step is None or latest >= min_step):
                return latest
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                want = "any version" if min_step is None else f"a version >= {min_step}"
                raise WaitTimeout(
                    f"namespace {self.client.namespace!r}: {want} was not committed within {timeout}s "
                    f"(latest is {latest})")
            # Watch from just after the read: a commit between the read and the watch is not missed.
            self.client.wait_change(key, remaining, start_revision=rev + 1)

    def read_version(self, step: int) -> Version:
        """Commit and pieces of a committed step, in one round trip (no reader registration).

        Raises:
            VersionNotFound: the step is not committed (or its metadata was dropped by retention).
        """
        kvs, _ = self.client.get_prefix_rev(self.client.key("versions", pad20(step)) + "/")
        return version_from_kvs(self.client.namespace, step, kvs)

    def layouts_of(self, version: Version) -> Version:
        """The version with the layouts of its live sources (cached by id: layouts are immutable).
        A publisher whose layout lease expired (the rank died) is listed in ``missing``; a
        re-serving consumer that died is left out."""
        cache = self._layout_cache
        want: list[tuple[object, str]] = []
        for p in version.pieces.values():
            if p.layout_id not in cache:
                want.append((p.rank, self.client.key("layouts", pad20(p.epoch), pad20(p.rank), p.layout_id)))
        for m, rp in version.replicas.items():
            if rp.layout_id not in cache:
                want.append((m, self.client.key("layouts", "replicas", m, rp.layout_id)))
        for i in range(0, len(want), _LAYOUTS_PER_TXN):
            batch = want[i:i + _LAYOUTS_PER_TXN]
            _ok, resp = self.client.txn("get layouts", [], [tx.Get(k) for _, k in batch])
            for r in resp:
                if r:  # an empty response: that source's lease is gone; it shows up as missing below
                    lay = layout_from_record(codec.decode("layout", r[0][0]))
                    cache[lay.layout_id] = lay
        layouts = {r: cache[p.layout_id] for r, p in version.pieces.items() if p.layout_id in cache}
        rlayouts = {m: cache[rp.layout_id] for m, rp in version.replicas.items() if rp.layout_id in cache}
        missing = frozenset(r for r in version.pieces if r not in layouts)
        return Version(version.step, version.epoch, version.world_size, version.pieces, version.replicas,
                       layouts, rlayouts, missing)

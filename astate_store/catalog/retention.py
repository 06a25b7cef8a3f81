"""Retention of committed versions: each dropped step's records go in one transaction (the
``commits/`` index keeps this O(retention), not O(ranks)); every few drops, the manifests no
retained version names."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from pyetcd import transactions as tx

from astate_store.catalog.records import Skips, pad20, parse_pad20
from astate_store.catalog.sessions import Sessions
from astate_store.errors import CodecError
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.model import codec

__all__ = ["Retention", "PER_STEP"]

log = logging.getLogger("astate_store.catalog")

# Per-step key families that retention drops together with the version itself.
PER_STEP = ("versions", "readers", "retired", "torn", "delivered", "meta")
# Manifests change only when a rank's shapes change: collecting them every few dropped steps is plenty.
_GC_EVERY = 16


class Retention:
    """Keeps the newest ``retention`` committed versions of a namespace: run on a background
    thread after commits (``catalog.background``), never on a put's path."""

    def __init__(self, client: EtcdClient, sessions: Sessions, retention: int, skips: Skips):
        self.client, self.sessions, self.retention, self.skips = client, sessions, retention, skips
        self._drops = 0  # versions dropped since manifests were last collected
        # Steps in the commits/ index as of the last listing (epoch, count), and commits made here
        # since: a single-rank session makes every commit of its epoch itself, so retention lists
        # the index again only once it may hold more than ``retention`` steps (not per commit).
        self._listed: tuple[int, int] | None = None
        self._unlisted = 0
        self._count_lock = threading.Lock()

    def note_commit(self) -> None:
        """This process committed a step (called on the put's path: a counter, no request)."""
        with self._count_lock:
            self._unlisted += 1

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

    def apply(self) -> None:
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
            c.txn(
                "retention",
                [],
                [tx.Delete(p, range_end(p)) for p in (c.key(f, pad20(old), "") for f in PER_STEP)]
                + [tx.Delete(pre + pad20(old))],
            )
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
            step = parse_pad20(key[len(pre) :])
            if step is None:
                self.skips(key, "not a commit index key (the step is 20 digits)", m.mod_revision)
            else:
                steps.append(step)
        if len(steps) <= self.retention:
            return steps
        real = []
        for i in range(0, len(steps), 64):
            batch = steps[i : i + 64]
            resp = c.txn_raw(
                "check commit index",
                [],
                [c.count_op(c.key("versions", pad20(s), "commit"), prefix=False) for s in batch],
            )
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
            tail = key[len(vpre) :].split("/")
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
            mid = meta.key.decode("utf-8", "replace")[len(pre) :]
            if "/" not in mid and mid not in named and meta.create_revision < oldest:
                key = pre + mid
                c.txn("drop manifest", [], [tx.Delete(key), tx.Delete(key + "/", range_end(key + "/"))])

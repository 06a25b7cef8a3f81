"""Consumers: each consumer's record of which pieces it wants publishers to pre-pack.

A consumer record hangs on the consumer's reader lease, so the set of records is also the set of
live consumers (used to know whom a streaming publisher must wait for). Publishers watch the
records and re-read them only after a change, so a steady put reads none of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from astate_store.catalog.records import Skips
from astate_store.errors import CodecError
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.model import codec
from astate_store.model.layout import Box

__all__ = ["Consumers"]

log = logging.getLogger("astate_store.catalog")

PackRequest = tuple[str, str, Box, "str | None"]  # (consumer, tensor, box, dtype or None)


class Consumers:
    """The ``consumers/<reader_id>`` records of one namespace."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self.prefix = client.key("consumers") + "/"
        self.skips = Skips(client.namespace, "bad consumer")  # bad consumer records skipped
        self._dirty = True
        self._watch: Any = None
        self._lock = threading.Lock()
        self._mine: dict[str, tuple[int, bytes]] = {}  # reader id -> (lease, record) this process wrote
        self._checked: dict[str, tuple[int, bool]] = {}  # key -> (mod revision, whether the record is good)

    @property
    def skipped_records(self) -> int:
        return self.skips.count

    def register(self, reader_id: str, packs: Sequence[tuple[int, str, Box, str | None]]) -> None:
        """Ask publishers for contiguous copies of (rank, tensor, box, dtype or None) pieces.
        The record hangs on the client's reader lease; the lease and the requests are remembered
        so that :meth:`ensure_registered` can write them again on a new lease."""
        wire = []
        for r, n, b, dt in packs:
            item: dict[str, Any] = {"rank": r, "name": n, "offsets": list(b.offsets), "sizes": list(b.sizes)}
            if dt is not None:
                item["dtype"] = dt
            wire.append(item)
        rec = codec.encode("consumer", {"reader_id": reader_id, "packs": wire})
        with self._lock:
            if self._mine.get(reader_id) == (self.client.reader_lease(), rec):
                return  # the record there says this already (a first pull re-asks for what it registered)
        self._put(reader_id, rec)

    def _put(self, reader_id: str, rec: bytes, lease: int | None = None) -> None:
        lease = self.client.reader_lease() if lease is None else lease
        key = self.prefix + reader_id
        self.client.call("register consumer", lambda: self.client.raw.put(key, rec, lease=lease))
        self.wrote(reader_id, lease, rec)

    def ensure_registered(self, reader_id: str) -> bool:
        """Register ``reader_id`` (no pre-pack requests) if it never was, and register it again,
        with the requests it last sent, when the reader lease it was registered on is gone (the
        client re-created it: the record vanished with the old one). True when it wrote the record.
        A steady call makes no etcd request."""
        todo = self.pending(reader_id)
        if todo is None:
            return False
        _key, rec, lease = todo
        self._put(reader_id, rec, lease)
        return True

    def pending(self, reader_id: str) -> tuple[str, bytes, int] | None:
        """(key, record, lease) that :meth:`ensure_registered` would write, for a caller that
        writes it in a transaction of its own (then :meth:`wrote`); None when registered."""
        lease = self.client.reader_lease()
        with self._lock:
            mine = self._mine.get(reader_id)
        if mine is not None and mine[0] == lease:
            return None
        if mine is None:
            return (
                self.prefix + reader_id,
                codec.encode("consumer", {"reader_id": reader_id, "packs": []}),
                lease,
            )
        log.info(
            "namespace %s: consumer %s registers again (its lease was re-created)",
            self.client.namespace,
            reader_id,
        )
        return self.prefix + reader_id, mine[1], lease

    def wrote(self, reader_id: str, lease: int, rec: bytes) -> None:
        """The record of ``reader_id`` was written on ``lease``."""
        with self._lock:
            self._mine[reader_id] = (lease, rec)

    def _on_event(self, resp: Any) -> None:
        with self._lock:
            self._dirty = True
            if isinstance(resp, Exception):
                self._watch = None  # the stream ended: re-watch (and re-read) on the next call

    def changed(self) -> bool:
        """Whether the records may have changed since the last :meth:`pack_requests` (always True
        before the first read, and while no watch is established)."""
        with self._lock:
            return self._dirty or self._watch is None

    def pack_requests(self, rank: int) -> tuple[PackRequest, ...]:
        """(consumer, tensor, box, dtype) pieces live consumers want this publisher rank to pre-pack,
        sorted so that every call over the same requests gives the same layout id. A record that
        fails its schema, or whose id differs from its key, is skipped and counted."""
        c = self.client
        with self._lock:
            self._dirty = False
        kvs, rev = c.get_prefix_rev(self.prefix)
        if self._watch is None:
            wid = c.call(
                "watch consumers",
                lambda: c.raw.add_watch_callback(
                    self.prefix, self._on_event, range_end=range_end(self.prefix), start_revision=rev + 1
                ),
            )
            with self._lock:
                self._watch = wid
        out = []
        for v, meta in kvs:
            key = meta.key.decode("utf-8", "replace")
            try:
                d = codec.decode("consumer", v)
                if d["reader_id"] != key[len(self.prefix) :]:
                    raise CodecError(f"reader_id {d['reader_id']!r} differs from its key")
                out += [
                    (d["reader_id"], p["name"], Box(tuple(p["offsets"]), tuple(p["sizes"])), p.get("dtype"))
                    for p in d["packs"]
                    if p["rank"] == rank
                ]
            except (CodecError, ValueError) as exc:
                self.skips(key, str(exc), meta.mod_revision)
        return tuple(sorted(out, key=lambda x: (x[0], x[1], x[2].offsets, x[2].sizes)))

    def _good(self, key: str, value: bytes, mod_revision: int) -> bool:
        """Whether a consumer record decodes and names its own key (skipped and counted if not)."""
        try:
            d = codec.decode("consumer", value)
        except CodecError as exc:
            self.skips(key, str(exc), mod_revision)
            return False
        if d["reader_id"] != key[len(self.prefix) :]:
            self.skips(key, f"reader_id {d['reader_id']!r} differs from its key", mod_revision)
            return False
        return True

    def ids(self) -> set[str]:
        """Live consumers (each registers on its first pull). A key whose record is not a
        consumer record of that id is no consumer (skipped, counted); records are read once per
        revision, so a steady call lists keys only."""
        c = self.client
        kvs = c.call("list consumers", lambda: list(c.raw.get_prefix(self.prefix, keys_only=True)))
        out: set[str] = set()
        checked: dict[str, tuple[int, bool]] = {}
        for _v, m in kvs:
            key = m.key.decode("utf-8", "replace")
            known = self._checked.get(key)
            if known is None or known[0] != m.mod_revision:
                value, meta = c.call("get consumer", lambda: c.raw.get(key))
                if value is None or meta is None:
                    continue  # gone in between (its lease ended)
                known = (meta.mod_revision, self._good(key, value, meta.mod_revision))
            elif not known[1]:
                self.skips(key, "(still) not a consumer record", known[0])
            checked[key] = known
            if known[1]:
                out.add(key[len(self.prefix) :])
        self._checked = checked
        return out

    def close(self) -> None:
        with self._lock:
            w, self._watch = self._watch, None
        if w is not None:
            try:
                self.client.raw.cancel_watch(w)
            except Exception:  # closing: the stream may already be gone
                pass

"""Consumers: each consumer's record of which pieces it wants publishers to pre-pack.

A consumer record hangs on the consumer's reader lease, so the set of records is also the set of
live consumers (used to know whom a streaming publisher must wait for). Publishers watch the
records and re-read them only after a change, so a steady put reads none of them.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

from .. import codec
from ..errors import CodecError
from ..layout import Box
from .client import EtcdClient, range_end

__all__ = ["Consumers"]

log = logging.getLogger("astate_store.catalog")

PackRequest = tuple[str, str, Box, "str | None"]  # (consumer, tensor, box, dtype or None)


class Consumers:
    """The ``consumers/<reader_id>`` records of one namespace."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self.prefix = client.key("consumers") + "/"
        self.skipped_records = 0
        self._dirty = True
        self._watch: Any = None
        self._lock = threading.Lock()

    def register(self, reader_id: str, packs: Sequence[tuple[int, str, Box, str | None]]) -> None:
        """Ask publishers for contiguous copies of (rank, tensor, box, dtype or None) pieces."""
        wire = []
        for r, n, b, dt in packs:
            item: dict[str, Any] = {"rank": r, "name": n, "offsets": list(b.offsets), "sizes": list(b.sizes)}
            if dt is not None:
                item["dtype"] = dt
            wire.append(item)
        rec = codec.encode("consumer", {"reader_id": reader_id, "packs": wire})
        lease = self.client.reader_lease()
        key = self.prefix + reader_id
        self.client.call("register consumer", lambda: self.client.raw.put(key, rec, lease=lease))

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
            wid = c.call("watch consumers", lambda: c.raw.add_watch_callback(
                self.prefix, self._on_event, range_end=range_end(self.prefix), start_revision=rev + 1))
            with self._lock:
                self._watch = wid
        out = []
        for v, meta in kvs:
            key = meta.key.decode()
            try:
                d = codec.decode("consumer", v)
                if d["reader_id"] != key[len(self.prefix):]:
                    raise CodecError(f"reader_id {d['reader_id']!r} differs from its key")
                out += [(d["reader_id"], p["name"], Box(tuple(p["offsets"]), tuple(p["sizes"])), p.get("dtype"))
                        for p in d["packs"] if p["rank"] == rank]
            except (CodecError, ValueError) as exc:
                self.skipped_records += 1
                log.warning("namespace %s: skipping bad consumer record %s: %s", c.namespace, key, exc)
        return tuple(sorted(out, key=lambda x: (x[0], x[1], x[2].offsets, x[2].sizes)))

    def ids(self) -> set[str]:
        """Live consumers (each registers on its first pull)."""
        kvs = self.client.call("list consumers", lambda: list(self.client.raw.get_prefix(self.prefix,
                                                                                         keys_only=True)))
        return {m.key.decode()[len(self.prefix):] for _v, m in kvs}

    def close(self) -> None:
        with self._lock:
            w, self._watch = self._watch, None
        if w is not None:
            try:
                self.client.raw.cancel_watch(w)
            except Exception:  # closing: the stream may already be gone
                pass

"""Consumers: each consumer's record of which pieces it wants publishers to pre-pack for it.

A consumer record hangs on the consumer's reader lease, so the set of records is also the set of
live consumers (used to know whom a zero-copy publisher must wait for).
"""

from __future__ import annotations

from typing import Any, Sequence

from .. import codec
from ..layout import Box
from .client import EtcdClient

__all__ = ["Consumers"]



class Consumers:
    """The ``consumers/<reader_id>`` records of one namespace."""

    def __init__(self, client: EtcdClient):
        self.client = client

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
        key = self.client.key("consumers", reader_id)
        self.client.call("register consumer", lambda: self.client.raw.put(key, rec, lease=lease))

    def pack_requests(self, rank: int) -> tuple[tuple[str, str, Box, str | None], ...]:
        """(consumer, tensor, box, dtype) pieces live consumers want this publisher rank to pre-pack,
        sorted so that every call over the same requests gives the same layout id."""
        pre = self.client.key("consumers") + "/"
        kvs = self.client.call("get consumers", lambda: list(self.client.raw.get_prefix(pre)))
        out = []
        for v, _ in kvs:
            d = codec.decode("consumer", v)
            out += [(d["reader_id"], p["name"], Box(tuple(p["offsets"]), tuple(p["sizes"])), p.get("dtype"))
                    for p in d["packs"] if p["rank"] == rank]
        return tuple(sorted(out, key=lambda x: (x[0], x[1], x[2].offsets, x[2].sizes)))

    def ids(self) -> set[str]:
        """Live consumers (each registers on its first pull)."""
        pre = self.client.key("consumers") + "/"
        kvs = self.client.call("list consumers", lambda: list(self.client.raw.get_prefix(pre, keys_only=True)))
        return {m.key.decode()[len(pre):] for _v, m in kvs}

"""Replicas: consumers re-serving a version they hold from their own buffers (P2P fan-out).

A replica is an extra source of a committed step: its layout and its replica record both hang on
the consumer's reader lease, so a dead re-server vanishes from every later plan by itself.
"""

from __future__ import annotations

from typing import Sequence

from pyetcd import transactions as tx

from .. import codec
from ..errors import VersionNotFound
from ..layout import ShardRecord
from .client import EtcdClient
from .readers import Readers
from .records import layout_id_of, pad20, shard_to_wire

__all__ = ["Replicas"]


class Replicas:
    """Offering and withdrawing this consumer's buffers as a source of a step."""

    def __init__(self, client: EtcdClient, readers: Readers):
        self.client, self.readers = client, readers

    def add(self, step: int, group: str, member: str, shards: Sequence[ShardRecord], transport: bytes) -> str:
        """Offer this consumer's buffers, which hold ``step``, as an extra source of that step;
        returns the replica's layout id.

        Raises:
            VersionNotFound: the step is no longer committed.
        """
        c = self.client
        # Epoch and rank 0: a replica's layout is addressed by its content alone, not by a session.
        lid = layout_id_of(0, 0, shards, transport)
        lease = c.reader_lease()
        value = codec.encode("layout", {"layout_id": lid, "epoch": 0, "rank": 0,
                                        "shards": [shard_to_wire(x) for x in shards], "transport": transport})
        rec = codec.encode("replica", {"step": step, "group": group, "member": member, "layout_id": lid})
        vkey = c.key("versions", pad20(step))
        ok, _ = c.txn("add replica", [tx.Version(vkey + "/commit") > 0], [
            tx.Put(c.key("layouts", "replicas", member, lid), value, lease=lease),
            tx.Put(vkey + "/replicas/" + group + "/" + member, rec, lease=lease),
        ])
        if not ok:
            raise VersionNotFound(f"namespace {c.namespace!r}: step {step} is not committed; cannot re-serve it")
        return lid

    def remove(self, step: int, group: str, member: str, layout_id: str, *, timeout: float) -> int:
        """Stop offering a replica before its memory changes: no new reader plans with it, and
        readers registered on the step are waited for (bounded; past that they are marked torn).
        Returns how many readers were still registered."""
        c = self.client
        replica_key = c.key("versions", pad20(step), "replicas", group, member)
        c.call("remove replica", lambda: c.raw.delete(replica_key))
        left = self.readers.wait_readers(step, timeout, torn_as="r-" + member)
        # The layout goes last: readers still planning with it must find it until they are done.
        layout_key = c.key("layouts", "replicas", member, layout_id)
        c.call("drop replica layout", lambda: c.raw.delete(layout_key))
        return left

"""Replicas: consumers re-serving a version they hold from their own buffers (P2P fan-out).

A replica is an extra source of a committed step: its layout and its replica record both hang on
the consumer's reader lease, so a dead re-server vanishes from every later plan by itself.

Replica servers (``astate serve``, ``replica_server.py``) offer their copies in a group named
``server-<server id>`` (:func:`server_group`), so a publisher can wait for K *servers* — not any
re-serving consumer — to hold a step (:meth:`Replicas.wait_servers`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pyetcd import transactions as tx

from astate_store.catalog.blobs import blob_requests
from astate_store.catalog.readers import Readers, replica_source
from astate_store.catalog.records import pad20
from astate_store.catalog.shard_tables import layout_record, manifest_record
from astate_store.errors import CodecError, ReplicationTimeout, VersionNotFound
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.model import codec
from astate_store.model.layout import ShardRecord

__all__ = ["Replicas", "SERVER_GROUP", "server_group"]

SERVER_GROUP = "server-"  # the group name prefix of replica servers' offers


def server_group(server_id: str) -> str:
    """The replica group a replica server offers its copies in (one server holds whole tensors)."""
    return SERVER_GROUP + server_id


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
        man = manifest_record(shards)
        lay = layout_record(0, 0, man, shards, transport)
        lid, mid = lay["layout_id"], man["manifest_id"]
        lease = c.reader_lease()
        heads = []
        for key, kind, rec_ in (
            (c.key("layouts", "replicas", member, mid), "manifest", man),
            (c.key("layouts", "replicas", member, lid), "layout", lay),
        ):
            chunks, head = blob_requests(key, codec.encode(kind, rec_), lease)
            for ops in chunks:
                c.txn("replica chunk", [], ops)
            heads.append(head)
        rec = codec.encode(
            "replica", {"step": step, "group": group, "member": member, "layout_id": lid, "manifest_id": mid}
        )
        vkey = c.key("versions", pad20(step))
        ok, _ = c.txn(
            "add replica",
            [tx.Version(vkey + "/commit") > 0],
            [*heads, tx.Put(vkey + "/replicas/" + group + "/" + member, rec, lease=lease)],
        )
        if not ok:
            raise VersionNotFound(
                f"namespace {c.namespace!r}: step {step} is not committed; cannot re-serve it"
            )
        return lid

    def servers_holding(self, step: int) -> tuple[set[str], int]:
        """(replica server groups that offer ``step``, the revision read): one range read.
        Records that fail their schema or do not match their key are not counted."""
        c = self.client
        pre = c.key("versions", pad20(step), "replicas") + "/"
        kvs, rev = c.get_prefix_rev(pre)
        held: set[str] = set()
        for value, meta in kvs:
            tail = meta.key.decode("utf-8", "replace")[len(pre) :].split("/")
            if len(tail) != 2 or not tail[0].startswith(SERVER_GROUP):
                continue
            try:
                rec = codec.decode("replica", value)
            except CodecError:
                continue  # a bad record holds nothing (readers skip and count it)
            if (rec["step"], rec["group"], rec["member"]) == (step, tail[0], tail[1]):
                held.add(tail[0])
        return held, rev

    def wait_servers(self, step: int, count: int, *, timeout: float) -> int:
        """Wait until ``count`` replica servers offer committed ``step``; returns how many do.
        Watch-based: one read, then a watch on the step's replica records until enough appear.

        Raises:
            ReplicationTimeout: fewer than ``count`` within ``timeout`` seconds.
        """
        c = self.client
        pre = c.key("versions", pad20(step), "replicas") + "/"
        deadline = time.monotonic() + timeout
        while True:
            held, rev = self.servers_holding(step)
            if len(held) >= count:
                return len(held)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplicationTimeout(
                    f"namespace {c.namespace!r}: step {step} is committed, but {len(held)} of the "
                    f"{count} replica servers asked for (replicas={count}) held it within {timeout:g}s; "
                    "start more `astate serve --etcd ...` processes (with room for this namespace: "
                    "--memory-bytes, "
                    "--namespace-prefix), or lower replicas / raise replica_timeout",
                    step=step,
                    held=len(held),
                )
            c.wait_change(pre, remaining, prefix=True, start_revision=rev + 1)

    def remove(self, step: int, group: str, member: str, layout_id: str, *, timeout: float) -> int:
        """Stop offering a replica before its memory changes: no new reader plans with it, and
        readers registered on the step are waited for (bounded; past that they are marked torn).
        Returns how many readers were still registered."""
        c = self.client
        replica_key = c.key("versions", pad20(step), "replicas", group, member)
        c.call("remove replica", lambda: c.raw.delete(replica_key))
        left = self.readers.wait_readers(step, timeout, torn_as=replica_source(member))
        # The layout goes last: readers still planning with it must find it until they are done.
        # (Its manifest stays until the lease ends: the next offer of the same buffers reuses it.)
        layout_key = c.key("layouts", "replicas", member, layout_id)
        c.txn(
            "drop replica layout",
            [],
            [tx.Delete(layout_key), tx.Delete(layout_key + "/", range_end(layout_key + "/"))],
        )
        return left

"""The checkpoint index: which complete checkpoints exist (``checkpoints/<step>``) and where.

Only the index lives here; writing and restoring checkpoints is :mod:`astate_store.checkpoint`.
"""

from __future__ import annotations

from astate_store.model import codec
from astate_store.catalog.client import EtcdClient
from astate_store.catalog.records import CheckpointEntry, Skips, numbered_records, pad20

__all__ = ["CheckpointIndex"]


class CheckpointIndex:
    """The ``checkpoints/`` records of one namespace (not on any lease: they outlive the writers)."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self.skips = Skips(client.namespace, "bad checkpoint index")  # bad index records skipped

    def record(self, entry: CheckpointEntry) -> None:
        """Add (or replace) the entry of ``entry.step``."""
        value = codec.encode("checkpoint", {"step": entry.step, "uri": entry.uri, "world_size": entry.world_size,
                                            "bytes": entry.bytes, "written_at": entry.written_at})
        key = self.client.key("checkpoints", pad20(entry.step))
        self.client.call("record checkpoint", lambda: self.client.raw.put(key, value))

    def list(self) -> list[CheckpointEntry]:
        """Known complete checkpoints, oldest first. A record that does not decode, or whose step
        is not its key's, is skipped (counted, logged once): the others are still listed."""
        pre = self.client.key("checkpoints") + "/"
        kvs = self.client.call("list checkpoints", lambda: list(self.client.raw.get_prefix(pre)))
        out = []
        for key, step, d, rev in numbered_records(kvs, pre, "checkpoint", self.skips, "checkpoint"):
            if d["step"] != step:
                self.skips(key, f"checkpoint record of step {d['step']} under this key", rev)
                continue
            out.append(CheckpointEntry(d["step"], d["uri"], d["world_size"], d["bytes"], d["written_at"]))
        return sorted(out, key=lambda e: e.step)

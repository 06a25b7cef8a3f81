"""The checkpoint index: which complete checkpoints exist (``checkpoints/<step>``) and where.

Only the index lives here; writing and restoring checkpoints is :mod:`astate_store.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pyetcd import transactions as tx

from astate_store.catalog.records import CheckpointEntry, Skips, numbered_records, pad20, parse_pad20
from astate_store.errors import CodecError
from astate_store.etcd.client import EtcdClient
from astate_store.model import codec

__all__ = ["CheckpointIndex", "pieces_present", "commit_epoch"]


class CheckpointIndex:
    """The ``checkpoints/`` records of one namespace (not on any lease: they outlive the writers)."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self.skips = Skips(client.namespace, "bad checkpoint index")  # bad index records skipped

    def record(self, entry: CheckpointEntry) -> None:
        """Add (or replace) the entry of ``entry.step``."""
        value = codec.encode(
            "checkpoint",
            {
                "step": entry.step,
                "uri": entry.uri,
                "world_size": entry.world_size,
                "bytes": entry.bytes,
                "written_at": entry.written_at,
            },
        )
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

    def forget(self, steps: Iterable[int], same_uri: Callable[[str], bool]) -> list[int]:
        """Delete the entries of ``steps`` whose uri ``same_uri`` accepts (checkpoints removed from
        storage); an entry replaced meanwhile (another uri, a newer write) stays, and one that does
        not decode is left alone. Returns the steps whose entry was deleted."""
        gone = []
        for step in steps:
            key = self.client.key("checkpoints", pad20(step))
            raw, meta = self.client.call("get checkpoint", lambda k=key: self.client.raw.get(k))
            if raw is None:
                continue
            try:
                d = codec.decode("checkpoint", raw)
            except CodecError as exc:
                self.skips(key, str(exc), meta.mod_revision)
                continue
            if d["step"] != step or not same_uri(d["uri"]):
                continue
            ok, _ = self.client.txn(
                f"forget checkpoint {step}", [tx.Mod(key) == meta.mod_revision], [tx.Delete(key)]
            )
            if ok:
                gone.append(step)
        return gone


def pieces_present(client: EtcdClient, step: int, epoch: int) -> set[int]:
    """The ranks of session ``epoch`` whose piece of ``step`` is in the catalog (keys only, one
    range read; for saying whose pieces a step that does not commit is missing)."""
    pre = client.key("versions", pad20(step), "pieces", pad20(epoch)) + "/"
    kvs = client.call("list pieces", lambda: list(client.raw.get_prefix(pre, keys_only=True)))
    out = set()
    for _v, m in kvs:
        r = parse_pad20(m.key.decode("utf-8", "replace")[len(pre) :])
        if r is not None:
            out.add(r)
    return out


def commit_epoch(client: EtcdClient, step: int) -> int | None:
    """The session epoch that committed ``step`` (None: not committed, or its record is bad —
    the caller then knows nothing more than before)."""
    key = client.key("versions", pad20(step), "commit")
    raw, _m = client.call("get commit", lambda: client.raw.get(key))
    if raw is None:
        return None
    try:
        return int(codec.decode("commit", raw)["epoch"])
    except CodecError:
        return None

"""Publisher sessions: starting or joining one, the epoch fence, and which ranks are alive.

Rank 0 of a publisher group starts a session by incrementing the ``epoch`` counter; every write
a publisher makes later carries :meth:`Sessions.fence`, so a session whose epoch was overtaken
(or whose rank lease expired) can no longer change anything.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

from pyetcd import transactions as tx

from astate_store.catalog.records import Session, Skips, numbered_records, pad20
from astate_store.errors import CatalogCorrupted, CatalogError, CodecError, StaleSessionError, WaitTimeout
from astate_store.etcd.client import EtcdClient
from astate_store.model import codec

__all__ = ["Sessions", "read_counter"]

log = logging.getLogger("astate_store.catalog")


def read_counter(client: EtcdClient, name: str) -> tuple[int | None, int]:
    """A counter (``epoch``, ``latest``): its value (None when absent or empty) and mod revision.

    Raises:
        CatalogCorrupted: the key holds something that is not a counter.
    """
    try:
        return client.get_counter(name)
    except CodecError as exc:
        key = client.key(name)
        raise CatalogCorrupted(
            f"namespace {client.namespace!r}: the counter {key} is corrupted: {exc}", key=key
        ) from None


def _counter_of(client: EtcdClient, kvs: list[Any]) -> int | None:
    """The ``epoch`` counter from a transaction's range response (as :func:`read_counter`)."""
    try:
        return codec.decode_counter(kvs[0][0]) if kvs else None
    except CodecError as exc:
        key = client.key("epoch")
        raise CatalogCorrupted(
            f"namespace {client.namespace!r}: the counter {key} is corrupted: {exc}", key=key
        ) from None


class Sessions:
    """This process's publisher session (at most one) in the namespace of ``client``."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self._current: Session | None = None
        self.skips = Skips(client.namespace, "bad member")  # bad member records skipped

    @property
    def current(self) -> Session | None:
        """The open session, or None before :meth:`open` (and after :meth:`clear`)."""
        return self._current

    def open(
        self, *, rank: int, world_size: int, session_id: str | None = None, join_timeout: float = 60.0
    ) -> Session:
        """Start (rank 0) or join (rank > 0) the publisher session of this namespace.

        Rank 0 increments the epoch, which fences every older session: their writes are
        rejected from then on. Ranks > 0 join the session whose id matches ``session_id``
        (any live session with the same world size when None).

        Raises:
            CatalogError: bad rank/world_size; WaitTimeout: no session to join in time.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise CatalogError(f"rank {rank} is not in [0, world_size={world_size})")
        lease = self.client.new_lease()
        if rank == 0:
            self._current = self._start(world_size, session_id or uuid.uuid4().hex, lease)
        else:
            self._current = self._join(rank, world_size, session_id, join_timeout, lease)
        return self._current

    def _start(self, world_size: int, sid: str, lease: int) -> Session:
        c = self.client
        host, pid = socket.gethostname(), os.getpid()
        # First as if the namespace were new (no epoch yet): one round trip for a fresh one; a
        # failed compare reads the epoch back in the same transaction for the next try.
        old: int | None = None
        while True:
            new = (old or 0) + 1
            # Compare-and-set on the epoch: of two rank-0s starting at once, one retries with the next epoch.
            cmp = (
                (tx.Version(c.key("epoch")) == 0)
                if old is None
                else (tx.Value(c.key("epoch")) == codec.encode_counter(old))
            )
            ok, resp = c.txn(
                "open session",
                [cmp],
                [
                    tx.Put(c.key("epoch"), codec.encode_counter(new)),
                    tx.Put(
                        c.key("session"),
                        codec.encode(
                            "session",
                            {
                                "epoch": new,
                                "session_id": sid,
                                "world_size": world_size,
                                "host": host,
                                "pid": pid,
                                "started": time.time(),
                            },
                        ),
                        lease=lease,
                    ),
                    tx.Put(
                        c.key("members", pad20(new), pad20(0)),
                        codec.encode("member", {"epoch": new, "rank": 0, "host": host, "pid": pid}),
                        lease=lease,
                    ),
                    # An empty 'latest' lets the commit transaction compare values from the first step on.
                    tx.Txn([tx.Version(c.key("latest")) == 0], [tx.Put(c.key("latest"), b"")], []),
                ],
                [tx.Get(c.key("epoch"))],
            )
            if ok:
                log.info(
                    "namespace %s: session %s opened with epoch %d (world size %d)",
                    c.namespace,
                    sid,
                    new,
                    world_size,
                )
                return Session(new, sid, 0, world_size, lease)
            old = _counter_of(c, resp[0])

    def _join(
        self, rank: int, world_size: int, session_id: str | None, join_timeout: float, lease: int
    ) -> Session:
        c = self.client
        host, pid = socket.gethostname(), os.getpid()
        deadline = time.monotonic() + join_timeout
        while True:
            rec = self.record()
            if (
                rec is not None
                and rec["world_size"] == world_size
                and (session_id is None or rec["session_id"] == session_id)
            ):
                epoch = rec["epoch"]
                # Only join if that session is still the newest: joining a fenced one would be useless.
                ok, _ = c.txn(
                    "join session",
                    [tx.Value(c.key("epoch")) == codec.encode_counter(epoch)],
                    [
                        tx.Put(
                            c.key("members", pad20(epoch), pad20(rank)),
                            codec.encode("member", {"epoch": epoch, "rank": rank, "host": host, "pid": pid}),
                            lease=lease,
                        )
                    ],
                )
                if ok:
                    log.info(
                        "namespace %s: rank %d joined session %s (epoch %d)",
                        c.namespace,
                        rank,
                        rec["session_id"],
                        epoch,
                    )
                    return Session(epoch, rec["session_id"], rank, world_size, lease)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(
                    f"namespace {c.namespace!r}: rank {rank} found no session "
                    f"{session_id or '(any)'} of world size {world_size} to join within {join_timeout}s"
                )
            c.wait_change(c.key("session"), min(remaining, 1.0))

    def require(self) -> Session:
        """The open session.

        Raises:
            CatalogError: no session was opened.
        """
        if self._current is None:
            raise CatalogError("no publisher session: call sessions.open first")
        return self._current

    def record(self) -> dict[str, Any] | None:
        """The namespace's session record (the newest session, while its rank 0 lives), or None.

        Raises:
            CatalogCorrupted: the record does not decode (ranks would join on a guess).
        """
        key = self.client.key("session")
        value, _ = self.client.call("get session", lambda: self.client.raw.get(key))
        if value is None:
            return None
        try:
            return codec.decode("session", value)
        except CodecError as exc:
            raise CatalogCorrupted(
                f"namespace {self.client.namespace!r}: the session record {key} is corrupted: {exc}", key=key
            ) from None

    def live_ranks(self, epoch: int) -> set[int]:
        """Ranks of session ``epoch`` whose lease is alive. A member record that does not decode,
        or whose epoch or rank is not its key's, is skipped (counted, logged once)."""
        pre = self.client.key("members", pad20(epoch)) + "/"
        kvs = self.client.call("get members", lambda: list(self.client.raw.get_prefix(pre)))
        out = set()
        for key, rank, d, rev in numbered_records(kvs, pre, "member", self.skips, "member"):
            if (d["epoch"], d["rank"]) != (epoch, rank):
                self.skips(key, f"member record of epoch {d['epoch']} rank {d['rank']} under this key", rev)
                continue
            out.add(rank)
        return out

    def epoch(self) -> int | None:
        """The newest session's epoch (the fencing token), or None before the first session.

        Raises:
            CatalogCorrupted: the ``epoch`` key holds something that is not a counter.
        """
        return read_counter(self.client, "epoch")[0]

    def fence(self) -> list[Any]:
        """Transaction compares that hold only while this session is the newest and this rank alive."""
        s = self.require()
        return [
            tx.Value(self.client.key("epoch")) == codec.encode_counter(s.epoch),
            tx.Version(self.client.key("members", pad20(s.epoch), pad20(s.rank))) > 0,
        ]

    def fenced_error(self, what: str) -> StaleSessionError:
        """The error for a write whose :meth:`fence` failed, saying which of the two compares did."""
        s = self.require()
        now = self.epoch()
        log.warning(
            "namespace %s: rank %d of session epoch %d is fenced (%s rejected; epoch now %s)",
            self.client.namespace,
            s.rank,
            s.epoch,
            what,
            now,
        )
        if now != s.epoch:
            return StaleSessionError(
                f"namespace {self.client.namespace!r}: {what} rejected: session epoch {s.epoch} was "
                f"fenced by a newer session (epoch {now})"
            )
        return StaleSessionError(
            f"namespace {self.client.namespace!r}: {what} rejected: rank {s.rank}'s lease of session epoch "
            f"{s.epoch} expired (the rank was considered dead)"
        )

    def clear(self) -> None:
        """Forget the session (its lease is the client's to revoke)."""
        self._current = None

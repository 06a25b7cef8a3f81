"""Readers: consumers registering on a step while they read it, and publishers waiting for them.

The protocol that keeps reads untorn: a consumer registers (``readers/<step>/<id>``) in the same
transaction that reads the commit; a publisher about to change the memory of a step marks it
retired (no new readers), waits for the registered ones, and marks the step torn if it gives up.
A reader's ``end_read`` tells it whether its bytes are all of the step.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from pyetcd import transactions as tx

from astate_store.catalog.consumers import Consumers
from astate_store.catalog.read_ends import ReadEnds
from astate_store.catalog.records import Skips, Version, pad20, parse_pad20, version_from_kvs
from astate_store.catalog.sessions import Sessions
from astate_store.errors import CodecError, VersionNotFound
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.model import codec

__all__ = ["Readers", "replica_source"]

log = logging.getLogger("astate_store.catalog")

# Up to this many publisher ranks (replica members) end_read compares each source's torn key; past
# it, one range compare covers every rank (every replica): O(1) operations, conservative (a marker
# of a source not read from then fails the read too). etcd allows 128 compares per transaction.
_RANK_COMPARES = 16
_REPLICA_COMPARES = 64


def replica_source(member: str) -> str:
    """The torn-marker name of a re-serving consumer (``torn/<step>/r-<member>``)."""
    return "r-" + member


class Readers:
    """Reader registration and the publisher's wait for readers, in one namespace.

    ``consumers`` is where :meth:`wait_delivered` learns which consumers are still alive (the
    catalog passes its own; by default one over the same client).
    """

    def __init__(self, client: EtcdClient, sessions: Sessions, *, consumers: Consumers | None = None):
        self.client, self.sessions = client, sessions
        self.consumers = consumers if consumers is not None else Consumers(client)
        self.skips = Skips(
            client.namespace, "bad version or reader"
        )  # bad version and reader records skipped
        # (step, reader id) -> the revision that registered the reader: end_read succeeds only if
        # its record is still that one (a record overwritten by anyone else fails the read).
        self._open: dict[tuple[int, str], int] = {}
        # member key -> (mod revision, (epoch, rank) or None when the record is bad): decoded once
        self._members: dict[str, tuple[int, tuple[int, int] | None]] = {}
        self._ends = ReadEnds(self.end_read)

    def begin_read(self, step: int, reader_id: str) -> Version:
        """Register as a reader of ``step`` and read its commit and pieces, in one transaction.

        Raises:
            VersionNotFound: the version is not committed, was retired, or was dropped by retention.
            CatalogCorrupted: its commit record, or a piece of the committing session, is bad.
        """
        self._ends.wait(step, reader_id)  # a queued end of this very read deletes its record by key
        c = self.client
        vkey = c.key("versions", pad20(step))
        retired = c.key("retired", pad20(step)) + "/"
        reader = codec.encode(
            "reader", {"step": step, "reader_id": reader_id, "host": socket.gethostname(), "pid": os.getpid()}
        )
        members = c.key("members") + "/"
        # A consumer not registered yet (a one-shot read) registers in the same transaction.
        reg = self.consumers.pending(reader_id)
        resp = c.txn_raw(
            f"begin read {step}",
            [tx.Version(vkey + "/commit") > 0, tx.Version(retired, range_end(retired)) == 0],
            [
                tx.Get(vkey + "/", range_end(vkey + "/")),
                # Which publisher ranks are alive, at the same revision: their member records hang on
                # the leases their layouts hang on. One range of one small record per live rank.
                tx.Get(members, range_end(members)),
                tx.Put(c.key("readers", pad20(step), reader_id), reader, lease=c.reader_lease()),
                *([] if reg is None else [tx.Put(reg[0], reg[1], lease=reg[2])]),
            ],
        )
        if not resp.succeeded:
            raise VersionNotFound(f"namespace {c.namespace!r}: step {step} is not committed or was retired")
        if reg is not None:
            self.consumers.wrote(reader_id, reg[2], reg[1])
        self._open[(step, reader_id)] = int(resp.header.revision)
        try:
            kvs = [(kv.value, kv) for kv in resp.responses[0].response_range.kvs]
            version = version_from_kvs(c.namespace, step, kvs, self.skips)
            live = self._live_members(members, resp.responses[1].response_range.kvs)
            gone = frozenset(r for r, p in version.pieces.items() if (p.epoch, p.rank) not in live)
            return replace(version, missing=gone) if gone else version
        except BaseException:
            # Registered but unusable: do not leave a publisher waiting for this reader.
            self.end_read(step, reader_id)
            raise

    def _live_members(self, pre: str, kvs: Iterable[Any]) -> set[tuple[int, int]]:
        """(epoch, rank) of every member record under ``pre`` that is what its key says; a bad one
        is skipped (counted, logged once) and its rank counts as gone. Each record is decoded once
        per revision, so a steady read decodes nothing."""
        live: set[tuple[int, int]] = set()
        checked: dict[str, tuple[int, tuple[int, int] | None]] = {}
        for kv in kvs:
            key = kv.key.decode("utf-8", "replace")
            known = self._members.get(key)
            if known is None or known[0] != kv.mod_revision:
                known = (kv.mod_revision, self._member(pre, key, kv.value, kv.mod_revision))
            checked[key] = known
            if known[1] is not None:
                live.add(known[1])
        self._members = checked
        return live

    def _member(self, pre: str, key: str, value: bytes, rev: int) -> tuple[int, int] | None:
        parts = key[len(pre) :].split("/")
        epoch, rank = (parse_pad20(parts[0]), parse_pad20(parts[1])) if len(parts) == 2 else (None, None)
        if epoch is None or rank is None:
            self.skips(key, "not a member key (members/<epoch>/<rank>, 20 digits each)", rev)
            return None
        try:
            d = codec.decode("member", value)
        except CodecError as exc:
            self.skips(key, str(exc), rev)
            return None
        if (d["epoch"], d["rank"]) != (epoch, rank):
            self.skips(key, f"member record of epoch {d['epoch']} rank {d['rank']} under this key", rev)
            return None
        return epoch, rank

    def end_read(self, step: int, reader_id: str, sources: Iterable[int | str] | None = None) -> bool:
        """Unregister; True when none of ``sources`` changed the memory of ``step`` while this
        reader was registered (and the version was not dropped, and the reader's record is the
        one it wrote), i.e. the bytes read are all of ``step``.

        ``sources``: what the read used — publisher ranks (int; ``torn/<step>/<rank>``) and
        :func:`replica_source` names of re-serving consumers (str; ``torn/<step>/r-<member>``);
        a torn marker of any other source does not fail this read. None: every marker counts.
        """
        c = self.client
        vkey = c.key("versions", pad20(step))
        rkey = c.key("readers", pad20(step), reader_id)
        rev = self._open.pop((step, reader_id), None)
        ok, _ = c.txn(
            f"end read {step}",
            [
                tx.Version(vkey + "/commit") > 0,
                *self._torn_compares(step, sources),
                # A reader whose lease expired was not waited for: its bytes may be torn. A record
                # rewritten by someone else may not have been waited for either.
                (tx.Version(rkey) > 0) if rev is None else (tx.Mod(rkey) == rev),
            ],
            [
                tx.Delete(rkey),
                tx.Put(c.key("delivered", pad20(step), reader_id), b"", lease=c.reader_lease()),
            ],
            [tx.Delete(rkey)],
        )
        return bool(ok)

    def end_read_later(self, step: int, reader_id: str, sources: Iterable[int | str] | None = None) -> None:
        """:meth:`end_read` on a background thread, for a read already known untorn (its sources'
        step words, ``get/step_words.py``): the reader's record and the delivered marker follow
        within a round trip, the pull does not wait for them (``read_ends.py``)."""
        self._ends.submit(step, reader_id, None if sources is None else frozenset(sources))

    def flush_ends(self, timeout: float = 5.0) -> bool:
        """Wait until every read ended with :meth:`end_read_later` has ended; False on timeout."""
        return self._ends.flush(timeout)

    def close(self) -> None:
        """Run this namespace's queued ends (bounded); later ones run inline."""
        self._ends.close()

    def _torn_compares(self, step: int, sources: Iterable[int | str] | None) -> list[Any]:
        """Compares that hold while no torn marker of ``sources`` exists (see :meth:`end_read`)."""
        torn = self.client.key("torn", pad20(step)) + "/"
        if sources is None:
            return [tx.Version(torn, range_end(torn)) == 0]
        items = set(sources)
        ranks = sorted(s for s in items if isinstance(s, int))
        names = sorted(s for s in items if isinstance(s, str))
        out: list[Any] = []
        if len(ranks) > _RANK_COMPARES:
            # Every rank marker is 20 digits: [torn/<step>/0, torn/<step>/:) holds them all.
            out.append(tx.Version(torn + "0", (torn + ":").encode()) == 0)
        else:
            out += [tx.Version(torn + pad20(r)) == 0 for r in ranks]
        if len(names) > _REPLICA_COMPARES:
            pre = torn + replica_source("")
            out.append(tx.Version(pre, range_end(pre)) == 0)
        else:
            out += [tx.Version(torn + n) == 0 for n in names]
        return out

    def retire(self, step: int, *, timeout: float = 30.0) -> int:
        """Mark this rank's memory of ``step`` as about to change (no new readers), and wait
        (bounded) for the readers registered on it to finish. If some are still registered when
        the wait ends, mark the version torn: those readers will discard what they read.
        Returns how many readers were still registered.

        Raises:
            CatalogError: no publisher session is open.
        """
        s = self.sessions.require()
        c = self.client
        rec = codec.encode("retired", {"step": step, "epoch": s.epoch, "rank": s.rank})
        # One round trip in the common case: the marker and the count of readers still there.
        resp = c.txn_raw(
            f"retire {step}",
            [],
            [
                tx.Put(c.key("retired", pad20(step), pad20(s.rank)), rec),
                c.count_op(c.key("readers", pad20(step)) + "/"),
            ],
        )
        if int(resp.responses[1].response_range.count) == 0:
            return 0
        return self.wait_readers(step, timeout, torn_as=pad20(s.rank))

    def wait_readers(self, step: int, timeout: float, *, torn_as: str) -> int:
        """Wait (bounded) until no reader is registered on ``step``; past ``timeout``, write
        ``torn/<step>/<torn_as>`` so the readers still there discard their bytes. Returns how
        many readers were still registered (0 when all finished)."""
        c = self.client
        pre = c.key("readers", pad20(step)) + "/"
        deadline = time.monotonic() + timeout
        while True:
            kvs, rev = c.get_prefix_rev(pre)
            # A record that is not a reader of this step under its own id is no reader to wait
            # for (skipped): a real reader whose record was overwritten fails its own end_read.
            kvs = [kv for kv in kvs if self._is_reader(step, pre, kv)]
            if not kvs:
                return 0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.log(
                    logging.WARNING if timeout > 0 else logging.DEBUG,
                    "namespace %s: changing memory of step %d with %d readers still registered",
                    c.namespace,
                    step,
                    len(kvs),
                )
                s = self.sessions.current
                rec = codec.encode(
                    "retired", {"step": step, "epoch": s.epoch if s else 0, "rank": s.rank if s else 0}
                )
                key = c.key("torn", pad20(step), torn_as)
                c.call("mark torn", lambda: c.raw.put(key, rec))
                return len(kvs)
            c.wait_change(pre, remaining, prefix=True, start_revision=rev + 1)

    def mark_torn(self, step: int, torn_as: str) -> None:
        """Write ``torn/<step>/<torn_as>``: that source's memory of ``step`` is gone or changed, so
        any read of it that has not ended yet — or starts from a cached plan — is discarded."""
        c, s = self.client, self.sessions.current
        rec = codec.encode(
            "retired", {"step": step, "epoch": s.epoch if s else 0, "rank": s.rank if s else 0}
        )
        key = c.key("torn", pad20(step), torn_as)
        c.call("mark torn", lambda: c.raw.put(key, rec))

    def _is_reader(self, step: int, pre: str, kv: tuple[bytes, Any]) -> bool:
        value, meta = kv
        key = meta.key.decode("utf-8", "replace")
        try:
            d = codec.decode("reader", value)
        except CodecError as exc:
            self.skips(key, str(exc), meta.mod_revision)
            return False
        if (d["step"], d["reader_id"]) != (step, key[len(pre) :]):
            self.skips(
                key,
                f"reader record of step {d['step']} reader {d['reader_id']!r} under this key",
                meta.mod_revision,
            )
            return False
        return True

    def wait_delivered(self, step: int, consumers: set[str], timeout: float) -> set[str]:
        """Wait (bounded) until each of ``consumers`` finished a good read of ``step``; returns
        those that did not (dead consumers' ids vanish with their lease and are not waited for)."""
        c = self.client
        pre = c.key("delivered", pad20(step)) + "/"
        deadline = time.monotonic() + timeout
        while True:
            kvs, rev = c.get_prefix_rev(pre)
            done = {m.key.decode("utf-8", "replace").rsplit("/", 1)[1] for _v, m in kvs}
            missing = (consumers & self.consumers.ids()) - done
            remaining = deadline - time.monotonic()
            if not missing or remaining <= 0:
                return missing
            c.wait_change(pre, remaining, prefix=True, start_revision=rev + 1)

    def wait_drained(self, step: int, timeout: float, *, exclude: Iterable[str] = ()) -> set[str]:
        """Wait (bounded) until every live consumer of the namespace — each one with a consumer
        record, including those that have not started reading ``step`` yet — has finished a good
        read of ``step`` or has left (its record goes with its lease: a dead consumer holds the
        wait no longer than its lease). Returns the consumers that had done neither.

        Each round: one range read of the step's delivery records, the consumer list (keys only
        in a steady state), then one watch over both until something changes."""
        c = self.client
        pre = c.key("delivered", pad20(step)) + "/"
        cons = c.key("consumers") + "/"
        mine = set(exclude)
        deadline = time.monotonic() + timeout
        while True:
            kvs, rev = c.get_prefix_rev(pre)
            done = {m.key.decode("utf-8", "replace")[len(pre) :] for _v, m in kvs}
            waiting = self.consumers.ids() - done - mine
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                return waiting
            # ``consumers/`` sorts right before ``delivered/`` (no other family lies between): one
            # watch over [consumers/, the end of this step's deliveries) sees a consumer come or
            # go and a delivery of this step (deliveries of older steps only wake it once more).
            self._wait_range(cons, range_end(pre), remaining, rev + 1)

    def _wait_range(self, start: str, end: str, timeout: float, start_revision: int) -> None:
        """One watch event on keys in [start, end) after ``start_revision``, or at most
        ``min(timeout, 5)`` seconds (a lost watch stream is then made again by the caller)."""
        c = self.client
        event = threading.Event()
        wid = c.call(
            f"watch {start}",
            lambda: c.raw.add_watch_callback(
                start, lambda _resp: event.set(), range_end=end, start_revision=start_revision
            ),
        )
        try:
            event.wait(min(timeout, 5.0))
        finally:
            try:
                c.raw.cancel_watch(wid)
            except Exception:  # the stream may be gone already: nothing left to cancel
                pass

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
import time

from pyetcd import transactions as tx

from .. import codec
from ..errors import VersionNotFound
from .client import EtcdClient, range_end
from .consumers import Consumers
from .records import Version, pad20, version_from_kvs
from .sessions import Sessions

__all__ = ["Readers"]

log = logging.getLogger("astate_store.catalog")


class Readers:
    """Reader registration and the publisher's wait for readers, in one namespace.

    ``consumers`` is where :meth:`wait_delivered` learns which consumers are still alive (the
    catalog passes its own; by default one over the same client).
    """

    def __init__(self, client: EtcdClient, sessions: Sessions, *, consumers: Consumers | None = None):
        self.client, self.sessions = client, sessions
        self.consumers = consumers if consumers is not None else Consumers(client)

    def begin_read(self, step: int, reader_id: str) -> Version:
        """Register as a reader of ``step`` and read its commit and pieces, in one transaction.

        Raises:
            VersionNotFound: the version is not committed, was retired, or was dropped by retention.
        """
        c = self.client
        vkey = c.key("versions", pad20(step))
        retired = c.key("retired", pad20(step)) + "/"
        reader = codec.encode("reader", {"step": step, "reader_id": reader_id, "host": socket.gethostname(),
                                         "pid": os.getpid()})
        ok, resp = c.txn(f"begin read {step}", [
            tx.Version(vkey + "/commit") > 0,
            tx.Version(retired, range_end(retired)) == 0,
        ], [
            tx.Put(c.key("readers", pad20(step), reader_id), reader, lease=c.reader_lease()),
            tx.Get(vkey + "/", range_end(vkey + "/")),
        ])
        if not ok:
            raise VersionNotFound(f"namespace {c.namespace!r}: step {step} is not committed or was retired")
        try:
            return version_from_kvs(c.namespace, step, resp[1])
        except BaseException:
            # Registered but unusable: do not leave a publisher waiting for this reader.
            self.end_read(step, reader_id)
            raise

    def end_read(self, step: int, reader_id: str) -> bool:
        """Unregister; True when no publisher changed the memory of ``step`` while this reader
        was registered (and the version was not dropped), i.e. the bytes read are all of ``step``."""
        c = self.client
        vkey = c.key("versions", pad20(step))
        rkey = c.key("readers", pad20(step), reader_id)
        torn = c.key("torn", pad20(step)) + "/"
        ok, _ = c.txn(f"end read {step}", [
            tx.Version(vkey + "/commit") > 0,
            tx.Version(torn, range_end(torn)) == 0,
            # A reader whose lease expired was not waited for: its bytes may be torn.
            tx.Version(rkey) > 0,
        ], [tx.Delete(rkey), tx.Put(c.key("delivered", pad20(step), reader_id), b"", lease=c.reader_lease())],
            [tx.Delete(rkey)])
        return bool(ok)

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
        resp = c.txn_raw(f"retire {step}", [], [tx.Put(c.key("retired", pad20(step), pad20(s.rank)), rec),
                                                 c.count_op(c.key("readers", pad20(step)) + "/")])
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
            if not kvs:
                return 0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.log(logging.WARNING if timeout > 0 else logging.DEBUG,
                        "namespace %s: changing memory of step %d with %d readers still registered",
                        c.namespace, step, len(kvs))
                s = self.sessions.current
                rec = codec.encode("retired", {"step": step, "epoch": s.epoch if s else 0, "rank": s.rank if s else 0})
                key = c.key("torn", pad20(step), torn_as)
                c.call("mark torn", lambda: c.raw.put(key, rec))
                return len(kvs)
            c.wait_change(pre, remaining, prefix=True, start_revision=rev + 1)

    def wait_delivered(self, step: int, consumers: set[str], timeout: float) -> set[str]:
        """Wait (bounded) until each of ``consumers`` finished a good read of ``step``; returns
        those that did not (dead consumers' ids vanish with their lease and are not waited for)."""
        c = self.client
        pre = c.key("delivered", pad20(step)) + "/"
        deadline = time.monotonic() + timeout
        while True:
            kvs, rev = c.get_prefix_rev(pre)
            done = {m.key.decode().rsplit("/", 1)[1] for _v, m in kvs}
            missing = (consumers & self.consumers.ids()) - done
            remaining = deadline - time.monotonic()
            if not missing or remaining <= 0:
                return missing
            c.wait_change(pre, remaining, prefix=True, start_revision=rev + 1)

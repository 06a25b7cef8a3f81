"""The control plane in etcd: sessions, layouts, versions, commits, readers.

Key layout under ``/astate/<namespace>/`` (see README "etcd key layout"):

    epoch                               counter: the newest session's epoch (fencing token)
    session                             session record, on rank 0's lease
    members/<epoch>/<rank>              member record, on that rank's lease
    layouts/<epoch>/<rank>/<layout_id>  layout record (shards + transport), on the rank's lease
    versions/<step>/pieces/<epoch>/<rank>  piece record
    versions/<step>/commit              commit record
    versions/<step>/replicas/<group>/<member>  replica record (a consumer re-serving), on its lease
    layouts/replicas/<member>/<layout_id>      that consumer's layout record, on its lease
    latest                              counter: newest committed step (only moves forward)
    readers/<step>/<reader_id>          reader record, on the consumer's lease
    delivered/<step>/<reader_id>        reader record: that consumer finished a good read of the step
    consumers/<reader_id>               consumer record (pre-pack requests), on the consumer's lease
    retired/<step>/<rank>               retired record: no new readers; rank will reuse the memory
    torn/<step>/<rank>                  retired record: rank changed the memory with readers still on it
    checkpoints/<step>                  checkpoint record

Steps and epochs are 20-digit zero-padded in keys and in the two counters, so lexical
order is numeric order and etcd can compare counters inside transactions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import grpc
import pyetcd
import pyetcd.exceptions as etcd_exc
from pyetcd import transactions as tx
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from . import codec
from .errors import (
    CatalogError,
    CatalogUnavailable,
    StaleSessionError,
    VersionNotFound,
    WaitTimeout,
)
from .layout import Box, ShardRecord

__all__ = ["Catalog", "Session", "Piece", "Layout", "Replica", "Version", "CheckpointEntry", "shard_to_wire", "shard_from_wire"]

log = logging.getLogger("astate_store.catalog")
T = TypeVar("T")

_NS_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_RETRYABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.InternalServerError,
    etcd_exc.NoServerAvailableError,
    grpc.RpcError,
)
# etcd's default request limit is 1.5 MiB; stay well inside it when batching layout reads.
_MAX_BATCH_BYTES = 1 << 20


def _n(v: int) -> str:
    return "%020d" % v


def _range_end(prefix: bytes) -> bytes:
    return pyetcd.utils.prefix_range_end(prefix)


def shard_to_wire(s: ShardRecord) -> dict[str, Any]:
    return {
        "name": s.name, "dtype": s.dtype, "global_shape": list(s.global_shape),
        "offsets": list(s.box.offsets), "sizes": list(s.box.sizes), "strides": list(s.strides),
        "region": s.region, "byte_offset": s.byte_offset,
    }


def shard_from_wire(d: Mapping[str, Any], rank: int) -> ShardRecord:
    return ShardRecord(
        name=d["name"], dtype=d["dtype"], global_shape=tuple(d["global_shape"]),
        box=Box(tuple(d["offsets"]), tuple(d["sizes"])), strides=tuple(d["strides"]),
        rank=rank, region=d["region"], byte_offset=d["byte_offset"],
    )


@dataclass(frozen=True)
class Session:
    """A publisher group's membership: all ranks of one session share ``epoch``."""

    epoch: int
    session_id: str
    rank: int
    world_size: int
    lease_id: int


@dataclass(frozen=True)
class Layout:
    layout_id: str
    epoch: int
    rank: int
    shards: tuple[ShardRecord, ...]
    transport: bytes
    packed: tuple[tuple[str, ShardRecord], ...] = ()  # (consumer, contiguous copy) pre-packed for it


@dataclass(frozen=True)
class Piece:
    step: int
    epoch: int
    rank: int
    world_size: int
    layout_id: str
    base_offset: int


@dataclass(frozen=True)
class Replica:
    """A consumer re-serving a version from its buffers (P2P fan-out)."""

    step: int
    group: str
    member: str
    layout_id: str


@dataclass(frozen=True)
class Version:
    """A committed version as one consumer read it: commit, pieces, replicas, and (when asked)
    the layouts that are still alive (``missing``: publisher ranks whose layout lease is gone)."""

    step: int
    epoch: int
    world_size: int
    pieces: Mapping[int, Piece]
    replicas: Mapping[str, Replica] = field(default_factory=dict)
    layouts: Mapping[int, Layout] = field(default_factory=dict)
    replica_layouts: Mapping[str, Layout] = field(default_factory=dict)
    missing: frozenset[int] = frozenset()

    @property
    def layout_key(self) -> tuple[object, ...]:
        """Identifies the source layout: unchanged key means the cached plan still holds."""
        return (tuple(self.pieces[r].layout_id for r in sorted(self.pieces)),
                tuple((m, self.replicas[m].group, self.replicas[m].layout_id) for m in sorted(self.replica_layouts)))


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    uri: str
    world_size: int
    bytes: int
    written_at: float


def layout_id_of(epoch: int, rank: int, shards: Sequence[ShardRecord], transport: bytes,
                 packed: Sequence[tuple[str, ShardRecord]] = ()) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(b"%d/%d/" % (epoch, rank))
    h.update(transport)
    for s in shards:
        h.update(repr(shard_to_wire(s)).encode())
    for c, s in packed:
        h.update(c.encode() + repr(shard_to_wire(s)).encode())
    return h.hexdigest()


class _KeepAlive(threading.Thread):
    """Refreshes a lease every ttl/3; after a refresh gap longer than the ttl the lease is lost."""

    def __init__(self, catalog: "Catalog", lease_id: int, ttl: float):
        super().__init__(name=f"astate-lease-{lease_id:x}", daemon=True)
        self.catalog, self.lease_id, self.ttl = catalog, lease_id, ttl
        self.stop_event = threading.Event()
        self.lost = False

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self.stop_event.wait(self.ttl / 3):
            try:
                resp = list(self.catalog.client.refresh_lease(self.lease_id))
                if resp and resp[0].TTL <= 0:
                    self.lost = True
                    log.error("lease %x expired", self.lease_id)
                    return
                last_ok = time.monotonic()
            except _RETRYABLE as exc:
                if time.monotonic() - last_ok > self.ttl:
                    self.lost = True
                    log.error("lease %x lost: etcd unreachable for %.1fs (%s)", self.lease_id, self.ttl, exc)
                    return


class Catalog:
    """One namespace's control plane in etcd.

    Args:
        endpoint: ``host:port`` (comma-separated for several etcd members).
        namespace: the versioned state, e.g. ``"policy"``; namespaces never see each other's keys.
        retention: committed versions whose metadata is kept (older ones are deleted after each commit).
        lease_ttl: seconds without keep-alive after which a rank (or reader) is considered dead.
        op_timeout: seconds for one etcd request.
        retry_deadline: seconds of retries with backoff before :class:`CatalogUnavailable`.

    Raises:
        CatalogError: a bad namespace.
    """

    def __init__(self, endpoint: str, namespace: str, *, retention: int = 4, lease_ttl: float = 10.0,
                 op_timeout: float = 5.0, retry_deadline: float = 15.0):
        if not isinstance(namespace, str) or not _NS_RE.match(namespace):
            raise CatalogError(f"bad namespace {namespace!r}: use 1-128 characters from [A-Za-z0-9_.-]")
        if retention < 1:
            raise CatalogError(f"retention must be >= 1, got {retention}")
        self.endpoint, self.namespace, self.retention = endpoint, namespace, retention
        self.lease_ttl, self.op_timeout, self.retry_deadline = lease_ttl, op_timeout, retry_deadline
        self.prefix = f"/astate/{namespace}/"
        eps = []
        for item in endpoint.split(","):
            host, _, port = item.strip().rpartition(":")
            # time_retry=0: pyetcd would otherwise refuse a single endpoint for 5 min after one failure.
            eps.append(Endpoint(host or "127.0.0.1", int(port), secure=False, time_retry=0.0,
                                opts=[("grpc.max_receive_message_length", 64 << 20)]))
        self.client = MultiEndpointEtcd3Client(endpoints=eps, timeout=op_timeout, failover=len(eps) > 1)
        self.session: Session | None = None
        self._keepalives: list[_KeepAlive] = []
        self._reader_lease: int | None = None
        self._layout_cache: dict[str, Layout] = {}
        self._written_layouts: dict[str, bytes] = {}
        self._lock = threading.Lock()

    # ---- plumbing -------------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_deadline
        delay = 0.05
        while True:
            try:
                return fn()
            except _RETRYABLE as exc:
                if time.monotonic() + delay > deadline:
                    raise CatalogUnavailable(
                        f"etcd at {self.endpoint} unreachable for {self.retry_deadline:.0f}s during {what}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                log.debug("etcd %s failed (%s); retrying in %.2fs", what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _txn(self, what: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None
             ) -> tuple[bool, list[Any]]:
        return self._call(what, lambda: self.client.transaction(compare=compare, success=success,
                                                                failure=failure or []))

    def _new_lease(self) -> int:
        lease = self._call("lease grant", lambda: self.client.lease(max(1, int(round(self.lease_ttl)))))
        ka = _KeepAlive(self, lease.id, self.lease_ttl)
        ka.start()
        self._keepalives.append(ka)
        return int(lease.id)

    def ping(self) -> None:
        """Raises CatalogUnavailable when etcd does not answer within the retry budget."""
        self._call("status", self.client.status)

    # ---- counters -------------------------------------------------------------------------

    def _get_counter(self, name: str) -> tuple[int | None, int]:
        value, meta = self._call(f"get {name}", lambda: self.client.get(self.key(name)))
        return codec.decode_counter(value), (meta.mod_revision if meta else 0)

    def latest(self) -> int | None:
        """The newest committed step, or None before the first commit."""
        return self._get_counter("latest")[0]

    def epoch(self) -> int | None:
        return self._get_counter("epoch")[0]

    # ---- sessions -------------------------------------------------------------------------

    def open_session(self, *, rank: int, world_size: int, session_id: str | None = None,
                     join_timeout: float = 60.0) -> Session:
        """Start (rank 0) or join (rank > 0) the publisher session of this namespace.

        Rank 0 increments the epoch, which fences every older session: their writes are
        rejected from then on. Ranks > 0 join the session whose id matches ``session_id``
        (any live session with the same world size when None).

        Raises:
            CatalogError: bad rank/world_size; WaitTimeout: no session to join in time.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise CatalogError(f"rank {rank} is not in [0, world_size={world_size})")
        lease = self._new_lease()
        host, pid = socket.gethostname(), os.getpid()
        if rank == 0:
            sid = session_id or uuid.uuid4().hex
            while True:
                old, _rev = self._get_counter("epoch")
                new = (old or 0) + 1
                cmp = (tx.Version(self.key("epoch")) == 0) if old is None else (
                    tx.Value(self.key("epoch")) == codec.encode_counter(old))
                ok, _ = self._txn("open session", [cmp], [
                    tx.Put(self.key("epoch"), codec.encode_counter(new)),
                    tx.Put(self.key("session"), codec.encode("session", {
                        "epoch": new, "session_id": sid, "world_size": world_size, "host": host,
                        "pid": pid, "started": time.time()}), lease=lease),
                    tx.Put(self.key("members", _n(new), _n(0)),
                           codec.encode("member", {"epoch": new, "rank": 0, "host": host, "pid": pid}), lease=lease),
                    # An empty 'latest' lets the commit transaction compare values from the first step on.
                    tx.Txn([tx.Version(self.key("latest")) == 0], [tx.Put(self.key("latest"), b"")], []),
                ])
                if ok:
                    self.session = Session(new, sid, 0, world_size, lease)
                    log.info("namespace %s: session %s opened with epoch %d (world size %d)",
                             self.namespace, sid, new, world_size)
                    return self.session
        deadline = time.monotonic() + join_timeout
        while True:
            rec = self.session_record()
            if rec is not None and rec["world_size"] == world_size and (
                    session_id is None or rec["session_id"] == session_id):
                epoch = rec["epoch"]
                ok, _ = self._txn("join session", [tx.Value(self.key("epoch")) == codec.encode_counter(epoch)], [
                    tx.Put(self.key("members", _n(epoch), _n(rank)),
                           codec.encode("member", {"epoch": epoch, "rank": rank, "host": host, "pid": pid}),
                           lease=lease)])
                if ok:
                    self.session = Session(epoch, rec["session_id"], rank, world_size, lease)
                    log.info("namespace %s: rank %d joined session %s (epoch %d)",
                             self.namespace, rank, rec["session_id"], epoch)
                    return self.session
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(
                    f"namespace {self.namespace!r}: rank {rank} found no session "
                    f"{session_id or '(any)'} of world size {world_size} to join within {join_timeout}s"
                )
            self._wait_change(self.key("session"), min(remaining, 1.0))

    def session_record(self) -> dict[str, Any] | None:
        value, _ = self._call("get session", lambda: self.client.get(self.key("session")))
        return None if value is None else codec.decode("session", value)

    def live_ranks(self, epoch: int) -> set[int]:
        """Ranks of session ``epoch`` whose lease is alive."""
        kvs = self._call("get members", lambda: list(self.client.get_prefix(self.key("members", _n(epoch)) + "/")))
        return {codec.decode("member", v)["rank"] for v, _ in kvs}

    def _fence(self) -> list[Any]:
        s = self._require_session()
        return [tx.Value(self.key("epoch")) == codec.encode_counter(s.epoch),
                tx.Version(self.key("members", _n(s.epoch), _n(s.rank))) > 0]

    def _require_session(self) -> Session:
        if self.session is None:
            raise CatalogError("no publisher session: call open_session first")
        return self.session

    def _fenced_error(self, what: str) -> StaleSessionError:
        s = self._require_session()
        now = self.epoch()
        if now != s.epoch:
            return StaleSessionError(
                f"namespace {self.namespace!r}: {what} rejected: session epoch {s.epoch} was fenced by "
                f"a newer session (epoch {now})")
        return StaleSessionError(
            f"namespace {self.namespace!r}: {what} rejected: rank {s.rank}'s lease of session epoch "
            f"{s.epoch} expired (the rank was considered dead)")

    # ---- publishing -----------------------------------------------------------------------

    def write_layout(self, shards: Sequence[ShardRecord], transport: bytes,
                     packed: Sequence[tuple[str, ShardRecord]] = ()) -> str:
        """Store this rank's layout once (content-addressed); returns its id. ``packed`` lists
        contiguous copies built for single consumers (pre-packing).

        Raises:
            StaleSessionError: this session was fenced or this rank's lease expired.
        """
        s = self._require_session()
        lid = layout_id_of(s.epoch, s.rank, shards, transport, packed)
        if lid in self._written_layouts:
            return lid
        rec: dict[str, Any] = {"layout_id": lid, "epoch": s.epoch, "rank": s.rank,
                               "shards": [shard_to_wire(x) for x in shards], "transport": transport}
        if packed:
            rec["packed"] = [{"consumer": c, "shard": shard_to_wire(x)} for c, x in packed]
        value = codec.encode("layout", rec)
        ok, _ = self._txn("write layout", self._fence(),
                          [tx.Put(self.key("layouts", _n(s.epoch), _n(s.rank), lid), value, lease=s.lease_id)])
        if not ok:
            raise self._fenced_error("layout write")
        self._written_layouts[lid] = value
        return lid

    def put_piece(self, step: int, layout_id: str, base_offset: int = 0) -> bool:
        """Write this rank's piece of ``step`` and try to commit; returns True if the version
        is committed (by this or another rank's transaction).

        Raises:
            StaleSessionError: this session was fenced or this rank's lease expired.
        """
        s = self._require_session()
        _check_step(step)
        piece = codec.encode("piece", {"step": step, "epoch": s.epoch, "rank": s.rank, "world_size": s.world_size,
                                       "layout_id": layout_id, "base_offset": base_offset})
        ok, _ = self._txn("write piece", self._fence(),
                          [tx.Put(self.key("versions", _n(step), "pieces", _n(s.epoch), _n(s.rank)), piece)])
        if not ok:
            raise self._fenced_error(f"piece of step {step}")
        return self.try_commit(step)

    def try_commit(self, step: int) -> bool:
        """Commit ``step`` if all pieces of this session are present (an etcd transaction).

        Concurrent calls from several ranks are safe: the comparisons make every winner
        write the same commit, and ``latest`` only moves forward.
        """
        s = self._require_session()
        pieces = [tx.Version(self.key("versions", _n(step), "pieces", _n(s.epoch), _n(r))) > 0
                  for r in range(s.world_size)]
        # latest <= step, as a bytewise compare against step + 1 (an empty latest is smallest).
        forward = tx.Value(self.key("latest")) < codec.encode_counter(step + 1)
        commit = codec.encode("commit", {"step": step, "epoch": s.epoch, "world_size": s.world_size,
                                         "committed_at": time.time()})
        ok, resp = self._txn(f"commit {step}", [*self._fence(), *pieces, forward], [
            tx.Put(self.key("versions", _n(step), "commit"), commit),
            tx.Put(self.key("latest"), codec.encode_counter(step)),
        ], [tx.Get(self.key("epoch")), tx.Get(self.key("latest")), tx.Get(self.key("versions", _n(step), "commit"))])
        if ok:
            log.info("namespace %s: committed step %d (epoch %d)", self.namespace, step, s.epoch)
            self._apply_retention()
            return True
        epoch_now = codec.decode_counter(resp[0][0][0]) if resp[0] else None
        if epoch_now != s.epoch:
            raise self._fenced_error(f"commit of step {step}")
        latest = codec.decode_counter(resp[1][0][0]) if resp[1] else None
        if latest is not None and latest > step:
            log.warning("namespace %s: step %d superseded by committed step %d", self.namespace, step, latest)
            return False
        return bool(resp[2]) and codec.decode("commit", resp[2][0][0])["epoch"] == s.epoch

    def _apply_retention(self) -> None:
        steps = self.committed_steps()
        for old in steps[: max(0, len(steps) - self.retention)]:
            self._txn("retention", [], [
                tx.Delete(self.key("versions", _n(old)) + "/", _range_end(self.key("versions", _n(old), "").encode())),
                tx.Delete(self.key("readers", _n(old)) + "/", _range_end(self.key("readers", _n(old), "").encode())),
                tx.Delete(self.key("retired", _n(old)) + "/", _range_end(self.key("retired", _n(old), "").encode())),
                tx.Delete(self.key("torn", _n(old)) + "/", _range_end(self.key("torn", _n(old), "").encode())),
                tx.Delete(self.key("delivered", _n(old)) + "/",
                          _range_end(self.key("delivered", _n(old), "").encode())),
            ])

    def committed_steps(self) -> list[int]:
        """Steps whose metadata is still held, oldest first."""
        pre = self.key("versions") + "/"
        kvs = self._call("list versions", lambda: list(self.client.get_prefix(pre, keys_only=True)))
        out = []
        for _v, meta in kvs:
            k = meta.key.decode()
            if k.endswith("/commit"):
                out.append(int(k[len(pre):].split("/", 1)[0]))
        return sorted(out)

    def retire(self, step: int, *, timeout: float = 30.0) -> int:
        """Mark this rank's memory of ``step`` as about to change (no new readers), and wait
        (bounded) for the readers registered on it to finish. If some are still registered when
        the wait ends, mark the version torn: those readers will discard what they read.
        Returns how many readers were still registered.

        Raises:
            StaleSessionError: this session was fenced.
        """
        s = self._require_session()
        rec = codec.encode("retired", {"step": step, "epoch": s.epoch, "rank": s.rank})
        self._call("retire", lambda: self.client.put(self.key("retired", _n(step), _n(s.rank)), rec))
        return self._wait_readers(step, timeout, torn_as=_n(s.rank))

    def _wait_readers(self, step: int, timeout: float, *, torn_as: str) -> int:
        pre = self.key("readers", _n(step)) + "/"
        deadline = time.monotonic() + timeout
        while True:
            kvs, rev = self._get_prefix_rev(pre)
            if not kvs:
                return 0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.log(logging.WARNING if timeout > 0 else logging.DEBUG,
                        "namespace %s: changing memory of step %d with %d readers still registered",
                        self.namespace, step, len(kvs))
                rec = codec.encode("retired", {"step": step, "epoch": self.session.epoch if self.session else 0,
                                               "rank": self.session.rank if self.session else 0})
                self._call("mark torn", lambda: self.client.put(self.key("torn", _n(step), torn_as), rec))
                return len(kvs)
            self._wait_change(pre, remaining, prefix=True, start_revision=rev + 1)

    # ---- consuming ------------------------------------------------------------------------

    def wait_for(self, min_step: int | None = None, timeout: float | None = None) -> int:
        """Block until a committed version >= ``min_step`` exists (any version when None);
        returns the newest committed step. Built on an etcd watch of ``latest``.

        Raises:
            WaitTimeout: none appeared within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            resp = self._call("get latest", lambda: self.client.get_response(self.key("latest")))
            latest = codec.decode_counter(resp.kvs[0].value) if resp.kvs else None
            rev = int(resp.header.revision)
            if latest is not None and (min_step is None or latest >= min_step):
                return latest
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                want = "any version" if min_step is None else f"a version >= {min_step}"
                raise WaitTimeout(
                    f"namespace {self.namespace!r}: {want} was not committed within {timeout}s "
                    f"(latest is {latest})")
            self._wait_change(self.key("latest"), remaining, start_revision=rev + 1)

    def _get_prefix_rev(self, prefix: str) -> tuple[list[tuple[bytes, Any]], int]:
        """Range read plus the store revision it saw (so a watch can start right after it)."""
        def go() -> tuple[list[tuple[bytes, Any]], int]:
            resp = self.client.get_prefix_response(prefix)
            return [(kv.value, kv) for kv in resp.kvs], int(resp.header.revision)
        return self._call(f"get {prefix}", go)

    def _wait_change(self, key: str, timeout: float | None, *, prefix: bool = False, start_revision: int | None = None
                     ) -> None:
        """Wait for one watch event on key (or prefix) after start_revision, or the timeout."""
        event = threading.Event()

        def cb(resp: Any) -> None:
            event.set()

        kwargs: dict[str, Any] = {}
        if prefix:
            kwargs["range_end"] = _range_end(key.encode())
        if start_revision is not None:
            kwargs["start_revision"] = start_revision
        try:
            wid = self._call("watch", lambda: self.client.add_watch_callback(key, cb, **kwargs))
        except etcd_exc.WatchTimedOut as exc:
            raise CatalogUnavailable(f"etcd watch on {key} could not be created: {exc}") from exc
        try:
            # Bounded so a lost watch stream (etcd restart) is re-established rather than waited on forever.
            event.wait(min(timeout, 5.0) if timeout is not None else 5.0)
        finally:
            try:
                self.client.cancel_watch(wid)
            except _RETRYABLE:
                pass

    def _reader_lease_id(self) -> int:
        with self._lock:
            lost = any(k.lost for k in self._keepalives if k.lease_id == self._reader_lease)
            if self._reader_lease is None or lost:
                self._reader_lease = self._new_lease()
            return self._reader_lease

    def begin_read(self, step: int, reader_id: str) -> Version:
        """Register as a reader of ``step`` and read its commit and pieces, in one transaction.

        Raises:
            VersionNotFound: the version is not committed, was retired, or was dropped by retention.
        """
        vkey = self.key("versions", _n(step))
        rkey = self.key("readers", _n(step), reader_id)
        retired = self.key("retired", _n(step)) + "/"
        reader = codec.encode("reader", {"step": step, "reader_id": reader_id, "host": socket.gethostname(),
                                         "pid": os.getpid()})
        ok, resp = self._txn(f"begin read {step}", [
            tx.Version(vkey + "/commit") > 0,
            tx.Version(retired, _range_end(retired.encode())) == 0,
        ], [
            tx.Put(rkey, reader, lease=self._reader_lease_id()),
            tx.Get(vkey + "/", _range_end((vkey + "/").encode())),
        ])
        if not ok:
            raise VersionNotFound(f"namespace {self.namespace!r}: step {step} is not committed or was retired")
        try:
            return self._parse_version(step, resp[1])
        except BaseException:
            self.end_read(step, reader_id)
            raise

    def end_read(self, step: int, reader_id: str) -> bool:
        """Unregister; True when no publisher changed the memory of ``step`` while this reader
        was registered (and the version was not dropped), i.e. the bytes read are all of ``step``."""
        vkey = self.key("versions", _n(step))
        rkey = self.key("readers", _n(step), reader_id)
        torn = self.key("torn", _n(step)) + "/"
        ok, _ = self._txn(f"end read {step}", [
            tx.Version(vkey + "/commit") > 0,
            tx.Version(torn, _range_end(torn.encode())) == 0,
            # A reader whose lease expired was not waited for: its bytes may be torn.
            tx.Version(rkey) > 0,
        ], [tx.Delete(rkey), tx.Put(self.key("delivered", _n(step), reader_id), b"", lease=self._reader_lease_id())],
            [tx.Delete(rkey)])
        return bool(ok)

    def wait_delivered(self, step: int, consumers: set[str], timeout: float) -> set[str]:
        """Wait (bounded) until each of ``consumers`` finished a good read of ``step``; returns
        those that did not (dead consumers' ids vanish with their lease and are not waited for)."""
        pre = self.key("delivered", _n(step)) + "/"
        deadline = time.monotonic() + timeout
        while True:
            kvs, rev = self._get_prefix_rev(pre)
            done = {m.key.decode().rsplit("/", 1)[1] for _v, m in kvs}
            missing = (consumers & self.consumer_ids()) - done
            remaining = deadline - time.monotonic()
            if not missing or remaining <= 0:
                return missing
            self._wait_change(pre, remaining, prefix=True, start_revision=rev + 1)

    def consumer_ids(self) -> set[str]:
        """Live consumers (each registers on its first pull)."""
        pre = self.key("consumers") + "/"
        kvs = self._call("list consumers", lambda: list(self.client.get_prefix(pre, keys_only=True)))
        return {m.key.decode()[len(pre):] for _v, m in kvs}

    def read_version(self, step: int) -> Version:
        """Commit and pieces of a committed step, in one round trip (no reader registration).

        Raises:
            VersionNotFound: the step is not committed (or its metadata was dropped by retention).
        """
        vkey = self.key("versions", _n(step)) + "/"
        kvs, _ = self._get_prefix_rev(vkey)
        return self._parse_version(step, kvs)

    def _parse_version(self, step: int, kvs: Iterable[tuple[bytes, Any]]) -> Version:
        commit = None
        pieces_raw: dict[tuple[int, int], bytes] = {}
        replicas: dict[str, Replica] = {}
        for value, meta in kvs:
            k = meta.key.decode()
            tail = k.rsplit("/versions/", 1)[1].split("/")[1:]
            if tail == ["commit"]:
                commit = codec.decode("commit", value)
            elif len(tail) == 3 and tail[0] == "pieces":
                pieces_raw[(int(tail[1]), int(tail[2]))] = value
            elif len(tail) == 3 and tail[0] == "replicas":
                r = codec.decode("replica", value)
                replicas[r["member"]] = Replica(r["step"], r["group"], r["member"], r["layout_id"])
        if commit is None:
            raise VersionNotFound(f"namespace {self.namespace!r}: step {step} is not committed")
        epoch = commit["epoch"]
        pieces = {}
        for (e, r), value in pieces_raw.items():
            if e == epoch:
                p = codec.decode("piece", value)
                pieces[r] = Piece(p["step"], p["epoch"], p["rank"], p["world_size"], p["layout_id"], p["base_offset"])
        if set(pieces) != set(range(commit["world_size"])):
            raise CatalogError(
                f"namespace {self.namespace!r}: step {step} is committed but pieces of ranks "
                f"{sorted(set(range(commit['world_size'])) - set(pieces))} are missing")
        return Version(step, epoch, commit["world_size"], pieces, replicas)

    def layouts_of(self, version: Version) -> Version:
        """The version with the layouts of its live sources (cached by id: layouts are immutable).
        A publisher whose layout lease expired (the rank died) is listed in ``missing``; a
        re-serving consumer that died is left out."""
        want: list[tuple[object, str]] = []
        for p in version.pieces.values():
            if p.layout_id not in self._layout_cache:
                want.append((p.rank, self.key("layouts", _n(p.epoch), _n(p.rank), p.layout_id)))
        for m, rp in version.replicas.items():
            if rp.layout_id not in self._layout_cache:
                want.append((m, self.key("layouts", "replicas", m, rp.layout_id)))
        gone: set[object] = set()
        for i in range(0, len(want), 16):
            batch = want[i:i + 16]
            _ok, resp = self._txn("get layouts", [], [tx.Get(k) for _, k in batch])
            for (who, _k), r in zip(batch, resp):
                if not r:
                    gone.add(who)
                    continue
                rec = codec.decode("layout", r[0][0])
                shards = tuple(shard_from_wire(d, rec["rank"]) for d in rec["shards"])
                packed = tuple((p["consumer"], shard_from_wire(p["shard"], rec["rank"])) for p in rec.get("packed", ()))
                self._layout_cache[rec["layout_id"]] = Layout(rec["layout_id"], rec["epoch"], rec["rank"],
                                                              shards, rec["transport"], packed)
        layouts = {r: self._layout_cache[p.layout_id] for r, p in version.pieces.items()
                   if p.layout_id in self._layout_cache}
        rlayouts = {m: self._layout_cache[rp.layout_id] for m, rp in version.replicas.items()
                    if rp.layout_id in self._layout_cache}
        missing = frozenset(r for r in version.pieces if r not in layouts)
        return Version(version.step, version.epoch, version.world_size, version.pieces, version.replicas,
                       layouts, rlayouts, missing)

    # ---- pre-pack requests ----------------------------------------------------------------

    def register_consumer(self, reader_id: str, packs: Sequence[tuple[int, str, Box, str | None]]) -> None:
        """Ask publishers for contiguous copies of (rank, tensor, box, dtype or None) pieces."""
        wire = []
        for r, n, b, dt in packs:
            item: dict[str, Any] = {"rank": r, "name": n, "offsets": list(b.offsets), "sizes": list(b.sizes)}
            if dt is not None:
                item["dtype"] = dt
            wire.append(item)
        rec = codec.encode("consumer", {"reader_id": reader_id, "packs": wire})
        lease = self._reader_lease_id()
        self._call("register consumer", lambda: self.client.put(self.key("consumers", reader_id), rec, lease=lease))

    def pack_requests(self, rank: int) -> tuple[tuple[str, str, Box, str | None], ...]:
        """(consumer, tensor, box, dtype) pieces live consumers want this publisher rank to pre-pack."""
        kvs = self._call("get consumers", lambda: list(self.client.get_prefix(self.key("consumers") + "/")))
        out = []
        for v, _ in kvs:
            d = codec.decode("consumer", v)
            out += [(d["reader_id"], p["name"], Box(tuple(p["offsets"]), tuple(p["sizes"])), p.get("dtype"))
                    for p in d["packs"] if p["rank"] == rank]
        return tuple(sorted(out, key=lambda x: (x[0], x[1], x[2].offsets, x[2].sizes)))

    # ---- re-serving consumers (P2P fan-out) ----------------------------------------------

    def add_replica(self, step: int, group: str, member: str, shards: Sequence[ShardRecord],
                    transport: bytes) -> str:
        """Offer this consumer's buffers, which hold ``step``, as an extra source of that step.

        Raises:
            VersionNotFound: the step is no longer committed.
        """
        lid = layout_id_of(0, 0, shards, transport)
        lease = self._reader_lease_id()
        value = codec.encode("layout", {"layout_id": lid, "epoch": 0, "rank": 0,
                                        "shards": [shard_to_wire(x) for x in shards], "transport": transport})
        rec = codec.encode("replica", {"step": step, "group": group, "member": member, "layout_id": lid})
        vkey = self.key("versions", _n(step))
        ok, _ = self._txn("add replica", [tx.Version(vkey + "/commit") > 0], [
            tx.Put(self.key("layouts", "replicas", member, lid), value, lease=lease),
            tx.Put(vkey + "/replicas/" + group + "/" + member, rec, lease=lease),
        ])
        if not ok:
            raise VersionNotFound(f"namespace {self.namespace!r}: step {step} is not committed; cannot re-serve it")
        return lid

    def remove_replica(self, step: int, group: str, member: str, layout_id: str, *, timeout: float) -> int:
        """Stop offering a replica before its memory changes: no new reader plans with it, and
        readers registered on the step are waited for (bounded; past that they are marked torn)."""
        self._call("remove replica", lambda: self.client.delete(
            self.key("versions", _n(step), "replicas", group, member)))
        left = self._wait_readers(step, timeout, torn_as="r-" + member)
        self._call("drop replica layout", lambda: self.client.delete(self.key("layouts", "replicas", member,
                                                                              layout_id)))
        return left

    # ---- checkpoints ----------------------------------------------------------------------

    def record_checkpoint(self, entry: CheckpointEntry) -> None:
        value = codec.encode("checkpoint", {"step": entry.step, "uri": entry.uri, "world_size": entry.world_size,
                                            "bytes": entry.bytes, "written_at": entry.written_at})
        self._call("record checkpoint", lambda: self.client.put(self.key("checkpoints", _n(entry.step)), value))

    def checkpoints(self) -> list[CheckpointEntry]:
        """Known complete checkpoints, oldest first."""
        kvs = self._call("list checkpoints", lambda: list(self.client.get_prefix(self.key("checkpoints") + "/")))
        out = []
        for v, _ in kvs:
            d = codec.decode("checkpoint", v)
            out.append(CheckpointEntry(d["step"], d["uri"], d["world_size"], d["bytes"], d["written_at"]))
        return sorted(out, key=lambda e: e.step)

    # ---- lifetime -------------------------------------------------------------------------

    def close(self, *, revoke: bool = True) -> None:
        """Stop keep-alives and revoke leases (members, layouts and readers vanish at once)."""
        for ka in self._keepalives:
            ka.stop_event.set()
            if revoke:
                try:
                    self.client.revoke_lease(ka.lease_id)
                except _RETRYABLE:
                    pass
        self._keepalives.clear()
        self.session = None
        self.client.close()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or step >= 10**19:
        raise CatalogError(f"step must be an int in [0, 1e19), got {step!r}")


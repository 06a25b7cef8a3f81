"""The etcd connection of one namespace: keys, bounded retries, transactions, leases, watches.

Everything else in the catalog goes through :class:`EtcdClient`; it knows nothing of sessions,
versions or readers, only how to talk to etcd without hanging and without leaking leases.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

import grpc
import pyetcd
import pyetcd.etcdrpc as etcdrpc
import pyetcd.exceptions as etcd_exc
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from .. import codec
from ..errors import CatalogRejected, CatalogUnavailable

__all__ = ["EtcdClient", "RETRYABLE", "range_end"]

log = logging.getLogger("astate_store.catalog")
T = TypeVar("T")

# Errors that mean "etcd did not answer" (as opposed to "etcd said no"): worth retrying.
RETRYABLE: tuple[type[BaseException], ...] = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.InternalServerError,
    etcd_exc.NoServerAvailableError,
    grpc.RpcError,
)


# gRPC answers that come from etcd itself (or the client's own limits) and will not change on a retry.
_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid request (for etcd, 'request is too large' past --max-request-bytes)",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "message over a size limit",
    grpc.StatusCode.PERMISSION_DENIED: "permission denied",
    grpc.StatusCode.UNAUTHENTICATED: "not authenticated",
    grpc.StatusCode.OUT_OF_RANGE: "out of range",
    grpc.StatusCode.UNIMPLEMENTED: "not implemented by this etcd",
    grpc.StatusCode.NOT_FOUND: "not found",
    grpc.StatusCode.ALREADY_EXISTS: "already exists",
}


def _refusal(exc: BaseException) -> str | None:
    """What etcd refused, when ``exc`` is a refusal rather than a failure to answer."""
    code = getattr(exc, "code", None)
    if not isinstance(exc, grpc.RpcError) or not callable(code):
        return None
    try:
        status = code()
    except Exception:  # a grpc error object without a status: treat as unreachable
        return None
    why = _REFUSALS.get(status)
    if why is None:
        return None
    details = getattr(exc, "details", None)
    text = details() if callable(details) else ""
    return f"{status.name}: {why}" + (f" ({text})" if text else "")


# Set in threads that do background work, so their requests are counted apart from callers' paths.
_BACKGROUND = threading.local()


def background_thread() -> None:
    """Mark the calling thread as background work (its etcd requests count as background_rpcs)."""
    _BACKGROUND.active = True


def range_end(prefix: str) -> bytes:
    """The etcd range end that makes ``[prefix, range_end)`` cover every key under ``prefix``."""
    return pyetcd.utils.prefix_range_end(prefix.encode())


class _KeepAlive(threading.Thread):
    """Refreshes a lease every ttl/3; after a refresh gap longer than the ttl the lease is lost.

    A failed refresh is retried soon (another member may answer at once), not a whole ttl/3 later.
    """

    def __init__(self, raw: MultiEndpointEtcd3Client, lease_id: int, ttl: float):
        super().__init__(name=f"astate-lease-{lease_id:x}", daemon=True)
        self.raw, self.lease_id, self.ttl = raw, lease_id, ttl
        self.stop_event = threading.Event()
        self.lost = False

    def run(self) -> None:
        last_ok = time.monotonic()
        interval = self.ttl / 3
        while not self.stop_event.wait(interval):
            interval = self.ttl / 3
            try:
                resp = list(self.raw.refresh_lease(self.lease_id))
                if resp and resp[0].TTL <= 0:
                    self.lost = True
                    log.error("lease %x expired", self.lease_id)
                    return
                last_ok = time.monotonic()
            except RETRYABLE as exc:
                interval = min(self.ttl / 3, 0.25)
                # One failed refresh is not fatal: etcd keeps the lease for the whole ttl.
                if time.monotonic() - last_ok > self.ttl:
                    self.lost = True
                    log.error("lease %x lost: etcd unreachable for %.1fs (%s)", self.lease_id, self.ttl, exc)
                    return


class EtcdClient:
    """One namespace's connection to etcd.

    Args:
        endpoint: ``host:port`` (comma-separated for several etcd members).
        namespace: keys live under ``/astate/<namespace>/`` (validated by :class:`Catalog`).
        lease_ttl: seconds without keep-alive after which a lease (a rank, a reader) expires.
        op_timeout: seconds for one etcd request.
        retry_deadline: seconds of retries with backoff before :class:`CatalogUnavailable`.
    """

    def __init__(self, endpoint: str, namespace: str, *, lease_ttl: float, op_timeout: float,
                 retry_deadline: float):
        self.endpoint, self.namespace = endpoint, namespace
        self.lease_ttl, self.op_timeout, self.retry_deadline = lease_ttl, op_timeout, retry_deadline
        self.prefix = f"/astate/{namespace}/"
        items = [i.strip() for i in endpoint.split(",") if i.strip()]
        several = len(items) > 1
        eps = []
        for item in items:
            host, _, port = item.rpartition(":")
            # pyetcd skips an endpoint for time_retry seconds after a request to it failed (while all
            # are skipped it raises NoServerAvailableError, which call() retries). One endpoint: 0
            # (pyetcd's default would refuse it for 5 min after one failure). Several: a short hold, so
            # the retry in call() goes to another member (with 0 the client stays on a dead member).
            eps.append(Endpoint(host or "127.0.0.1", int(port), secure=False, time_retry=2.0 if several else 0.0,
                                opts=[("grpc.max_receive_message_length", 64 << 20)]))
        # pyetcd starts on a random member: clients spread over the cluster.
        self.raw = MultiEndpointEtcd3Client(endpoints=eps, timeout=op_timeout, failover=several)
        self._keepalives: list[_KeepAlive] = []
        self._reader_lease: int | None = None
        self.rpcs = 0  # etcd requests (attempts) made on callers' paths, for the control-plane figures
        self.background_rpcs = 0  # ... and by background work (retention)
        # Guards the shared reader lease: several consumer threads may register at once.
        self._lock = threading.Lock()

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried with backoff while etcd does not answer, for at most ``retry_deadline``.

        Raises:
            CatalogUnavailable: etcd did not answer within the retry budget.
            CatalogRejected: etcd answered with a refusal (size, permission, invalid argument): at once.
        """
        deadline = time.monotonic() + self.retry_deadline
        delay = 0.05
        while True:
            if getattr(_BACKGROUND, "active", False):
                self.background_rpcs += 1
            else:
                self.rpcs += 1
            try:
                return fn()
            except RETRYABLE as exc:
                refused = _refusal(exc)
                if refused is not None:
                    raise CatalogRejected(f"etcd at {self.endpoint} refused {what}: {refused}") from exc
                if time.monotonic() + delay > deadline:
                    raise CatalogUnavailable(
                        f"etcd at {self.endpoint} unreachable for {self.retry_deadline:.0f}s during {what}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                log.debug("etcd %s failed (%s); retrying in %.2fs", what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def txn(self, what: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None
            ) -> tuple[bool, list[Any]]:
        """One etcd transaction (with retries): (whether ``compare`` held, the responses)."""
        return self.call(what, lambda: self.raw.transaction(compare=compare, success=success,
                                                            failure=failure or []))

    def new_lease(self) -> int:
        """A fresh lease of ``lease_ttl`` seconds, kept alive by a thread until :meth:`close`."""
        lease = self.call("lease grant", lambda: self.raw.lease(max(1, int(round(self.lease_ttl)))))
        ka = _KeepAlive(self.raw, lease.id, self.lease_ttl)
        ka.start()
        self._keepalives.append(ka)
        return int(lease.id)

    def reader_lease(self) -> int:
        """The one lease all consumer records of this client hang on; re-created once lost, so a
        consumer that was cut off from etcd comes back instead of writing on a dead lease."""
        with self._lock:
            lost = any(k.lost for k in self._keepalives if k.lease_id == self._reader_lease)
            if self._reader_lease is None or lost:
                self._reader_lease = self.new_lease()
            return self._reader_lease

    def ping(self) -> None:
        """Raises CatalogUnavailable when etcd does not answer within the retry budget."""
        self.call("status", self.raw.status)

    def get_counter(self, name: str) -> tuple[int | None, int]:
        """A counter key (``epoch``, ``latest``): its value (None when absent or empty) and mod revision."""
        value, meta = self.call(f"get {name}", lambda: self.raw.get(self.key(name)))
        return codec.decode_counter(value), (meta.mod_revision if meta else 0)

    def get_prefix_rev(self, prefix: str) -> tuple[list[tuple[bytes, Any]], int]:
        """Range read plus the store revision it saw (so a watch can start right after it)."""
        def go() -> tuple[list[tuple[bytes, Any]], int]:
            resp = self.raw.get_prefix_response(prefix)
            return [(kv.value, kv) for kv in resp.kvs], int(resp.header.revision)
        return self.call(f"get {prefix}", go)

    def wait_change(self, key: str, timeout: float | None, *, prefix: bool = False,
                    start_revision: int | None = None) -> None:
        """Wait for one watch event on key (or prefix) after start_revision, or the timeout.

        Returns early (after at most 5 s) even without an event: callers re-read and call again.
        """
        event = threading.Event()

        def cb(resp: Any) -> None:
            event.set()

        kwargs: dict[str, Any] = {}
        if prefix:
            kwargs["range_end"] = range_end(key)
        if start_revision is not None:
            kwargs["start_revision"] = start_revision
        try:
            wid = self.call("watch", lambda: self.raw.add_watch_callback(key, cb, **kwargs))
        except etcd_exc.WatchTimedOut as exc:
            raise CatalogUnavailable(f"etcd watch on {key} could not be created: {exc}") from exc
        try:
            # Bounded so a lost watch stream (etcd restart) is re-established rather than waited on forever.
            event.wait(min(timeout, 5.0) if timeout is not None else 5.0)
        finally:
            try:
                self.raw.cancel_watch(wid)
            except RETRYABLE:
                pass

    def txn_raw(self, what: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None) -> Any:
        """A transaction whose operations may include raw ``RequestOp``s (e.g. :meth:`count_op`);
        returns etcd's ``TxnResponse`` itself (pyetcd's parsed form drops counts and nested
        transaction results, which the commit path needs)."""
        def ops(items: list[Any]) -> list[Any]:
            return [op if isinstance(op, etcdrpc.RequestOp) else self.raw._ops_to_requests([op])[0] for op in items]

        def go() -> Any:
            req = etcdrpc.TxnRequest(compare=[c.build_message() for c in compare], success=ops(success),
                                     failure=ops(failure or []))
            try:
                return self.raw.kvstub.Txn(req, self.raw.timeout, credentials=self.raw.call_credentials,
                                           metadata=self.raw.metadata)
            except grpc.RpcError as exc:
                self.raw._manage_grpc_errors(exc)  # marks a failed endpoint (failover), re-raises typed

        return self.call(what, go)

    def count_op(self, key: str, *, prefix: bool = True) -> Any:
        """A ``RequestOp`` counting the keys under ``key`` (or ``key`` itself when not ``prefix``);
        no values cross the wire."""
        req = self.raw._build_get_range_request(key, range_end(key) if prefix else None, count_only=True)
        return etcdrpc.RequestOp(request_range=req)

    def close(self, revoke: bool = True) -> None:
        """Stop keep-alives and (by default) revoke the leases, so every record on them vanishes at once."""
        for ka in self._keepalives:
            ka.stop_event.set()
            if revoke:
                try:
                    self.raw.revoke_lease(ka.lease_id)
                except RETRYABLE:
                    pass
        self._keepalives.clear()
        self.raw.close()

"""The etcd connection of one namespace: keys, bounded retries, transactions, leases, watches.

Everything else in the catalog goes through :class:`EtcdClient`; it knows nothing of sessions,
versions or readers, only how to talk to etcd without hanging and without leaking leases. Its
:class:`EtcdConnection` (channel, token, leases) is its own, or shared with the clients of other
namespaces (``SessionHub``).

Its parts, by role: ``failures`` (what an etcd error means), ``tls_probe`` (telling a TLS
mismatch from an etcd that does not answer), ``leases`` (keep-alive threads), ``watches``
(watch streams that raise when refused and end when closed).
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pyetcd
import pyetcd.etcdrpc as etcdrpc
import pyetcd.exceptions as etcd_exc
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from astate_store.background import in_background
from astate_store.errors import CatalogAuthError, CatalogError, CatalogRejected, CatalogUnavailable
from astate_store.etcd.auth import request_token
from astate_store.etcd.config import EtcdConfig
from astate_store.etcd.failures import (
    RETRYABLE,
    WatchRefused,
    WatchStreamEnded,
    auth_problem,
    grpc_status,
    refusal,
    token_rejected,
)
from astate_store.etcd.leases import KeepAlive, revoke_lease
from astate_store.etcd.tls_probe import HANDSHAKE_WORDS, tls_problem
from astate_store.etcd.watches import new_watcher, wait_for_event
from astate_store.model import codec

__all__ = ["EtcdClient", "EtcdConnection", "RETRYABLE", "range_end", "WatchRefused", "WatchStreamEnded"]

log = logging.getLogger("astate_store.catalog")
T = TypeVar("T")

_RETRY_LOG_EVERY = 10.0  # seconds between WARNING lines about etcd not answering (per client)


def range_end(prefix: str) -> bytes:
    """The etcd range end that makes ``[prefix, range_end)`` cover every key under ``prefix``."""
    return pyetcd.utils.prefix_range_end(prefix.encode())


def _endpoints(config: EtcdConfig) -> list[Endpoint]:
    """pyetcd endpoints for every member of ``config``, with its TLS settings."""
    several = len(config.endpoints) > 1
    creds = config.channel_credentials() if config.tls else None
    eps = []
    for item in config.endpoints:
        host, _, port = item.rpartition(":")
        # pyetcd skips an endpoint for time_retry seconds after a request to it failed (while all
        # are skipped it raises NoServerAvailableError, which call() retries). One endpoint: 0
        # (pyetcd's default would refuse it for 5 min after one failure). Several: a short hold, so
        # the retry in call() goes to another member (with 0 the client stays on a dead member).
        eps.append(
            Endpoint(
                host or "127.0.0.1",
                int(port),
                secure=config.tls,
                creds=creds,
                time_retry=2.0 if several else 0.0,
                opts=[("grpc.max_receive_message_length", 64 << 20)],
            )
        )
    return eps


def _txn_request(
    raw: MultiEndpointEtcd3Client, compare: list[Any], success: list[Any], failure: list[Any]
) -> etcdrpc.TxnRequest:
    """etcd's ``TxnRequest``; operations already ``RequestOp``s are kept, pyetcd's are translated."""

    def ops(items: list[Any]) -> list[Any]:
        return [op if isinstance(op, etcdrpc.RequestOp) else raw._ops_to_requests([op])[0] for op in items]

    return etcdrpc.TxnRequest(
        compare=[c.build_message() for c in compare], success=ops(success), failure=ops(failure)
    )


class _Verdict(enum.Enum):
    """What a failed etcd request means for :meth:`EtcdClient.call`."""

    RETRY = "retry"  # etcd did not answer: again after a backoff
    REAUTHENTICATE = "reauthenticate"  # etcd rejected the token: again at once, with a fresh one
    REFUSED = "refused"  # etcd (or the TLS handshake) said no: raise at once
    UNAVAILABLE = "unavailable"  # no answer within the retry budget: raise


@dataclass
class _Attempts:
    """The state of one :meth:`EtcdClient.call`'s retry loop."""

    deadline: float  # time.monotonic() after which no backoff is started
    delay: float = 0.05  # the next backoff, doubling up to 1 s
    reauthenticated: bool = False  # a fresh token was tried already (once per call)
    handshake_failures: int = 0  # gRPC named a failed TLS handshake this many times
    retried: int = 0  # attempts retried after a backoff


class EtcdConnection:
    """One connection to etcd, shared by the clients built over it (one client per namespace; a
    ``SessionHub``'s stores share one connection): the gRPC channel (pyetcd's client), the
    authentication token, which endpoints answered, the outage log, and the leases kept alive on
    the channel.

    Args:
        config: endpoints, TLS, credentials.
        op_timeout: seconds for one etcd request.
    """

    def __init__(self, config: EtcdConfig, op_timeout: float):
        self.config, self.op_timeout, self.endpoint = config, op_timeout, config.url
        several = len(config.endpoints) > 1
        # pyetcd starts on a random member: clients spread over the cluster. Credentials are not given
        # to pyetcd: it would authenticate once, untyped and unretried, and never refresh the token.
        self.raw = MultiEndpointEtcd3Client(
            endpoints=_endpoints(config), timeout=op_timeout, failover=several
        )
        self.raw.get_watcher = functools.partial(new_watcher, self.raw)  # type: ignore[method-assign]
        self.keepalives: list[KeepAlive] = []  # the leases kept alive on this channel
        self.reader_lease_id: int | None = None  # the one lease all consumer records hang on
        # Guards the reader lease: several consumer threads may register at once.
        self.reader_lock = threading.Lock()
        self.retry_logged = -1e9  # when an outage was last logged at WARNING (rate limit)
        self.outage = False  # a retry was logged and no request has succeeded since
        # Authentication: the current token (None before the first request), and whether etcd said
        # its authentication is off (then requests go without a token, as etcd's own client does).
        self.auth_lock = threading.Lock()
        self.token: str | None = None
        self.auth_off = False
        self.authentications = 0
        # Endpoints that answered once (their TLS settings work: no more probing) and when each was
        # last probed after a failure.
        self.verified: set[str] = set()
        self.probed: dict[str, float] = {}

    def lost(self, lease_id: int) -> bool:
        """Whether the keep-alive of ``lease_id`` found the lease gone (it expired meanwhile)."""
        return any(k.lost for k in self.keepalives if k.lease_id == lease_id)

    # ---- authentication ----------------------------------------------------------------------

    def _authenticate(self) -> None:
        """Get a token for the configured user. ``auth_lock`` held."""
        token = request_token(self.raw, self.config, self.op_timeout, self.endpoint)
        if token is None:
            self.auth_off = True
            return
        self.authentications += 1
        self.token = token
        self.raw.metadata = (("token", token),)
        self.raw.call_credentials = None  # metadata works on plain and TLS channels alike
        # A watch stream keeps the token it was opened with: later watches open a new stream; the old
        # one is ended (its callbacks get the error and their owners re-watch).
        old = self.raw._stubs.pop("watcher", None)
        if old is not None:
            old.close()

    def ensure_token(self) -> None:
        """Authenticate first, when the connection has a user and no token yet."""
        if self.config.user is None or self.token is not None or self.auth_off:
            return
        with self.auth_lock:
            if self.token is None and not self.auth_off:
                self._authenticate()

    def reauthenticate(self, stale: str | None) -> None:
        """Replace the token ``stale`` (unless another thread already did)."""
        with self.auth_lock:
            if self.token == stale:
                log.info(
                    "etcd at %s rejected the auth token of %r; authenticating again",
                    self.endpoint,
                    self.config.user,
                )
                self.token, self.auth_off = None, False
                self._authenticate()

    def reauth_quietly(self, exc: BaseException) -> None:
        """For the keep-alive threads: a fresh token, errors logged (the refresh is retried anyway)."""
        if self.config.user is None:
            return
        try:
            self.reauthenticate(self.token)
        except (CatalogError, *RETRYABLE) as err:
            log.warning("re-authenticating to etcd at %s failed: %s", self.endpoint, err)


class EtcdClient:
    """One namespace's connection to etcd.

    Args:
        endpoint: an :class:`~astate_store.etcd.config.EtcdConfig` (endpoints, TLS, credentials),
            or ``host:port`` / ``https://host:port`` (comma-separated for several etcd members; no
            credentials).
        namespace: keys live under ``/astate/<namespace>/`` (validated by :class:`Catalog`).
        lease_ttl: seconds without keep-alive after which a lease (a rank, a reader) expires.
        op_timeout: seconds for one etcd request.
        retry_deadline: seconds of retries with backoff before :class:`CatalogUnavailable`.
        connection: an :class:`EtcdConnection` another client opened, to share (a ``SessionHub``'s
            namespaces); its owner closes it and the leases on it. None: a connection of its own.

    With a user, the client authenticates on its first request and sends the token with every
    request, watch and lease keep-alive; a token etcd no longer accepts (simple tokens expire after
    ``--auth-token-ttl``, 5 min by default) is replaced once and the request retried.
    """

    def __init__(
        self,
        endpoint: str | EtcdConfig,
        namespace: str,
        *,
        lease_ttl: float,
        op_timeout: float,
        retry_deadline: float,
        connection: EtcdConnection | None = None,
    ):
        self.config = EtcdConfig.parse(endpoint)
        self.endpoint, self.namespace = self.config.url, namespace
        self.lease_ttl, self.op_timeout, self.retry_deadline = lease_ttl, op_timeout, retry_deadline
        self.prefix = f"/astate/{namespace}/"
        self._owner = connection is None  # closes the connection (and revokes its leases) at close()
        self.connection = EtcdConnection(self.config, op_timeout) if connection is None else connection
        self.raw = self.connection.raw
        self.rpcs = 0  # etcd requests (attempts) made on callers' paths, for the control-plane figures
        self.background_rpcs = 0  # ... and by background work (retention)
        self.retries = 0  # attempts etcd did not answer, retried after a backoff (Store.stats, metrics)

    @property
    def authentications(self) -> int:
        """Tokens the connection obtained from etcd (the first, and each replacement)."""
        return self.connection.authentications

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    # ---- requests ----------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried with backoff while etcd does not answer, for at most ``retry_deadline``.

        Each attempt:

        1. counts the request (callers' paths apart from background work);
        2. authenticates first when the client has a user and no token yet;
        3. runs ``fn``; on success, notes that etcd answers again (:meth:`_answered`);
        4. on failure, :meth:`_classify` says what to do: raise a typed error at once, retry at
           once with a fresh token (once per call), or retry after a backoff (0.05 s doubling
           up to 1 s).

        Raises:
            CatalogUnavailable: etcd did not answer within the retry budget.
            CatalogAuthError: TLS settings, credentials or permissions do not match etcd's: at once
                (a rejected token is first replaced once).
            CatalogRejected: etcd answered with a refusal (size, permission, invalid argument): at once.
        """
        attempts = _Attempts(deadline=time.monotonic() + self.retry_deadline)
        while True:
            if in_background():  # a serial worker's thread (background.py): retention, read ends
                self.background_rpcs += 1
            else:
                self.rpcs += 1
            token = self.connection.token
            try:
                self.connection.ensure_token()
                token = self.connection.token  # the token this attempt carries
                result = fn()
            except (WatchRefused, etcd_exc.WatchTimedOut, *RETRYABLE) as exc:  # type: ignore[misc]
                verdict, error = self._classify(what, exc, attempts)
                if error is not None:
                    raise error from exc
                if verdict is _Verdict.REAUTHENTICATE:
                    attempts.reauthenticated = True
                    self.connection.reauthenticate(token)  # (a no-op when another thread already replaced it)
                    continue
                attempts.retried += 1
                self._retrying(what, exc, attempts.delay)
                time.sleep(attempts.delay)
                attempts.delay = min(attempts.delay * 2, 1.0)
                continue
            self._answered(what, attempts.retried)
            return result

    def _classify(
        self, what: str, exc: BaseException, attempts: _Attempts
    ) -> tuple[_Verdict, CatalogError | None]:
        """What a failed attempt means: (verdict, the error to raise when the verdict is final).

        In order:

        1. a watch etcd did not create in time: retry while a whole wait fits the budget;
        2. a rejected or stale token, the first time in this call: re-authenticate, retry at once;
        3. credentials or permissions etcd names: refused (:class:`CatalogAuthError`);
        4. a refusal etcd would repeat (size, permission, invalid argument): refused
           (:class:`CatalogRejected`);
        5. a TLS mismatch, probed directly: refused (:class:`CatalogAuthError`);
        6. otherwise etcd did not answer: retry while the backoff fits the budget, else
           unavailable (:class:`CatalogUnavailable`).
        """
        if isinstance(exc, etcd_exc.WatchTimedOut):
            # No answer to a watch request (etcd slow or down), or its stream was closed under it
            # (a re-authentication replaced the stream): again, while a whole wait fits the budget.
            if time.monotonic() + attempts.delay + self.op_timeout > attempts.deadline:
                return _Verdict.UNAVAILABLE, CatalogUnavailable(
                    f"etcd at {self.endpoint}: watch for {what} not created within "
                    f"{self.retry_deadline:.0f}s: {exc!r}"
                )
            return _Verdict.RETRY, None
        if (
            self.config.user is not None
            and not attempts.reauthenticated
            and ((isinstance(exc, WatchRefused) and exc.denied) or token_rejected(exc))
        ):
            return _Verdict.REAUTHENTICATE, None  # an expired or stale token: once with a fresh one
        auth = auth_problem(
            exc,
            what,
            user=self.config.user,
            endpoint=self.endpoint,
            prefix=self.prefix,
            namespace=self.namespace,
        )
        if auth is not None:
            return _Verdict.REFUSED, CatalogAuthError(auth)
        refused = str(exc) if isinstance(exc, WatchRefused) else refusal(exc)
        if refused is not None:
            return _Verdict.REFUSED, CatalogRejected(f"etcd at {self.endpoint} refused {what}: {refused}")
        _, details = grpc_status(exc)
        if self.config.tls and any(w in details.lower() for w in HANDSHAKE_WORDS):
            attempts.handshake_failures += 1
        netloc = getattr(self.raw, "_current_ep_label", None)
        # An endpoint that answered before has working TLS settings: no probing it.
        tls = (
            None
            if netloc is None or netloc in self.connection.verified
            else tls_problem(self.config, netloc, self.connection.probed, exc, attempts.handshake_failures)
        )
        if tls is not None:
            return _Verdict.REFUSED, CatalogAuthError(tls)
        if time.monotonic() + attempts.delay > attempts.deadline:
            return _Verdict.UNAVAILABLE, CatalogUnavailable(
                f"etcd at {self.endpoint} unreachable for {self.retry_deadline:.0f}s during {what}: "
                f"{type(exc).__name__}: {exc}" + (f" ({details})" if details else "")
            )
        return _Verdict.RETRY, None

    def _answered(self, what: str, retried: int) -> None:
        """etcd answered: end a logged outage, and stop probing this endpoint's TLS settings."""
        conn = self.connection
        if retried and conn.outage:
            conn.outage = False  # once per outage, not once per caller that waited it out
            log.info("etcd at %s answers again (%s after %d retries)", self.endpoint, what, retried)
        if len(conn.verified) < len(self.config.endpoints):
            label = getattr(self.raw, "_current_ep_label", None)
            if label is not None:
                conn.verified.add(label)

    def _retrying(self, what: str, exc: BaseException, delay: float) -> None:
        """Count a retry; an outage is logged at WARNING at most every ``_RETRY_LOG_EVERY`` seconds
        per client (each retry at DEBUG), so a long one does not flood the log."""
        self.retries += 1
        conn = self.connection
        conn.outage = True
        now = time.monotonic()
        if now - conn.retry_logged >= _RETRY_LOG_EVERY:
            conn.retry_logged = now
            log.warning(
                "etcd at %s did not answer %s (%s: %s); retrying with backoff for up to %.0fs",
                self.endpoint,
                what,
                type(exc).__name__,
                exc,
                self.retry_deadline,
            )
        else:
            log.debug("etcd %s failed (%s); retrying in %.2fs", what, exc, delay)

    def txn(
        self, what: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None
    ) -> tuple[bool, list[Any]]:
        """One etcd transaction (with retries): (whether ``compare`` held, the responses)."""
        return self.call(
            what, lambda: self.raw.transaction(compare=compare, success=success, failure=failure or [])
        )

    def new_lease(self) -> int:
        """A fresh lease of ``lease_ttl`` seconds, kept alive by a thread until :meth:`close`."""
        return self._grant()

    def _grant(self) -> int:
        lease = self.call("lease grant", lambda: self.raw.lease(max(1, int(round(self.lease_ttl)))))
        ka = KeepAlive(self.raw, lease.id, self.lease_ttl, reauth=self.connection.reauth_quietly)
        ka.start()
        self.connection.keepalives.append(ka)
        return int(lease.id)

    def reader_lease(self) -> int:
        """The one lease all consumer records of this connection hang on; re-created once lost, so
        a consumer that was cut off from etcd comes back instead of writing on a dead lease."""
        conn = self.connection
        with conn.reader_lock:
            if conn.reader_lease_id is None or conn.lost(conn.reader_lease_id):
                conn.reader_lease_id = self._grant()
            return conn.reader_lease_id

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

    def wait_change(
        self, key: str, timeout: float | None, *, prefix: bool = False, start_revision: int | None = None
    ) -> None:
        """Wait for one watch event on key (or prefix) after start_revision, or the timeout.

        Returns early (after at most 5 s) even without an event: callers re-read and call again.
        """
        end = range_end(key) if prefix else None
        wait_for_event(self.call, self.raw, key, timeout, range_end=end, start_revision=start_revision)

    def txn_raw(
        self, what: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None
    ) -> Any:
        """A transaction whose operations may include raw ``RequestOp``s (e.g. :meth:`count_op`);
        returns etcd's ``TxnResponse`` itself (pyetcd's parsed form drops counts and nested
        transaction results, which the commit path needs)."""

        def go() -> Any:
            req = _txn_request(self.raw, compare, success, failure or [])
            try:
                return self.raw.kvstub.Txn(
                    req, self.raw.timeout, credentials=self.raw.call_credentials, metadata=self.raw.metadata
                )
            except grpc.RpcError as exc:
                self.raw._manage_grpc_errors(exc)  # marks a failed endpoint (failover), re-raises typed

        return self.call(what, go)

    def count_op(self, key: str, *, prefix: bool = True) -> Any:
        """A ``RequestOp`` counting the keys under ``key`` (or ``key`` itself when not ``prefix``);
        no values cross the wire."""
        req = self.raw._build_get_range_request(key, range_end(key) if prefix else None, count_only=True)
        return etcdrpc.RequestOp(request_range=req)

    def keys_op(self, prefix: str) -> Any:
        """A ``RequestOp`` listing the keys under ``prefix`` with their leases; no values."""
        req = self.raw._build_get_range_request(prefix, range_end(prefix), keys_only=True)
        return etcdrpc.RequestOp(request_range=req)

    def revoke(self, lease_id: int) -> None:
        """Revoke one lease now (its records vanish at once) and stop keeping it alive."""
        keepalives = self.connection.keepalives
        for ka in [k for k in keepalives if k.lease_id == lease_id]:
            ka.stop_event.set()
            keepalives.remove(ka)
        self._revoke(lease_id)

    def close(self, revoke: bool = True) -> None:
        """Stop keep-alives and (by default) revoke the leases, so every record on them vanishes at
        once. A client over another's connection leaves the connection and its leases to that one."""
        if not self._owner:
            return
        keepalives = self.connection.keepalives
        for ka in keepalives:
            ka.stop_event.set()
            if revoke:
                self._revoke(ka.lease_id)
        keepalives.clear()
        self.raw.close()

    def _revoke(self, lease_id: int) -> None:
        """One revoke attempt (errors ignored: the lease then expires on its own), and one more with a
        fresh token when etcd rejected the token (an idle client's token may have expired)."""
        conn = self.connection
        reauth = None if self.config.user is None else (lambda: conn.reauthenticate(conn.token))
        revoke_lease(self.raw, lease_id, reauth)

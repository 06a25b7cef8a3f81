"""The etcd connection of one namespace: keys, bounded retries, transactions, leases, watches.

Everything else in the catalog goes through :class:`EtcdClient`; it knows nothing of sessions,
versions or readers, only how to talk to etcd without hanging and without leaking leases.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable, TypeVar

import grpc
import pyetcd
import pyetcd.etcdrpc as etcdrpc
import pyetcd.exceptions as etcd_exc
import pyetcd.watch as etcd_watch
from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

from astate_store.model import codec
from astate_store.errors import CatalogAuthError, CatalogError, CatalogRejected, CatalogUnavailable
from astate_store.catalog.config import EtcdConfig, option

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


def _grpc_error(exc: BaseException | None) -> grpc.RpcError | None:
    """The gRPC error behind ``exc`` (pyetcd re-raises UNAVAILABLE and friends as its own types)."""
    seen = 0
    while exc is not None and seen < 4:
        if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _status(exc: BaseException | None) -> tuple[grpc.StatusCode | None, str]:
    """(gRPC status code, details) of the error behind ``exc``; (None, "") when there is none."""
    g = _grpc_error(exc)
    if g is None:
        return None, ""
    try:
        code = g.code()
        details = g.details() if callable(getattr(g, "details", None)) else ""
    except Exception:  # a grpc error object without a status
        return None, ""
    return code, details or ""


def _token_rejected(exc: BaseException) -> bool:
    """etcd did not accept this client's auth token (expired, server restarted, auth store changed):
    what a fresh token fixes (etcd's own client refreshes its token on the same answers)."""
    code, details = _status(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return True
    return code == grpc.StatusCode.INVALID_ARGUMENT and ("auth store is old" in details
                                                          or "user name is empty" in details)


class WatchRefused(etcd_exc.Etcd3Exception):
    """etcd created and at once cancelled a watch: no read permission on the key (or no valid token;
    etcd 3.5 gives no reason then), or another reason it names."""

    @property
    def denied(self) -> bool:
        reason = str(self)
        return not reason or "permission denied" in reason


class WatchStreamEnded(etcd_exc.Etcd3Exception):
    """Given to watch callbacks when their stream ended without an error (closed, re-authenticated)."""


class _WatchStub:
    """etcd's Watch stub, remembering the stream it opened (so :meth:`_Watcher.close` can end it)."""

    def __init__(self, channel: Any):
        self._stub = etcdrpc.WatchStub(channel)
        self.call: Any = None

    def Watch(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (the gRPC method's name)
        self.call = self._stub.Watch(*args, **kwargs)
        return self.call


class _Watcher(etcd_watch.Watcher):
    """pyetcd's watcher, plus: a watch etcd refuses (``created`` and ``canceled`` in one answer, what
    etcd does without read permission) raises :class:`WatchRefused` instead of looking created and
    never firing; :meth:`close` ends the stream (etcd keeps a stream open after the client stops
    sending, so pyetcd's close alone leaves it and its watches behind), and its callbacks get an
    exception (never None), so their owners re-watch on a new stream."""

    def close(self) -> None:
        super().close()
        call = getattr(self._watch_stub, "call", None)
        if call is not None:
            call.cancel()

    def add_callback(self, key: Any, callback: Callable[[Any], None], **kwargs: Any) -> Any:
        def cb(resp: Any) -> None:
            callback(WatchStreamEnded("watch stream ended") if resp is None else resp)

        return super().add_callback(key, cb, **kwargs)

    def _handle_response(self, rs: Any) -> None:
        if rs.created and rs.canceled and not rs.compact_revision:
            with self._lock:
                pending = self._new_watch
                if pending is not None and pending.id is None:
                    pending.err = WatchRefused(rs.cancel_reason)
                    self._new_watch_cond.notify_all()
            return
        super()._handle_response(rs)


# ---- telling a TLS mismatch from an etcd that does not answer -----------------------------------

_PROBE_TIMEOUT = 3.0  # a busy etcd (or host) can take over a second to answer the probe's request
_PROBE_INTERVAL = 0.5  # at most one probe per endpoint per this many seconds
# gRPC's words for a failed TLS handshake (what the probe cannot explain is trusted after a few tries)
_HANDSHAKE_WORDS = ("handshake", "ssl", "tls", "certificate")
_HANDSHAKE_TRIES = 3


def _split_host(netloc: str) -> tuple[str, int]:
    host, _, port = netloc.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _speaks_plain_http(host: str, port: int) -> bool:
    """Whether ``host:port`` answers a plain HTTP/1.1 request (etcd's client port without TLS does)."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT) as s:
            s.settimeout(_PROBE_TIMEOUT)
            s.sendall(f"GET /version HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return s.recv(16).startswith(b"HTTP/1.")
    except OSError:
        return False


def _plain_port(netloc: str, reason: str) -> str:
    return (f"etcd at {netloc} does not speak TLS (its client port is plain http), but this client uses "
            f"TLS (an https:// endpoint or {option('etcd_ca')}): use http://{netloc}, or start etcd with "
            f"--cert-file/--key-file and https:// client URLs ({reason})")


def _probe_tls(config: EtcdConfig, netloc: str) -> str | None:
    """Why this client's TLS settings cannot talk to the etcd at ``netloc``, when a direct probe
    (one TCP connection, one TLS handshake, bounded by 3 s each) shows it; None when it cannot tell
    (nothing listens, no answer in time, or the handshake works)."""
    host, port = _split_host(netloc)
    try:
        raw = socket.create_connection((host, port), timeout=_PROBE_TIMEOUT)
    except OSError:
        return None  # nothing listens (yet): etcd is down, not misconfigured
    with raw:
        raw.settimeout(_PROBE_TIMEOUT)
        if not config.tls:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            try:
                with ctx.wrap_socket(raw, server_hostname=host):
                    pass
            except (OSError, ValueError):
                return None  # not TLS either: some other failure
            return (f"etcd at {netloc} speaks TLS, but this client connects in plain text (an http:// or "
                    f"scheme-less endpoint and no CA): use https://{netloc} in {option('etcd')} and set "
                    f"{option('etcd_ca')} to the CA that signed etcd's --cert-file")
        try:
            ctx = ssl.create_default_context(cafile=config.ca)
            if config.cert and config.key:
                ctx.load_cert_chain(config.cert, config.key)
        except (OSError, ValueError) as exc:
            return (f"the TLS files do not load ({exc}): check {option('etcd_ca')}, {option('etcd_cert')} "
                    f"and {option('etcd_key')} (PEM; the key must match the certificate)")
        try:
            with ctx.wrap_socket(raw, server_hostname=host) as tls:
                # A server that requires a client certificate may say so only after the handshake
                # (TLS 1.3): send one small request and read the first bytes of the answer.
                tls.sendall(f"GET /version HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                tls.recv(16)
        except ssl.SSLCertVerificationError as exc:
            which = f"{option('etcd_ca')} = {config.ca}" if config.ca else \
                f"the system's CAs (no {option('etcd_ca')} given)"
            return (f"etcd at https://{netloc} presents a certificate this client does not trust "
                    f"({exc.verify_message}; checked against {which}): set {option('etcd_ca')} to the CA "
                    "that signed etcd's --cert-file, and connect by a host name or address that certificate "
                    "names")
        except ssl.SSLError as exc:
            reason = str(getattr(exc, "reason", "") or exc)
            if "CERTIFICATE_REQUIRED" in reason or "BAD_CERTIFICATE" in reason or "UNKNOWN_CA" in reason:
                what = "a client certificate" if not config.cert else \
                    f"a client certificate signed by a CA it trusts (not {config.cert})"
                return (f"etcd at https://{netloc} requires {what} (it runs with --client-cert-auth): set "
                        f"{option('etcd_cert')} and {option('etcd_key')} ({reason})")
            return _plain_port(netloc, reason) if _speaks_plain_http(host, port) else None
        except (OSError, ValueError) as exc:
            # A plain etcd may simply close the connection on a ClientHello (a reset, not an SSL
            # alert): it is still a plain port when it answers plain HTTP.
            if _speaks_plain_http(host, port):
                return _plain_port(netloc, repr(exc))
            return None  # reset or silent mid-handshake, and not plain http: cannot tell
    return None


_RETRY_LOG_EVERY = 10.0  # seconds between WARNING lines about etcd not answering (per client)

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

    def __init__(self, raw: MultiEndpointEtcd3Client, lease_id: int, ttl: float,
                 reauth: Callable[[BaseException], None] | None = None):
        super().__init__(name=f"astate-lease-{lease_id:x}", daemon=True)
        self.raw, self.lease_id, self.ttl = raw, lease_id, ttl
        self.reauth = reauth  # called when etcd rejected the auth token: fetch a fresh one
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
                if self.reauth is not None and _token_rejected(exc):
                    self.reauth(exc)  # the next refresh carries a fresh token
                # One failed refresh is not fatal: etcd keeps the lease for the whole ttl.
                if time.monotonic() - last_ok > self.ttl:
                    self.lost = True
                    log.error("lease %x lost: etcd unreachable for %.1fs (%s)", self.lease_id, self.ttl, exc)
                    return
            except ValueError:  # grpc's "Channel closed": the client closed while this refresh was starting
                if self.stop_event.is_set() or self.stop_event.wait(1.0):
                    return
                raise


class EtcdClient:
    """One namespace's connection to etcd.

    Args:
        endpoint: an :class:`~astate_store.catalog.config.EtcdConfig` (endpoints, TLS, credentials),
            or ``host:port`` / ``https://host:port`` (comma-separated for several etcd members; no
            credentials).
        namespace: keys live under ``/astate/<namespace>/`` (validated by :class:`Catalog`).
        lease_ttl: seconds without keep-alive after which a lease (a rank, a reader) expires.
        op_timeout: seconds for one etcd request.
        retry_deadline: seconds of retries with backoff before :class:`CatalogUnavailable`.

    With a user, the client authenticates on its first request and sends the token with every
    request, watch and lease keep-alive; a token etcd no longer accepts (simple tokens expire after
    ``--auth-token-ttl``, 5 min by default) is replaced once and the request retried.
    """

    def __init__(self, endpoint: str | EtcdConfig, namespace: str, *, lease_ttl: float, op_timeout: float,
                 retry_deadline: float):
        self.config = EtcdConfig.parse(endpoint)
        self.endpoint, self.namespace = self.config.url, namespace
        self.lease_ttl, self.op_timeout, self.retry_deadline = lease_ttl, op_timeout, retry_deadline
        self.prefix = f"/astate/{namespace}/"
        items = list(self.config.endpoints)
        several = len(items) > 1
        creds = self.config.channel_credentials() if self.config.tls else None
        eps = []
        for item in items:
            host, _, port = item.rpartition(":")
            # pyetcd skips an endpoint for time_retry seconds after a request to it failed (while all
            # are skipped it raises NoServerAvailableError, which call() retries). One endpoint: 0
            # (pyetcd's default would refuse it for 5 min after one failure). Several: a short hold, so
            # the retry in call() goes to another member (with 0 the client stays on a dead member).
            eps.append(Endpoint(host or "127.0.0.1", int(port), secure=self.config.tls, creds=creds,
                                time_retry=2.0 if several else 0.0,
                                opts=[("grpc.max_receive_message_length", 64 << 20)]))
        # pyetcd starts on a random member: clients spread over the cluster. Credentials are not given
        # to pyetcd: it would authenticate once, untyped and unretried, and never refresh the token.
        self.raw = MultiEndpointEtcd3Client(endpoints=eps, timeout=op_timeout, failover=several)
        self.raw.get_watcher = self._new_watcher  # type: ignore[method-assign]
        self._keepalives: list[_KeepAlive] = []
        self._reader_lease: int | None = None
        self.rpcs = 0  # etcd requests (attempts) made on callers' paths, for the control-plane figures
        self.background_rpcs = 0  # ... and by background work (retention)
        self.retries = 0  # attempts etcd did not answer, retried after a backoff (Store.stats, metrics)
        self._retry_logged = -1e9  # when an outage was last logged at WARNING (rate limit)
        self._outage = False  # a retry was logged and no request has succeeded since
        # Guards the shared reader lease: several consumer threads may register at once.
        self._lock = threading.Lock()
        # Authentication: the current token (None before the first request), and whether etcd said
        # its authentication is off (then requests go without a token, as etcd's own client does).
        self._auth_lock = threading.Lock()
        self._token: str | None = None
        self._auth_off = False
        self.authentications = 0
        # Endpoints that answered once (their TLS settings work: no more probing) and when each was
        # last probed after a failure.
        self._verified: set[str] = set()
        self._probed: dict[str, float] = {}

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    # ---- authentication ----------------------------------------------------------------------

    def _new_watcher(self) -> etcd_watch.Watcher:
        """A watch stream for the endpoint in use, carrying the current token."""
        return _Watcher(_WatchStub(self.raw.channel), timeout=self.raw.timeout,
                        call_credentials=None, metadata=self.raw.metadata)

    def _authenticate(self) -> None:
        """Get a token for the configured user. ``_auth_lock`` held."""
        user, password = self.config.user, self.config.password
        assert user is not None and password is not None
        req = etcdrpc.AuthenticateRequest(name=user, password=password)
        try:
            resp = self.raw.authstub.Authenticate(req, self.op_timeout)
        except grpc.RpcError as exc:
            code, details = _status(exc)
            if code == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in details:
                log.warning("etcd at %s has authentication disabled; %s is not used", self.endpoint,
                            option("etcd_user"))
                self._auth_off = True
                return
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.PERMISSION_DENIED):
                raise CatalogAuthError(
                    f"etcd at {self.endpoint} refused to authenticate user {user!r} ({code.name}: {details}): "
                    f"check {option('etcd_user')} and {option('etcd_password')}") from exc
            self.raw._manage_grpc_errors(exc)  # marks a failed endpoint (failover), re-raises typed
        self.authentications += 1
        self._token = str(resp.token)
        self.raw.metadata = (("token", self._token),)
        self.raw.call_credentials = None  # metadata works on plain and TLS channels alike
        # A watch stream keeps the token it was opened with: later watches open a new stream; the old
        # one is ended (its callbacks get the error and their owners re-watch).
        old = self.raw._stubs.pop("watcher", None)
        if old is not None:
            old.close()

    def _ensure_token(self) -> None:
        if self.config.user is None or self._token is not None or self._auth_off:
            return
        with self._auth_lock:
            if self._token is None and not self._auth_off:
                self._authenticate()

    def _reauthenticate(self, stale: str | None) -> None:
        """Replace the token ``stale`` (unless another thread already did)."""
        with self._auth_lock:
            if self._token == stale:
                log.info("etcd at %s rejected the auth token of %r; authenticating again", self.endpoint,
                         self.config.user)
                self._token, self._auth_off = None, False
                self._authenticate()

    def _reauth_quietly(self, exc: BaseException) -> None:
        """For the keep-alive threads: a fresh token, errors logged (the refresh is retried anyway)."""
        if self.config.user is None:
            return
        try:
            self._reauthenticate(self._token)
        except (CatalogError, *RETRYABLE) as err:
            log.warning("re-authenticating to etcd at %s failed: %s", self.endpoint, err)

    def _auth_problem(self, what: str, exc: BaseException) -> str | None:
        """What is wrong with this client's credentials or permissions, when etcd's answer says so."""
        code, details = _status(exc)
        user = self.config.user
        creds = f"{option('etcd_user')} and {option('etcd_password')}"
        if (isinstance(exc, WatchRefused) and exc.denied) or code == grpc.StatusCode.PERMISSION_DENIED:
            kind = "watch" if isinstance(exc, WatchRefused) else "request"
            if user is None:
                return (f"etcd at {self.endpoint} denied {what} ({kind}: permission denied) to a client "
                        f"without credentials: set {creds}")
            return (f"etcd at {self.endpoint} denied {what} to user {user!r} ({kind}: permission denied): its "
                    f"roles do not grant {'read' if kind == 'watch' else 'this'} access to {self.prefix}; an "
                    f"admin can run astate_store.etcd.security.grant_namespace(admin, {self.namespace!r}, {user!r}, "
                    f"password) (read_only=True for a consumer), or use {option('etcd_user')} of a user "
                    "who has such a role")
        if code == grpc.StatusCode.UNAUTHENTICATED or (code == grpc.StatusCode.INVALID_ARGUMENT and (
                "user name is empty" in details or "auth" in details)):
            if user is None:
                return (f"etcd at {self.endpoint} requires authentication and this client has no "
                        f"credentials ({code.name}: {details}): set {creds}")
            return (f"etcd at {self.endpoint} did not accept the credentials of user {user!r} during {what}, "
                    f"even with a fresh token ({code.name}: {details}): check {creds}")
        return None

    def _tls_problem(self, exc: BaseException, handshake_failures: int) -> str | None:
        """Why this client's TLS settings cannot talk to the endpoint that just failed, when it is a
        TLS mismatch (not etcd being down): probed directly (bounded), or, when the probe cannot tell
        but gRPC keeps reporting a failed handshake, gRPC's own words."""
        code, details = _status(exc)
        if code != grpc.StatusCode.UNAVAILABLE:
            return None
        netloc = getattr(self.raw, "_current_ep_label", None)
        if netloc is None or netloc in self._verified:
            return None
        now = time.monotonic()
        # The last try before gRPC's words probes again whatever the interval: the first probe may
        # have met a busy etcd.
        if now - self._probed.get(netloc, -1e9) >= _PROBE_INTERVAL or handshake_failures >= _HANDSHAKE_TRIES:
            self._probed[netloc] = now
            why = _probe_tls(self.config, netloc)
            if why is not None:
                return f"{why} [gRPC: {details}]"
        if handshake_failures >= _HANDSHAKE_TRIES:
            return (f"etcd at {netloc}: the TLS handshake keeps failing ({details}); check the endpoint's "
                    f"scheme (http:// or https://) in {option('etcd')}, {option('etcd_ca')}, "
                    f"{option('etcd_cert')} and {option('etcd_key')}")
        return None

    # ---- requests ----------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried with backoff while etcd does not answer, for at most ``retry_deadline``.

        Raises:
            CatalogUnavailable: etcd did not answer within the retry budget.
            CatalogAuthError: TLS settings, credentials or permissions do not match etcd's: at once
                (a rejected token is first replaced once).
            CatalogRejected: etcd answered with a refusal (size, permission, invalid argument): at once.
        """
        deadline = time.monotonic() + self.retry_deadline
        delay = 0.05
        reauthenticated = False
        handshake_failures = 0
        retried = 0
        while True:
            if getattr(_BACKGROUND, "active", False):
                self.background_rpcs += 1
            else:
                self.rpcs += 1
            token = self._token
            try:
                self._ensure_token()
                token = self._token  # the token this attempt carries
                result = fn()
                if retried and self._outage:
                    self._outage = False  # once per outage, not once per caller that waited it out
                    log.info("etcd at %s answers again (%s after %d retries)", self.endpoint, what, retried)
                if len(self._verified) < len(self.config.endpoints):
                    label = getattr(self.raw, "_current_ep_label", None)
                    if label is not None:
                        self._verified.add(label)
                return result
            except (WatchRefused, *RETRYABLE) as exc:  # type: ignore[misc]
                if self.config.user is not None and not reauthenticated and (
                        (isinstance(exc, WatchRefused) and exc.denied) or _token_rejected(exc)):
                    reauthenticated = True  # an expired or stale token: once with a fresh one
                    self._reauthenticate(token)  # (a no-op when another thread already replaced it)
                    continue
                auth = self._auth_problem(what, exc)
                if auth is not None:
                    raise CatalogAuthError(auth) from exc
                if isinstance(exc, WatchRefused):
                    raise CatalogRejected(f"etcd at {self.endpoint} refused {what}: {exc}") from exc
                refused = _refusal(exc)
                if refused is not None:
                    raise CatalogRejected(f"etcd at {self.endpoint} refused {what}: {refused}") from exc
                _, details = _status(exc)
                low = details.lower()
                if self.config.tls and any(w in low for w in _HANDSHAKE_WORDS):
                    handshake_failures += 1
                tls = self._tls_problem(exc, handshake_failures)
                if tls is not None:
                    raise CatalogAuthError(tls) from exc
                if time.monotonic() + delay > deadline:
                    raise CatalogUnavailable(
                        f"etcd at {self.endpoint} unreachable for {self.retry_deadline:.0f}s during {what}: "
                        f"{type(exc).__name__}: {exc}" + (f" ({details})" if details else "")
                    ) from exc
                retried += 1
                self._retrying(what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except etcd_exc.WatchTimedOut as exc:
                # No answer to a watch request (etcd slow or down), or its stream was closed under it
                # (a re-authentication replaced the stream): again, while a whole wait fits the budget.
                if time.monotonic() + delay + self.op_timeout > deadline:
                    raise CatalogUnavailable(f"etcd at {self.endpoint}: watch for {what} not created within "
                                             f"{self.retry_deadline:.0f}s: {exc!r}") from exc
                retried += 1
                self._retrying(what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _retrying(self, what: str, exc: BaseException, delay: float) -> None:
        """Count a retry; an outage is logged at WARNING at most every ``_RETRY_LOG_EVERY`` seconds
        per client (each retry at DEBUG), so a long one does not flood the log."""
        self.retries += 1
        self._outage = True
        now = time.monotonic()
        if now - self._retry_logged >= _RETRY_LOG_EVERY:
            self._retry_logged = now
            log.warning("etcd at %s did not answer %s (%s: %s); retrying with backoff for up to %.0fs",
                        self.endpoint, what, type(exc).__name__, exc, self.retry_deadline)
        else:
            log.debug("etcd %s failed (%s); retrying in %.2fs", what, exc, delay)

    def txn(self, what: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None
            ) -> tuple[bool, list[Any]]:
        """One etcd transaction (with retries): (whether ``compare`` held, the responses)."""
        return self.call(what, lambda: self.raw.transaction(compare=compare, success=success,
                                                            failure=failure or []))

    def new_lease(self) -> int:
        """A fresh lease of ``lease_ttl`` seconds, kept alive by a thread until :meth:`close`."""
        lease = self.call("lease grant", lambda: self.raw.lease(max(1, int(round(self.lease_ttl)))))
        ka = _KeepAlive(self.raw, lease.id, self.lease_ttl, reauth=self._reauth_quietly)
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
            wid = self.call(f"watch {key}", lambda: self.raw.add_watch_callback(key, cb, **kwargs))
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

    def revoke(self, lease_id: int) -> None:
        """Revoke one lease now (its records vanish at once) and stop keeping it alive."""
        for ka in [k for k in self._keepalives if k.lease_id == lease_id]:
            ka.stop_event.set()
            self._keepalives.remove(ka)
        self._revoke(lease_id)

    def close(self, revoke: bool = True) -> None:
        """Stop keep-alives and (by default) revoke the leases, so every record on them vanishes at once."""
        for ka in self._keepalives:
            ka.stop_event.set()
            if revoke:
                self._revoke(ka.lease_id)
        self._keepalives.clear()
        self.raw.close()

    def _revoke(self, lease_id: int) -> None:
        """One revoke attempt (errors ignored: the lease then expires on its own), and one more with a
        fresh token when etcd rejected the token (an idle client's token may have expired)."""
        for attempt in range(2):
            try:
                self.raw.revoke_lease(lease_id)
                return
            except RETRYABLE as exc:
                if attempt or self.config.user is None or not _token_rejected(exc):
                    return
                try:
                    self._reauthenticate(self._token)
                except (CatalogError, *RETRYABLE):
                    return

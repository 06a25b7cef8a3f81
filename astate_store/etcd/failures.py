"""What an etcd error means: not answered (retry), refused (raise at once), or a stale token.

Pure classification of the exceptions pyetcd and gRPC raise; :meth:`EtcdClient._classify
<astate_store.etcd.client.EtcdClient._classify>` combines these with the client's own state
(credentials, TLS probes, the retry budget).
"""

from __future__ import annotations

import grpc
import pyetcd.exceptions as etcd_exc

from astate_store.etcd.config import option

__all__ = [
    "RETRYABLE",
    "WatchRefused",
    "WatchStreamEnded",
    "refusal",
    "grpc_status",
    "token_rejected",
    "auth_problem",
]


class WatchRefused(etcd_exc.Etcd3Exception):
    """etcd created and at once cancelled a watch: no read permission on the key (or no valid token;
    etcd 3.5 gives no reason then), or another reason it names."""

    @property
    def denied(self) -> bool:
        reason = str(self)
        return not reason or "permission denied" in reason


class WatchStreamEnded(etcd_exc.Etcd3Exception):
    """Given to watch callbacks when their stream ended without an error (closed, re-authenticated)."""


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
    grpc.StatusCode.INVALID_ARGUMENT: (
        "invalid request (for etcd, 'request is too large' past --max-request-bytes)"
    ),
    grpc.StatusCode.RESOURCE_EXHAUSTED: "message over a size limit",
    grpc.StatusCode.PERMISSION_DENIED: "permission denied",
    grpc.StatusCode.UNAUTHENTICATED: "not authenticated",
    grpc.StatusCode.OUT_OF_RANGE: "out of range",
    grpc.StatusCode.UNIMPLEMENTED: "not implemented by this etcd",
    grpc.StatusCode.NOT_FOUND: "not found",
    grpc.StatusCode.ALREADY_EXISTS: "already exists",
}


def refusal(exc: BaseException) -> str | None:
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


def grpc_status(exc: BaseException | None) -> tuple[grpc.StatusCode | None, str]:
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


def token_rejected(exc: BaseException) -> bool:
    """etcd did not accept this client's auth token (expired, server restarted, auth store changed):
    what a fresh token fixes (etcd's own client refreshes its token on the same answers)."""
    code, details = grpc_status(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return True
    return code == grpc.StatusCode.INVALID_ARGUMENT and (
        "auth store is old" in details or "user name is empty" in details
    )


def auth_problem(
    exc: BaseException, what: str, *, user: str | None, endpoint: str, prefix: str, namespace: str
) -> str | None:
    """What is wrong with a client's credentials or permissions, when etcd's answer says so; None
    when ``exc`` says nothing about them. ``what`` names the request, ``prefix`` the namespace's keys."""
    code, details = grpc_status(exc)
    creds = f"{option('etcd_user')} and {option('etcd_password')}"
    if (isinstance(exc, WatchRefused) and exc.denied) or code == grpc.StatusCode.PERMISSION_DENIED:
        kind = "watch" if isinstance(exc, WatchRefused) else "request"
        if user is None:
            return (
                f"etcd at {endpoint} denied {what} ({kind}: permission denied) to a client "
                f"without credentials: set {creds}"
            )
        return (
            f"etcd at {endpoint} denied {what} to user {user!r} ({kind}: permission denied): its "
            f"roles do not grant {'read' if kind == 'watch' else 'this'} access to {prefix}; an "
            f"admin can run astate_store.etcd.security.grant_namespace(admin, {namespace!r}, {user!r}, "
            f"password) (read_only=True for a consumer), or use {option('etcd_user')} of a user "
            "who has such a role"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED or (
        code == grpc.StatusCode.INVALID_ARGUMENT and ("user name is empty" in details or "auth" in details)
    ):
        if user is None:
            return (
                f"etcd at {endpoint} requires authentication and this client has no "
                f"credentials ({code.name}: {details}): set {creds}"
            )
        return (
            f"etcd at {endpoint} did not accept the credentials of user {user!r} during {what}, "
            f"even with a fresh token ({code.name}: {details}): check {creds}"
        )
    return None

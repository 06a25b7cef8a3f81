"""Authenticating to etcd: one request for a token, its refusals typed.

:class:`~astate_store.etcd.client.EtcdClient` asks for a token on its first request and again
when etcd rejects the one it has; it then sends the token with every request, watch and lease
keep-alive.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pyetcd.etcdrpc as etcdrpc

from astate_store.errors import CatalogAuthError
from astate_store.etcd.config import EtcdConfig, option
from astate_store.etcd.failures import grpc_status

__all__ = ["request_token"]

log = logging.getLogger("astate_store.catalog")


def request_token(raw: Any, config: EtcdConfig, op_timeout: float, endpoint: str) -> str | None:
    """A token for ``config``'s user from the etcd behind ``raw`` (a pyetcd client); None when
    etcd says its authentication is off (requests then go without a token, as etcd's own
    client does).

    Raises:
        CatalogAuthError: etcd refused the user name or password.
        pyetcd's typed errors (retryable) when etcd did not answer; the endpoint is marked failed
        (failover).
    """
    user, password = config.user, config.password
    assert user is not None and password is not None
    req = etcdrpc.AuthenticateRequest(name=user, password=password)
    try:
        resp = raw.authstub.Authenticate(req, op_timeout)
    except grpc.RpcError as exc:
        code, details = grpc_status(exc)
        if code == grpc.StatusCode.FAILED_PRECONDITION and "not enabled" in details:
            log.warning(
                "etcd at %s has authentication disabled; %s is not used", endpoint, option("etcd_user")
            )
            return None
        if code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.PERMISSION_DENIED,
        ):
            raise CatalogAuthError(
                f"etcd at {endpoint} refused to authenticate user {user!r} ({code.name}: {details}): "
                f"check {option('etcd_user')} and {option('etcd_password')}"
            ) from exc
        raw._manage_grpc_errors(exc)  # marks a failed endpoint (failover), re-raises typed
    return str(resp.token)

"""Keeping a lease alive: one thread per lease, refreshing every ttl/3."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pyetcd.client import MultiEndpointEtcd3Client

from astate_store.errors import CatalogError
from astate_store.etcd.failures import RETRYABLE, token_rejected

__all__ = ["KeepAlive", "revoke_lease"]

log = logging.getLogger("astate_store.catalog")


class KeepAlive(threading.Thread):
    """Refreshes a lease every ttl/3; after a refresh gap longer than the ttl the lease is lost.

    A failed refresh is retried soon (another member may answer at once), not a whole ttl/3 later.
    """

    def __init__(
        self,
        raw: MultiEndpointEtcd3Client,
        lease_id: int,
        ttl: float,
        reauth: Callable[[BaseException], None] | None = None,
    ):
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
                if self.reauth is not None and token_rejected(exc):
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


def revoke_lease(
    raw: MultiEndpointEtcd3Client, lease_id: int, reauthenticate: Callable[[], None] | None
) -> None:
    """One revoke attempt (errors ignored: the lease then expires on its own), and one more after
    ``reauthenticate()`` when etcd rejected the token (an idle client's token may have expired);
    ``reauthenticate`` None: the client has no user, so no token to refresh."""
    for attempt in range(2):
        try:
            raw.revoke_lease(lease_id)
            return
        except RETRYABLE as exc:
            if attempt or reauthenticate is None or not token_rejected(exc):
                return
            try:
                reauthenticate()
            except (CatalogError, *RETRYABLE):
                return

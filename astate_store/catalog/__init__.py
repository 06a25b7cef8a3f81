"""The control plane in etcd: sessions, layouts, versions, commits, readers.

:class:`Catalog` composes one object per role over a shared :class:`EtcdClient`:

    client       EtcdClient        keys, retries, transactions, leases, watches
    sessions     Sessions          publisher sessions and the epoch fence
    versions     Versions          layouts, pieces, commits, retention, reading commits
    readers      Readers           reader registration, retire/torn, delivery
    consumers    Consumers         consumer records (pre-pack requests; who is alive)
    replicas     Replicas          consumers re-serving a version (P2P fan-out)
    checkpoints  CheckpointIndex   the checkpoint index

Key layout under ``/astate/<namespace>/`` (see docs/protocol.md, "etcd key layout"):

    epoch                               counter: the newest session's epoch (fencing token)
    session                             session record, on rank 0's lease
    members/<epoch>/<rank>              member record, on that rank's lease
    manifests/<manifest_id>             manifest blob: names, dtypes, shapes, boxes of one rank (no lease)
    layouts/<epoch>/<rank>/<layout_id>  layout blob (strides, regions, offsets, transport), rank's lease
    versions/<step>/pieces/<epoch>/<rank>  piece record
    versions/<step>/commit              commit record
    versions/<step>/replicas/<group>/<member>  replica record (a consumer re-serving), on its lease
    layouts/replicas/<member>/<id>      that consumer's layout and manifest blobs, on its lease

A blob is a head record at its key plus chunks at ``<key>/<i>`` (``blobs.py``): records of any
size, compressed, never seen half-written.
    latest                              counter: newest committed step (only moves forward)
    readers/<step>/<reader_id>          reader record, on the consumer's lease
    delivered/<step>/<reader_id>        reader record: that consumer finished a good read of the step
    consumers/<reader_id>               consumer record (pre-pack requests), on the consumer's lease
    retired/<step>/<rank>               retired record: no new readers; rank will reuse the memory
    torn/<step>/<rank>                  retired record: rank changed the memory with readers still on it
    checkpoints/<step>                  checkpoint record
    recovery/<epoch>/<round>/plan       recovery_plan record: what every rank does, on the writer's lease
    recovery/<epoch>/<round>/ranks/<rank>  recovery_outcome record: that rank's result, on its lease
                                        (both written by ``astate_store.recovery.agreement``)

Steps and epochs are 20-digit zero-padded in keys and in the two counters, so lexical
order is numeric order and etcd can compare counters inside transactions.
"""

from __future__ import annotations

import logging
from typing import Any

from astate_store.catalog.checkpoints import CheckpointIndex
from astate_store.catalog.consumers import Consumers
from astate_store.catalog.readers import Readers
from astate_store.catalog.records import CheckpointEntry, Piece, Replica, Session, Version
from astate_store.catalog.replicas import Replicas
from astate_store.catalog.sessions import Sessions
from astate_store.catalog.shard_tables import Layout, Manifest
from astate_store.catalog.versions import Versions
from astate_store.errors import CatalogError
from astate_store.etcd.client import EtcdClient
from astate_store.etcd.config import EtcdConfig, check_namespace

log = logging.getLogger("astate_store.catalog")

__all__ = [
    "Catalog",
    "Session",
    "Piece",
    "Layout",
    "Manifest",
    "Replica",
    "Version",
    "CheckpointEntry",
    "EtcdClient",
    "EtcdConfig",
]


class Catalog:
    """One namespace's control plane in etcd.

    Args:
        endpoint: an :class:`EtcdConfig` (endpoints, TLS, credentials), or ``host:port`` /
            ``https://host:port`` (comma-separated for several etcd members; no credentials).
        namespace: the versioned state, e.g. ``"policy"``; namespaces never see each other's keys.
        retention: committed versions whose metadata is kept (older ones are deleted after each commit).
        lease_ttl: seconds without keep-alive after which a rank (or reader) is considered dead.
        op_timeout: seconds for one etcd request.
        retry_deadline: seconds of retries with backoff before :class:`CatalogUnavailable`.

    Raises:
        CatalogError: a bad namespace, or retention < 1.
    """

    def __init__(
        self,
        endpoint: str | EtcdConfig,
        namespace: str,
        *,
        retention: int = 4,
        lease_ttl: float = 10.0,
        op_timeout: float = 5.0,
        retry_deadline: float = 15.0,
        client: EtcdClient | None = None,
        retention_runner: Any = None,
    ):
        check_namespace(namespace)  # it becomes a key path segment: no '/' into another namespace
        if retention < 1:
            raise CatalogError(f"retention must be >= 1, got {retention}")
        self.etcd = EtcdConfig.parse(endpoint)
        self.endpoint, self.namespace, self.retention, self.lease_ttl = (
            self.etcd.url,
            namespace,
            retention,
            lease_ttl,
        )
        # ``client``: a namespace view over a connection many namespaces share (hub.py);
        # ``retention_runner``: their shared retention thread (see Versions).
        self.client = (
            client
            if client is not None
            else EtcdClient(
                self.etcd,
                namespace,
                lease_ttl=lease_ttl,
                op_timeout=op_timeout,
                retry_deadline=retry_deadline,
            )
        )
        self.sessions = Sessions(self.client)
        self.versions = Versions(self.client, self.sessions, retention, retention_runner)
        self.consumers = Consumers(self.client)
        self.readers = Readers(self.client, self.sessions, consumers=self.consumers)
        self.replicas = Replicas(self.client, self.readers)
        self.checkpoints = CheckpointIndex(self.client)

    @property
    def skipped_records(self) -> int:
        """Records read from etcd that failed their schema or key checks and were skipped
        (counted each time one is met, logged once per key and revision), over every role."""
        roles = (self.sessions, self.versions, self.readers, self.consumers, self.checkpoints)
        return sum(r.skips.count for r in roles)

    @property
    def session(self) -> Session | None:
        """This process's publisher session, or None when none is open."""
        return self.sessions.current

    def delete_all(self, *, force: bool = False) -> int:
        """Delete every key of this namespace (versions, manifests, layouts, sessions, consumers,
        the checkpoint index; checkpoint files in storage stay). Returns the keys deleted.

        Raises:
            CatalogError: a publisher session or a consumer is still live (its lease-held
                records exist), unless ``force``; or this store itself holds a session.
        """
        c = self.client
        if self.session is not None:
            raise CatalogError(
                f"namespace {self.namespace!r}: this store publishes to it; close it and delete "
                "from another store"
            )
        if not force:
            for family in ("members", "consumers"):
                pre = c.key(family) + "/"
                live = c.call(f"get {family}", lambda: list(c.raw.get_prefix(pre, keys_only=True)))
                if live:
                    raise CatalogError(
                        f"namespace {self.namespace!r} is in use: {len(live)} live {family} "
                        "records (their processes hold leases); stop them or pass force=True"
                    )
        pre = c.key("")
        resp = c.call("delete namespace", lambda: c.raw.delete_prefix(pre))
        deleted = int(getattr(resp, "deleted", 0))
        log.warning("namespace %s: deleted (%d keys)", self.namespace, deleted)
        return deleted

    def close(self, *, revoke: bool = True) -> None:
        """Stop keep-alives and revoke leases (members, layouts and readers vanish at once)."""
        self.readers.close()  # reads ended in the background: their delivered markers first
        self.versions.close()
        self.consumers.close()
        self.client.close(revoke=revoke)
        self.sessions.clear()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

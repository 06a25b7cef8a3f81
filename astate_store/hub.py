"""Many cheap sessions: thousands of single-writer namespaces in one process.

A :class:`~astate_store.Store` opened with :func:`~astate_store.connect` is a full session: its
own etcd connection (gRPC channel, watch stream), its own leases and keep-alive threads, its
own retention thread and its own UCX worker (with a progress thread). For an agentic rollout
process holding one small state per agent session that is thousands of each. A
:class:`SessionHub` opens ordinary ``Store`` objects that share instead:

    one etcd connection    ``_NamespaceClient``: a per-namespace :class:`EtcdClient` (its own key
                           prefix and request counters) over the hub client's
                           :class:`EtcdConnection` (channel, auth token, watch stream)
    one lease              every session's ``session`` / ``members`` / ``layouts`` records (each
                           namespace still has its own epoch counter and fence) — and one more
                           for consumer records, created when a store first reads
    one retention thread   ``catalog.background.Runner``: commits of every namespace poke one thread
    one UCX worker         ``NamespaceTransport``: a per-namespace view over one
                           :class:`UcxTransport`; its descriptor lists only its own
                           registrations, and its peer keys are qualified by the namespace

Closing one store deletes that namespace's records on the shared leases (as revoking its own
lease would) and releases its registrations and peers; the shared parts stay. Closing the hub
closes every store it opened, then the shared parts. A SIGKILLed hub process loses all its
sessions together when the shared lease expires.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from astate_store.catalog import Catalog
from astate_store.catalog.background import Runner
from astate_store.catalog.record_drops import RecordDrops
from astate_store.errors import CatalogError, TransportError
from astate_store.etcd.client import EtcdClient
from astate_store.etcd.config import EtcdConfig
from astate_store.etcd.supervisor import shared_endpoint
from astate_store.transport import Transport, UcxTransport
from astate_store.transport.base import RegionInfo

__all__ = ["SessionHub", "connect_many", "NamespaceTransport"]

log = logging.getLogger("astate_store.sessions")

# Keyword arguments of Store that the hub fixes for all its stores (they are shared parts).
_SHARED_OPTIONS = ("lease_ttl", "transport", "window")


# ---- etcd: one connection, one lease ---------------------------------------------------------------


class _SharedLeases:
    """The leases a hub's namespaces share on its one connection: the session lease every
    session's ``session`` / ``members`` / ``layouts`` records hang on, and the connection's reader
    lease. A namespace lets go of its records on them by deleting those records, never by
    revoking a lease the others hang on."""

    def __init__(self, client: EtcdClient):
        self.client = client  # the hub's: its connection is every namespace's
        self.drops = RecordDrops(client)  # closing namespaces' records, batched (a group commit)
        self.lock = threading.Lock()
        self.session: int | None = None  # the session lease (None before the first session)
        self.closing = False  # set when the hub closes: its leases go next, every record with them

    def session_lease(self) -> int:
        """The shared session lease; a fresh one once it was lost (the sessions on the lost one
        are fenced already: their member records expired)."""
        with self.lock:
            if self.session is None or self.client.connection.lost(self.session):
                self.session = self.client.new_lease()
            return self.session

    def take_session(self) -> int | None:
        """The session lease, no longer handed out (the hub revokes it as it closes)."""
        with self.lock:
            lease, self.session = self.session, None
            return lease

    def ids(self) -> set[int]:
        """The shared leases that exist now."""
        reader = self.client.connection.reader_lease_id
        return {x for x in (self.session, reader) if x is not None}

    def drop(self, namespace: str, prefix: str, leases: set[int]) -> None:
        """Delete namespace ``namespace``'s keys (under ``prefix``) held by ``leases``: what
        revoking a lease of its own would do (members, session and layouts vanish at once), in a
        few transactions. Errors are logged: the records then go when the hub's lease does."""
        if not leases:
            return
        try:
            self.drops.drop(prefix, frozenset(leases))  # closes that overlap share the round trips
        except CatalogError as exc:
            log.warning(
                "namespace %s: could not delete its records on the shared lease (%s); they go when "
                "the hub closes or dies",
                namespace,
                exc,
            )


class _OpenStores:
    """The stores a hub has open, by namespace (None while one opens): one writer per namespace."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stores: dict[str, Any] = {}
        self.closed = False  # the hub closed: no more opens

    def forget(self, namespace: str, client: EtcdClient) -> None:
        """The store of ``namespace`` over ``client`` closed: the namespace may be opened again."""
        with self.lock:
            store = self.stores.get(namespace)
            if store is not None and store.catalog.client is client:
                del self.stores[namespace]


class _NamespaceClient(EtcdClient):
    """One namespace's :class:`EtcdClient` over the hub's connection (channel, auth token, watch
    stream, reader lease): its own key prefix and request counters; ``new_lease`` hands out the
    hub's session lease; ``revoke`` / ``close`` delete this namespace's records on the shared
    leases instead of revoking leases other namespaces hang on."""

    def __init__(self, hub_client: EtcdClient, namespace: str, leases: _SharedLeases, stores: _OpenStores):
        super().__init__(
            hub_client.config,
            namespace,
            lease_ttl=hub_client.lease_ttl,
            op_timeout=hub_client.op_timeout,
            retry_deadline=hub_client.retry_deadline,
            connection=hub_client.connection,
        )
        self.leases, self.stores = leases, stores
        self.closed = False

    def new_lease(self) -> int:
        return self.leases.session_lease()

    def revoke(self, lease_id: int) -> None:
        if self.leases.closing:
            return  # the hub revokes its leases next: every record on them goes at once
        if lease_id in self.leases.ids():
            self.leases.drop(self.namespace, self.prefix, {lease_id})
        else:
            super().revoke(lease_id)

    def close(self, revoke: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if revoke and not self.leases.closing:  # a closing hub revokes the leases themselves
            self.leases.drop(self.namespace, self.prefix, self.leases.ids())
        self.stores.forget(self.namespace, self)


# ---- one UCX worker ---------------------------------------------------------------------------------


class _SharedTransport:
    """The hub's UCX worker (created at the first store that moves bytes), with registrations
    counted per owner: two namespaces registering one range share the region, and it is
    unregistered when the last of them lets go."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worker: UcxTransport | None = None
        self._refs: dict[int, int] = {}

    def get(self, mode: str, window: int) -> UcxTransport:
        with self.lock:
            if self.worker is None:
                self.worker = UcxTransport(mode=mode, window=window)  # type: ignore[arg-type]
            return self.worker

    def register(self, fn: Callable[[UcxTransport], int]) -> int:
        with self.lock:
            assert self.worker is not None
            region = fn(self.worker)
            self._refs[region] = self._refs.get(region, 0) + 1
            return region

    def unregister(self, region: int) -> None:
        with self.lock:
            n = self._refs.get(region, 0) - 1
            if n > 0:
                self._refs[region] = n
                return
            self._refs.pop(region, None)
            if self.worker is not None and not self.worker.closed:
                self.worker.unregister(region)

    def close(self) -> None:
        with self.lock:
            if self.worker is not None:
                self.worker.close()
            self._refs.clear()


class NamespaceTransport(Transport):
    """One store's view of the hub's UCX worker.

    Its region indices are its own (the descriptor it publishes lists only its registrations,
    so a layout stays as small as a lone store's); its peer keys are qualified by the
    namespace (the ``("pub", epoch, rank)`` of two namespaces are different peers). Reads go
    through the shared worker: plan rows carry the shared peer indices and local addresses."""

    kind = "ucx"

    def __init__(self, shared: _SharedTransport, worker: UcxTransport, namespace: str):
        self._shared, self._worker, self.namespace = shared, worker, namespace
        self._lock = threading.Lock()
        self._slots: list[int | None] = []  # local index -> shared region (None: freed)
        self._bases: list[int] = []
        self._free: list[int] = []
        self._closed = False

    @property
    def shared(self) -> UcxTransport:
        """The UCX transport every store of the hub shares."""
        return self._worker

    @property
    def closed(self) -> bool:
        return self._closed or self._worker.closed

    @property
    def num_regions(self) -> int:
        with self._lock:
            return sum(s is not None for s in self._slots)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"namespace {self.namespace!r}: transport is closed")

    def _add(self, fn: Callable[[UcxTransport], int]) -> int:
        with self._lock:
            self._check_open()
            region = self._shared.register(fn)
            if region in self._slots:  # idempotent per range, as the worker is
                self._shared.unregister(region)
                return self._slots.index(region)
            base = self._worker.region(region).base
            if len(self._free) > 64:  # a freed index is reused late, as the worker's own table does
                idx = self._free.pop(0)
                self._slots[idx], self._bases[idx] = region, base
            else:
                idx = len(self._slots)
                self._slots.append(region)
                self._bases.append(base)
            return idx

    def register(self, address: int, nbytes: int, *, memory_type: str = "host") -> int:
        return self._add(lambda w: w.register(address, nbytes, memory_type=memory_type))

    def register_tensor(self, tensor: Any) -> int:
        return self._add(lambda w: w.register_tensor(tensor))

    def register_range(self, tensor: Any, address: int, nbytes: int) -> int:
        return self._add(lambda w: w.register_range(tensor, address, nbytes))

    def unregister(self, region: int) -> None:
        with self._lock:
            self._check_open()
            if not 0 <= region < len(self._slots):
                raise TransportError(f"no region {region} (have {len(self._slots)})")
            shared = self._slots[region]
            if shared is None:
                return
            self._slots[region] = None
            self._free.append(region)
        self._shared.unregister(shared)

    def region(self, region: int) -> RegionInfo:
        with self._lock:
            shared = self._slots[region]
            return RegionInfo(self._bases[region], 0, b"") if shared is None else self._worker.region(shared)

    def descriptor(self) -> dict[str, Any]:
        with self._lock:
            self._check_open()
            infos = [
                RegionInfo(self._bases[i], 0, b"") if s is None else self._worker.region(s)
                for i, s in enumerate(self._slots)
            ]
        return self._worker.descriptor(infos)

    def _key(self, peer: Hashable) -> Hashable:
        return (self.namespace, peer)

    def connect(self, peer: Hashable, descriptor: Mapping[str, Any]) -> int:
        self._check_open()
        return self._worker.connect(self._key(peer), descriptor)

    def disconnect(self, peer: Hashable) -> None:
        self._worker.disconnect(self._key(peer))

    def exited(self, descriptor: Mapping[str, Any]) -> bool:
        return self._worker.exited(descriptor)

    def peer_index(self, peer: Hashable) -> int:
        return self._worker.peer_index(self._key(peer))

    @property
    def peers(self) -> list[Hashable]:
        return [
            k[1]
            for k in self._worker.peers
            if isinstance(k, tuple) and len(k) == 2 and k[0] == self.namespace
        ]

    def get(self, ops: np.ndarray, *, timeout: float | None = None) -> None:
        self._check_open()
        self._worker.get(ops, timeout=timeout)

    def close(self) -> None:
        """Release this namespace's registrations and peers; the shared worker stays."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions = [s for s in self._slots if s is not None]
            self._slots = [None] * len(self._slots)
        if self._worker.closed:
            return
        for peer in self.peers:
            self._worker.disconnect(self._key(peer))
        for r in regions:
            self._shared.unregister(r)


# ---- the hub --------------------------------------------------------------------------------------


class SessionHub:
    """Opens many single-writer namespaces in one process, sharing one etcd connection, one
    lease, one retention thread and one UCX worker (module docstring).

    Args:
        etcd: etcd's endpoints (as :func:`~astate_store.connect`; None: ``$ASTATE_ETCD``, else the
            embedded etcd), or an :class:`EtcdConfig`; ``etcd_ca`` ... ``etcd_password`` as there.
        lease_ttl: seconds after which the hub's sessions count as dead once it stops (all at once).
        transport, window: the shared UCX worker's mode and read window.
        **options: any other :class:`~astate_store.Store` option, the default of every
            :meth:`open` (which may override them per namespace); ``prepack`` defaults to False
            here (small states are read whole).

    Raises:
        CatalogError: a malformed endpoint or half a credential.
        TypeError: an option :class:`Store` does not take.
    """

    def __init__(
        self,
        *,
        etcd: str | Sequence[str] | EtcdConfig | None = None,
        etcd_ca: str | None = None,
        etcd_cert: str | None = None,
        etcd_key: str | None = None,
        etcd_user: str | None = None,
        etcd_password: str | None = None,
        lease_ttl: float = 10.0,
        transport: str = "auto",
        window: int = 256,
        op_timeout: float = 5.0,
        retry_deadline: float = 15.0,
        **options: Any,
    ):
        from astate_store.store import Store  # store.py imports nothing of this module

        self._store_cls = Store
        _check_options(options, Store)
        self.config = EtcdConfig.from_args(
            etcd or None,
            ca=etcd_ca,
            cert=etcd_cert,
            key=etcd_key,
            user=etcd_user,
            password=etcd_password,
            default_endpoint=shared_endpoint,
        )
        self.lease_ttl, self.transport_mode, self.window = float(lease_ttl), transport, int(window)
        # Small session states are read whole: pre-packing copies would save readers nothing and
        # cost each put a read of the consumer records (and each session a watch).
        self.options = {"prepack": False, **options}
        self.client = EtcdClient(
            self.config, "_hub", lease_ttl=lease_ttl, op_timeout=op_timeout, retry_deadline=retry_deadline
        )
        """The one etcd connection (its key prefix is unused: each store has a namespace view)."""
        self._leases = _SharedLeases(self.client)
        self._open = _OpenStores()
        self._runner = Runner("astate-retention-hub")
        self._transport = _SharedTransport()

    # ---- shared parts ---------------------------------------------------------------------

    @property
    def lease_id(self) -> int | None:
        """The lease every session of the hub hangs on (None before the first session)."""
        return self._leases.session

    @property
    def transport(self) -> UcxTransport | None:
        """The UCX worker every store of the hub shares (None before one moved bytes)."""
        return self._transport.worker

    @property
    def namespaces(self) -> list[str]:
        """Namespaces open in this hub now."""
        with self._open.lock:
            return list(self._open.stores)

    def __len__(self) -> int:
        return len(self._open.stores)

    def _transport_factory(self, namespace: str) -> Callable[[str, int], Transport]:
        def make(mode: str, window: int) -> Transport:
            return NamespaceTransport(
                self._transport, self._transport.get(self.transport_mode, self.window), namespace
            )

        return make

    # ---- stores ---------------------------------------------------------------------------

    def open(
        self,
        namespace: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        retention: int | None = None,
        **options: Any,
    ) -> Any:
        """An ordinary :class:`~astate_store.Store` of ``namespace`` over the shared parts
        (``put``, ``get_into``, ``get``, ``recover``, ``close`` as usual). Its ``close`` leaves the
        hub and the other stores working.

        Raises:
            CatalogError: a bad namespace, one already open in this hub, or the hub is closed.
            TypeError: an option :class:`Store` does not take, or one the hub fixes.
        """
        _check_options(options, self._store_cls)
        stores = self._open
        with stores.lock:
            if stores.closed:
                raise CatalogError("the session hub is closed")
            if namespace in stores.stores:
                raise CatalogError(
                    f"namespace {namespace!r} is already open in this hub (one writer per namespace)"
                )
            stores.stores[namespace] = None  # reserved while it opens
        try:
            store = self._make(namespace, rank, world_size, retention, {**self.options, **options})
        except BaseException:
            with stores.lock:
                stores.stores.pop(namespace, None)
            raise
        with stores.lock:
            stores.stores[namespace] = store
        return store

    def _make(
        self, namespace: str, rank: int, world_size: int, retention: int | None, options: dict[str, Any]
    ) -> Any:
        keep = options.pop("retention", 4) if retention is None else retention
        view = _NamespaceClient(self.client, namespace, self._leases, self._open)
        catalog = Catalog(
            self.config,
            namespace,
            retention=keep,
            lease_ttl=self.lease_ttl,
            client=view,
            retention_runner=self._runner.job,
        )
        return self._store_cls(
            namespace,
            catalog=catalog,
            rank=rank,
            world_size=world_size,
            transport=self.transport_mode,
            lease_ttl=self.lease_ttl,
            window=self.window,
            transport_factory=self._transport_factory(namespace),
            **options,
        )

    def close(self) -> None:
        """Close every store of the hub (their records vanish), then the shared parts: the
        retention thread, the UCX worker, the leases and the etcd connection."""
        with self._open.lock:
            if self._open.closed:
                return
            self._open.closed = self._leases.closing = True
            stores = [s for s in self._open.stores.values() if s is not None]
        lease = self._leases.take_session()
        if lease is not None:
            # First, as each store's close would revoke its own: every session's members and
            # layouts vanish in one revision, so no new reader plans on memory about to be freed.
            self.client.revoke(lease)
        for s in stores:
            try:
                s.close()
            except Exception as exc:  # closing goes on: the leases' revocation removes what is left
                log.warning("namespace %s: close failed: %s", s.namespace, exc)
        self._runner.close()
        self._transport.close()
        self.client.close(revoke=True)
        log.info("session hub closed (%d stores)", len(stores))

    def __enter__(self) -> SessionHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_options(options: Mapping[str, Any], store_cls: Any) -> None:
    """Raises TypeError for an option the hub fixes or :class:`Store` does not take."""
    import inspect

    fixed = [
        k
        for k in options
        if k in _SHARED_OPTIONS or k in ("catalog", "transport_factory", "endpoint", "etcd")
    ]
    if fixed:
        raise TypeError(f"SessionHub fixes {fixed} for all its stores: give them to SessionHub(...)")
    from astate_store.context import StoreOptions

    known = (
        set(inspect.signature(store_cls.__init__).parameters) | set(StoreOptions.__dataclass_fields__)
    ) - {"self", "namespace", "fields"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown Store options {unknown}")


def connect_many(*, etcd: str | Sequence[str] | EtcdConfig | None = None, **options: Any) -> SessionHub:
    """A :class:`SessionHub`: ``hub.open(namespace)`` returns a ``Store`` sharing the hub's etcd
    connection, lease, retention thread and UCX worker."""
    return SessionHub(etcd=etcd, **options)

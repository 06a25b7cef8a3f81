"""The public façade: ``connect`` -> ``Store.put`` / ``Store.get_into`` / ``Store.latest``.

A ``Store`` holds one namespace's roles and delegates to them (docs/architecture.md):

    put:      publisher (layout -> snapshot slot / in place / streamed -> catalog)
    get_into: consumer (catalog -> sources -> plan -> transport -> buffers), conversion
    serve:    serving (re-serving pulled buffers as a source)
    checkpoint / restore / recover: recovery (its façade part: recovery.StoreRecovery)
    stats, staging, meta, latest, wait, keys: store_state.StoreState (read-only)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from astate_store import metrics
from astate_store.catalog import Catalog, Version
from astate_store.context import StoreContext, StoreOptions, TransportFactory
from astate_store.errors import LayoutError
from astate_store.etcd.config import EtcdConfig
from astate_store.etcd.supervisor import shared_endpoint
from astate_store.get import kv
from astate_store.get.consumer import Consumer
from astate_store.get.conversion import Converter
from astate_store.model.layout import TensorLike, check_step
from astate_store.model.progress import Progress
from astate_store.model.state_dict import NonTensors, StateDictConverter, normalize
from astate_store.model.usermeta import encode_meta
from astate_store.put.publisher import Publisher
from astate_store.put.registry import Registry
from astate_store.put.serving import Serving
from astate_store.recovery import Recovery, StoreRecovery
from astate_store.store_state import StagingInfo, StoreState, check_wait

if TYPE_CHECKING:
    import torch

__all__ = ["connect", "Store", "StagingInfo"]

log = logging.getLogger("astate_store")


def connect(
    namespace: str,
    *,
    etcd: str | Sequence[str] | EtcdConfig | None = None,
    etcd_ca: str | None = None,
    etcd_cert: str | None = None,
    etcd_key: str | None = None,
    etcd_user: str | None = None,
    etcd_password: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    metrics_port: int | None = None,
    metrics_addr: str | None = None,
    **options: Any,
) -> Store:
    """Open the store of one namespace (one versioned state, e.g. ``"policy"``).

    Args:
        namespace: the state's name, ``[A-Za-z0-9_.-]{1,128}``.
        etcd: etcd's endpoints: ``host:port``, ``https://host:port`` (TLS) or ``http://host:port``,
            comma-separated or a list for a cluster (or an :class:`EtcdConfig`). None: ``$ASTATE_ETCD``,
            else the embedded single-host etcd (started or reused).
        etcd_ca: CA certificate (PEM) that signed etcd's server certificate; implies TLS.
        etcd_cert, etcd_key: client certificate and key (PEM), for etcd's ``--client-cert-auth``.
        etcd_user, etcd_password: etcd user (token authentication).
        rank: this process's publisher rank; default ``$RANK`` or 0.
        world_size: publisher group size; default ``$WORLD_SIZE`` or 1.
        metrics_port: serve Prometheus metrics at ``http://metrics_addr:PORT/metrics`` (0: any free
            port; see ``Store.metrics_port``); default ``$ASTATE_METRICS_PORT``, else no server.
        metrics_addr: the address that server binds; default ``$ASTATE_METRICS_ADDR`` or 127.0.0.1.
        **options: see :class:`Store`.

    Each ``etcd*`` argument left None is read from its environment variable: ``ASTATE_ETCD``,
    ``ASTATE_ETCD_CA``, ``ASTATE_ETCD_CERT``, ``ASTATE_ETCD_KEY``, ``ASTATE_ETCD_USER``,
    ``ASTATE_ETCD_PASSWORD``; an explicit argument always wins (so do ``metrics_port`` and
    ``metrics_addr`` over ``ASTATE_METRICS_PORT`` and ``ASTATE_METRICS_ADDR``).

    Raises:
        CatalogError: a malformed endpoint, half a credential, a TLS file that does not exist.
        ValueError: ``metrics_port`` (or ``$ASTATE_METRICS_PORT``) is not a port number.
        CatalogUnavailable: etcd could not be reached or started.
        CatalogAuthError: (at the first request) TLS settings, credentials or permissions that do
            not match etcd's.
    """
    if not etcd:
        etcd = None  # "" or []: as if not given (the embedded etcd)
    config = EtcdConfig.from_args(
        etcd,
        ca=etcd_ca,
        cert=etcd_cert,
        key=etcd_key,
        user=etcd_user,
        password=etcd_password,
        default_endpoint=shared_endpoint,
    )
    r = int(os.environ.get("RANK", 0)) if rank is None else rank
    w = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if metrics_port is None and os.environ.get("ASTATE_METRICS_PORT", "").strip():
        env = os.environ["ASTATE_METRICS_PORT"].strip()
        if not env.isdigit():
            raise ValueError(f"ASTATE_METRICS_PORT must be a port number (0: any free port), got {env!r}")
        metrics_port = int(env)
    addr = metrics_addr or os.environ.get("ASTATE_METRICS_ADDR") or "127.0.0.1"
    return Store(
        namespace, etcd=config, rank=r, world_size=w, metrics_port=metrics_port, metrics_addr=addr, **options
    )


class Store(StoreState, StoreRecovery):
    """A namespace's versioned tensors: publish with :meth:`put`, pull with :meth:`get_into`.

    Args:
        namespace, rank, world_size: as in :func:`connect`.
        endpoint: etcd's endpoints as a string (``host:port``, ``https://host:port``, comma-separated;
            no credentials, nothing read from the environment), or an :class:`EtcdConfig`.
        etcd: an :class:`EtcdConfig` (endpoints, TLS, credentials), e.g. ``EtcdConfig.from_env()``;
            give this or ``endpoint``.
        session_id: id shared by the ranks of one publisher group (default ``$ASTATE_SESSION_ID``, or
            torchrun's run id and restart count; ranks > 0 otherwise join the live session).
        options: the tunables, one frozen :class:`~astate_store.context.StoreOptions`; or give its
            fields as keywords (``transport="tcp"``, ``retention=8``, ``staging_depth=3``,
            ``replicas=1``, ...: each field is documented there).
        catalog, transport_factory: injected by :class:`~astate_store.SessionHub`, whose stores
            share one etcd connection, lease, retention thread and UCX worker; leave them None.

    Raises:
        TypeError: an unknown option, or not exactly one of ``endpoint`` and ``etcd``.
        ValueError: a bad ``replicas`` or ``replica_timeout``.
    """

    def __init__(
        self,
        namespace: str,
        *,
        endpoint: str | EtcdConfig | None = None,
        etcd: EtcdConfig | None = None,
        rank: int = 0,
        world_size: int = 1,
        session_id: str | None = None,
        options: StoreOptions | None = None,
        catalog: Catalog | None = None,
        transport_factory: TransportFactory | None = None,
        **fields: Any,
    ):
        self.namespace, self.rank, self.world_size = namespace, rank, world_size
        if options is not None and fields:
            raise TypeError(f"give options= or option keywords ({sorted(fields)}), not both")
        opts = options if options is not None else StoreOptions.of(fields)
        # catalog / transport_factory: parts shared by many stores of one process (SessionHub,
        # hub.py); a store given a catalog needs no endpoint.
        if catalog is None and (endpoint is None) == (etcd is None):
            raise TypeError(
                "Store needs exactly one of endpoint= (a string or EtcdConfig) and etcd= (an EtcdConfig)"
            )
        # The process's metrics server first: a taken port fails before anything is created.
        self.metrics_port: int | None = None
        """The port this process serves ``/metrics`` on (None: this store did not ask for it)."""
        if opts.metrics_port is not None:
            try:
                self.metrics_port = metrics.serve(opts.metrics_port, opts.metrics_addr)
            except OSError as exc:  # observability must not stop a trainer: say so, and go on
                log.warning(
                    "namespace %s: cannot serve metrics on %s:%s (%s); no /metrics from this process "
                    "(give each process on a host its own port, or 0)",
                    namespace,
                    opts.metrics_addr,
                    opts.metrics_port,
                    exc,
                )
        if catalog is None:
            config = EtcdConfig.parse(etcd if etcd is not None else endpoint)  # type: ignore[arg-type]
            catalog = Catalog(config, namespace, retention=opts.retention, lease_ttl=opts.lease_ttl)
        self.catalog = catalog
        self._ctx = StoreContext(
            namespace,
            self.catalog,
            opts,
            rank=rank,
            world_size=world_size,
            session_id=session_id or os.environ.get("ASTATE_SESSION_ID") or _torchrun_session(),
            affinity=opts.affinity_config(),
            **({} if transport_factory is None else {"transport_factory": transport_factory}),
        )
        registry = Registry(lambda: self._ctx.transport)
        self._publisher = Publisher(self._ctx, registry)
        self._converter = Converter(self._ctx)
        self._consumer = Consumer(self._ctx, self._converter)
        self._ctx.staging_bytes = lambda: (self._publisher.staging[0], self._converter.staging_bytes)
        self._serving = Serving(
            self._ctx, registry, lambda: (self._consumer.delivered_step, self._consumer.buffers.entries)
        )
        self._recovery = Recovery(
            self._ctx,
            self._publisher,
            lambda bufs, step, timeout: self.get_into(bufs, step=step, timeout=timeout),
        )
        # put / get_into take state_dict()-like mappings (DTensors, nested dicts): converted once per
        # call, reusing last call's objects so the validation caches hit (state_dict.py)
        self._put_sd, self._get_sd = (
            StateDictConverter("put(tensors)"),
            StateDictConverter("get_into(buffers)"),
        )
        self._closed = False
        log.info(
            "namespace %s: store opened (rank %d of %d, etcd %s)",
            namespace,
            rank,
            world_size,
            self.catalog.endpoint,
        )

    # ---- publishing ----------------------------------------------------------------------

    def put(
        self,
        step: int,
        tensors: Mapping[str, Any],
        *,
        copy: bool = True,
        non_tensors: NonTensors = "error",
        meta: Mapping[str, Any] | None = None,
    ) -> bool:
        """Publish this rank's piece of version ``step``.

        Args:
            step: the version number; ``latest`` only moves forward.
            tensors: names -> ``torch.Tensor`` (the whole tensor), ``Shard`` (a box of it), a list
                of ``Shard``s (several disjoint boxes of one tensor) or a DTensor (its box from its
                placements and mesh: FSDP2 ``Shard(0)`` even when uneven, ``Shard(n)``, ``Replicate``
                — replicas —, 2-D meshes, ``_StridedShard``); e.g. ``model.state_dict()``. Nested
                mappings are flattened to dotted names as torch DCP names them. The very same
                memory under several names (tied weights) is staged once, published under each name.
            copy: True (default): snapshot into registered staging memory; the caller may change
                its tensors as soon as ``put`` returns. False: publish the tensors' memory in place
                (no copy); the caller must call :meth:`retire` before changing them.
            non_tensors: ``"error"`` (default): a non-tensor entry (an optimizer's ``step``
                count, a config value) raises ``LayoutError``; ``"skip"``: such entries are left out.
            meta: a small dict stored with this rank's piece (RNG states, counters, dataloader
                position; msgpack types, at most ``usermeta.MAX_META_BYTES`` encoded): it commits
                with the version and checkpoints keep it; read it back with :meth:`meta`.

        Returns:
            True if this put completed the version (all ranks have put it).

        Raises:
            LayoutError: bad names, dtypes, boxes, overlapping boxes of one name, a ``Partial``
                DTensor, a non-tensor entry (before anything is published).
            StaleSessionError: a newer session of the namespace fenced this one.
            CatalogUnavailable: etcd unreachable.
            ReplicationTimeout: with ``replicas=K``, fewer than K replica servers held the
                committed version within ``replica_timeout``.
        """
        encoded = encode_meta(meta)  # checked before anything is published
        tensors = self._put_sd.convert(tensors, non_tensors)
        return self._publisher.publish(step, tensors, copy=copy, meta=encoded)

    def delete(self, step: int) -> None:
        """Drop committed version ``step`` from the catalog now (as retention would later):
        consumers no longer find it; publishers reuse its staging as usual. The newest step
        cannot be deleted alone: use :func:`astate_store.catalog.namespaces.delete_namespace`.

        Raises:
            VersionNotFound: ``step`` is not committed. CatalogError: it is the newest.
        """
        self.catalog.versions.delete_step(check_step(step, LayoutError))

    def retire(self, timeout: float | None = None) -> int:
        """Before changing tensors published with ``copy=False``: mark those versions retired and
        wait (bounded) for their in-flight readers. Readers that were still reading discard their
        bytes and retry on a newer version. Returns the number of readers that had not finished.

        Raises:
            StaleSessionError: the session was fenced.
        """
        return self._publisher.retire(timeout)

    # ---- consuming -----------------------------------------------------------------------

    def get_into(
        self,
        buffers: Mapping[str, Any],
        *,
        step: int | None = None,
        timeout: float | None = None,
        non_tensors: NonTensors = "error",
        progress: Progress | None = None,
    ) -> int:
        """Pull the newest committed version >= ``step`` into preallocated buffers, in place.

        Args:
            buffers: names -> preallocated ``torch.Tensor`` (the whole tensor), ``Shard`` (a box),
                a list of ``Shard``s (disjoint boxes of one tensor) or a DTensor (its local tensor is
                filled in place), any strides; a nested mapping such as ``{"model":
                model.state_dict()}`` is flattened as in :meth:`put`. A subset of the published
                names is fine; a buffer under several names (tied weights) is filled once. A
                floating buffer of another floating dtype than the published one is converted
                during the pull.
            step: the oldest acceptable step (None: any committed version).
            timeout: seconds to wait for that version (None: wait indefinitely for the commit;
                each pull is still bounded by ``read_timeout``).
            non_tensors: as in :meth:`put`.
            progress: ``progress(done_bytes, total_bytes)`` as the pull's batches complete (for
                the first pull of a big model; :mod:`astate_store.model.progress`). With it, the batched
                reads go in parts of 64 MiB.

        Returns:
            The step delivered; every buffer holds bytes of that step only.

        Raises:
            LayoutError: unknown name, or shape/box/dtype that does not fit (before any byte moves).
            WaitTimeout: no such version committed in time.
            PeerUnreachable: a publisher died or did not answer within ``read_timeout``.
            TornReadError: the version kept being retired under the reader (too many retries).
        """
        step, timeout = check_wait(step, timeout, "get_into")
        buffers = self._get_sd.convert(buffers, non_tensors)
        if self._serving.active:
            self._serving.withdraw()  # these buffers may be among the re-served ones: withdraw before writing
        return self._consumer.get_into(buffers, step, timeout, progress)

    def forget(self, buffers: Mapping[str, Any] | None = None) -> None:
        """With ``delta=True``: the buffers of the last :meth:`get_into` no longer hold the step it
        delivered (the caller wrote into them, or loaded other weights): the next pull into them
        moves every byte. New buffers are whole anyway; so is the pull after a failed one.
        ``buffers``: the buffers forgotten (None: whichever this store's last pull filled)."""
        self._consumer.forget(None if buffers is None else self._get_sd.convert(buffers, "skip"))

    def serve(self, step: int, buffers: Mapping[str, TensorLike], *, group: str | None = None) -> None:
        """Offer buffers that :meth:`get_into` just filled with ``step`` as an extra source of that
        step, so later consumers and recovering publishers can pull from this process instead of
        the trainers. Members of one ``group`` (e.g. the TP ranks of one rollout instance) together
        serve whole tensors; a process holding whole tensors can serve alone (the default group).
        The next :meth:`get_into` withdraws the offer first (waiting, bounded, for its readers).

        Raises:
            LayoutError: the buffers were not all filled with ``step`` by this store.
        """
        self._serving.serve(step, normalize(buffers, "serve(buffers)"), group)

    def unserve(self) -> int:
        """Withdraw every re-served step; returns readers that had not finished within the wait."""
        return self._serving.withdraw()

    def get(
        self,
        names: Sequence[str] | str | None = None,
        *,
        step: int | None = None,
        timeout: float | None = None,
        device: Any = "cpu",
        progress: Progress | None = None,
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Allocate and fetch: the newest committed version >= ``step`` as whole tensors (their
        global shape and published dtype) on ``device``, all of one step. ``names``: a subset
        (default every tensor); ``progress`` as in :meth:`get_into`. One :meth:`get_into` fills
        them, from the publishers, replica servers or re-serving consumers; when the newest version changes
        its tensors between
        the listing and the pull, ``get`` lists it again (bounded).

        Returns:
            (the step, name -> tensor).

        Raises:
            LayoutError: names the version does not publish (all named), or bad arguments.
            WaitTimeout, PeerUnreachable, TornReadError: as :meth:`get_into`.
        """
        step, timeout = check_wait(step, timeout, "get")
        return kv.get(
            self.catalog, _GetReads(self), names, step=step, timeout=timeout, device=device, progress=progress
        )

    # ---- lifetime ------------------------------------------------------------------------

    def drain(self, timeout: float) -> int:
        """Wait, bounded by ``timeout`` seconds, until every live consumer of the namespace has
        finished reading the newest version this rank put, or has left; then a publisher may exit
        without cutting a reader off its last version. Live consumers are those with a consumer
        record (every store registers one on its first ``get_into``), those that have not started
        that read yet included; a consumer that died holds the drain no longer than its lease
        (``lease_ttl``). This store's own pulls do not count. Returns how many consumers had
        neither read it nor left (0: drained; also when this store never put).

        Raises:
            LayoutError: ``timeout`` is not a number of seconds >= 0.
        """
        _step, t = check_wait(None, timeout, "drain")
        if t is None:
            raise LayoutError("drain(timeout=...) needs a number of seconds >= 0, got None")
        return self._publisher.drain(t)

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Leave the session (members, layouts and readers vanish at once) and free memory.

        With ``drain=True``, first :meth:`drain` (bounded by ``timeout``, default
        ``retire_timeout``): every live consumer reads the newest version this rank put, or
        leaves, before this rank's memory goes.

        Memory that peers may be reading right now — re-served buffers, snapshot slots, tensors
        published in place — is withdrawn or retired first (readers waited for up to
        ``retire_timeout``, then told their bytes are torn), so no reader keeps bytes of memory
        that is freed or handed back to the caller."""
        if self._closed:
            return
        if drain:
            _step, t = check_wait(None, timeout, "close")
            try:
                self._publisher.drain(self._ctx.options.retire_timeout if t is None else t)
            except Exception as exc:  # closing goes on: an unreachable etcd must not keep a rank alive
                log.warning("close(drain=True): drain failed: %s", exc)
        self._closed = True
        for what, release in (
            ("re-served buffers", self._serving.withdraw),
            ("published steps", self._publisher.retire_all),
        ):
            try:
                release()
            except Exception as exc:  # closing goes on; readers of that memory then fail or retry
                log.warning("close(): could not withdraw %s: %s", what, exc)
        self._recovery.close()
        self._converter.close()
        self._consumer.close()
        # the converters keep the last call's tensors: drop them with the store (see Publisher.close)
        self._put_sd, self._get_sd = (
            StateDictConverter("put(tensors)"),
            StateDictConverter("get_into(buffers)"),
        )
        self.catalog.close()
        self._ctx.close_transport()
        self._publisher.close()
        self._ctx.stats.close()  # its counters stay in /metrics; its gauges leave
        log.info("namespace %s: store closed", self.namespace)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _torchrun_session() -> str | None:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return f"{run}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return None


class _GetReads:
    """What ``kv.get`` pulls with: the store's consumer, withdrawing the store's re-served offer
    before a pull as ``get_into`` does."""

    def __init__(self, store: Store):
        self._store, self._consumer = store, store._consumer
        self.begin, self.end = self._consumer.begin, self._consumer.end

    def get_into(
        self,
        buffers: Mapping[str, Any],
        step: int,
        timeout: float | None,
        progress: Progress | None,
        *,
        begun: Version,
    ) -> int:
        if self._store._serving.active:
            self._store._serving.withdraw()
        return self._consumer.get_into(buffers, step, timeout, progress, begun=begun)

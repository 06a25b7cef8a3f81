"""The public façade: ``connect`` -> ``Store.put`` / ``Store.get_into`` / ``Store.latest``.

A ``Store`` owns one namespace's roles, each an object given what it uses, and delegates to them
(docs/architecture.md):

    put:        publisher (layout -> snapshot slot / in place / streamed -> catalog)
    get_into:   pulls -> consumer (catalog -> sources -> plan -> transport -> buffers), converter
    serve:      serving (re-serving pulled buffers as a source)
    checkpoint / restore / meta: checkpointing (``recovery/checkpointing.py``)
    recover:    recovery (``recovery/recovery.py``), agreeing through ``recovery/agreement.py``
    latest, wait, keys, stats, staging: read from the catalog and the roles
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astate_store import metrics
from astate_store.catalog import Catalog
from astate_store.context import StoreContext, StoreOptions, TransportFactory
from astate_store.errors import LayoutError
from astate_store.etcd.config import EtcdConfig
from astate_store.etcd.supervisor import shared_endpoint
from astate_store.get import kv
from astate_store.get.consumer import Consumer
from astate_store.get.conversion import Converter
from astate_store.metrics import Stats
from astate_store.model.layout import TensorLike, check_step
from astate_store.model.progress import Progress
from astate_store.model.state_dict import NonTensors, StateDictConverter, normalize
from astate_store.model.usermeta import decode_meta, encode_meta
from astate_store.pulls import Pulls
from astate_store.put.publisher import Publisher
from astate_store.put.registry import Registry
from astate_store.put.serving import Serving
from astate_store.recovery.agreement import RecoveryAgreement
from astate_store.recovery.checkpointing import Checkpointing
from astate_store.recovery.recovery import Recovery
from astate_store.transport import Transport
from astate_store.transport.topology import AffinityChoice

if TYPE_CHECKING:
    import torch

__all__ = ["connect", "Store", "StagingInfo"]

log = logging.getLogger("astate_store")


@dataclass(frozen=True)
class StagingInfo:
    """Staging memory a store holds: the snapshot pool (``snapshot_slots`` versions of this
    rank's tensors, on ``device``) and the consumer's conversion staging."""

    snapshot_bytes: int
    snapshot_slots: int
    device: str | None
    conversion_bytes: int


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


class Store:
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
        # The roles, each given the objects it uses (caller memory is registered by one registry,
        # shared by the publisher and serving).
        registry = Registry(self._ctx)
        self._publisher = Publisher(self._ctx, registry)
        self._converter = Converter(self._ctx)
        self._consumer = Consumer(self._ctx, self._converter)
        self._serving = Serving(self._ctx, registry, self._consumer)
        self._pulls = Pulls(self._consumer, self._serving)
        self._checkpointing = Checkpointing(self._ctx, self._publisher)
        agreement = RecoveryAgreement(self.catalog.client, self.catalog.sessions)
        self._recovery = Recovery(self._ctx, self._publisher, self._pulls, agreement, self._checkpointing)
        # Store.stats and /metrics read the figures these objects own when they are taken.
        self._ctx.stats.live = LiveFigures(self.catalog, agreement, self._publisher, self._converter)
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
        return self._pulls.get_into(buffers, step, timeout, progress)  # withdraws a re-served offer first

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

    def offer(self) -> Serving:
        """A further re-serving offer over this store's pulls, independent of :meth:`serve`'s: its own
        registrations, its own ``serve(step, buffers, group)`` and ``withdraw()``. A process that
        holds several buffer sets of one namespace (a replica server: one being read while the next
        fills) offers each on its own, withdrawing one while the other stays served."""
        return Serving(self._ctx, Registry(self._ctx), self._consumer)

    def serving_memory(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory to pull into and re-serve from: on this store's NUMA node and
        memfd-backed, so same-host readers map it instead of copying through a socket."""
        import torch

        cpu = torch.device("cpu")
        self._ctx.ensure_transport(cpu)
        return self._ctx.alloc(nbytes, cpu, shared=True)

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
            self.catalog, self._pulls, names, step=step, timeout=timeout, device=device, progress=progress
        )

    # ---- state (read-only) -----------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        return self._ctx.transport

    @property
    def stats(self) -> Stats:
        """This store's figures now, as a frozen :class:`~astate_store.Stats`: cumulative counters
        (pulls, bytes, torn retries, failovers, plans, puts, bad records, etcd requests and
        retries), gauges (staging, registrations, latest and delivered step) and ``last_pull``
        (the last ``get_into``'s step, bytes, reads and seconds per phase). The same figures as
        ``/metrics`` (docs/metrics.md)."""
        return self._ctx.stats.snapshot()

    @property
    def affinity(self) -> AffinityChoice | None:
        """The NUMA/NIC choice made when the transport was created (None before)."""
        return self._ctx.affinity

    @property
    def consumer_id(self) -> str:
        """This store's id as a consumer (its ``readers/`` and ``consumers/`` keys)."""
        return self._ctx.reader_id

    @property
    def staging(self) -> StagingInfo:
        nbytes, slots, device = self._publisher.staging
        return StagingInfo(nbytes, slots, device, self._converter.staging_bytes)

    def meta(
        self, step: int | None = None, *, rank: int | None = None, uri: str | None = None
    ) -> dict[str, Any]:
        """The small dict publisher rank ``rank`` (default: this store's rank) gave as
        ``put(step, ..., meta=...)``; ``{}`` when it gave none.

        Args:
            step: the version (None: the newest committed one, or with ``uri`` the newest
                checkpoint there).
            uri: read it from the checkpoint at ``uri`` instead of the catalog. Without it, a step
                the catalog no longer holds is read from the checkpoint :meth:`restore` (or
                :meth:`recover`) filled the buffers from.

        Raises:
            VersionNotFound: the step is not committed (nor restored here).
            CheckpointNotFound, CheckpointCorrupted: reading it from a checkpoint failed.
            CatalogCorrupted: its record in etcd is bad.
        """
        if step is not None:
            step = check_step(step, LayoutError)
        r = self.rank if rank is None else rank
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise LayoutError(f"meta(rank={rank!r}): a rank is an int >= 0")
        data = self._checkpointing.meta(step, r, uri)
        return {} if data is None else decode_meta(data, f"meta of step {step} rank {r}")

    def latest(self) -> int | None:
        """The newest committed step, or None before the first commit.

        Raises:
            CatalogUnavailable: etcd unreachable within the retry budget.
        """
        return self.catalog.versions.latest()

    def wait(self, step: int | None = None, timeout: float | None = None) -> int:
        """Block until a version >= ``step`` is committed (any when None); returns the newest step.

        Raises:
            WaitTimeout: none within ``timeout`` seconds.
        """
        step, timeout = check_wait(step, timeout, "wait")
        return self.catalog.versions.wait_for(step, timeout=timeout)

    def keys(self, step: int | None = None) -> dict[str, kv.KeyInfo]:
        """What committed version ``step`` holds (the newest when None; ``{}`` before the first
        commit): name -> :class:`~astate_store.get.kv.KeyInfo` (``global_shape``, ``dtype``,
        ``nbytes``), read from the version's manifests — so it works after its writer is gone.

        Raises:
            VersionNotFound: ``step`` is not committed (or retention dropped it).
        """
        if step is not None:
            step = check_step(step, LayoutError)
        return kv.keys(self.catalog, step)

    # ---- checkpoints and recovery --------------------------------------------------------

    def checkpoint(
        self,
        step: int,
        uri: str,
        *,
        asynchronous: bool = False,
        progress: Progress | None = None,
        timeout: float = 60.0,
        keep_last: int | None = None,
        keep_every: int | None = None,
    ) -> Any:
        """Write this rank's shards of version ``step`` to storage (any ``pyarrow.fs`` URI or local
        path); the rank that completes the set commits it and records it in the catalog. Every
        publisher rank calls it, right after its ``put(step)``: it first waits (up to ``timeout``)
        for the other ranks' pieces to commit the step. Replicated shards are written by one rank only.

        Args:
            asynchronous: wait for the commit and snapshot the shards now, write in a background
                thread; returns a ``concurrent.futures.Future`` of the same result.
            progress: ``progress(done_bytes, total_bytes)`` as this rank's part is written
                (:mod:`astate_store.model.progress`).
            timeout: seconds to wait for ``step`` to commit.
            keep_last: retention: once this checkpoint is complete, remove older complete
                checkpoints under ``uri`` (storage and catalog) except the ``keep_last`` newest;
                the newest, any a restore is reading, and incomplete ones are never removed
                (docs/checkpoint.md "Retention"). None: keep everything.
            keep_every: with ``keep_last``, also keep the oldest checkpoint of every window of
                ``keep_every`` steps (the steps ``n * keep_every`` when checkpoints fall on them).

        Returns:
            True if the checkpoint is complete after this call (it is then in the catalog).

        Raises:
            CheckpointNotCommitted: ``step`` did not commit within ``timeout``, or never can (the
                session was fenced, a newer step committed, a rank whose piece is missing is gone);
                it names the ranks whose pieces are missing.
            CheckpointError: this rank no longer holds the step, bad arguments, or a storage error.
        """
        return self._checkpointing.checkpoint(
            step, uri, asynchronous, progress, timeout, keep_last, keep_every
        )

    def restore(
        self,
        buffers: Mapping[str, Any],
        *,
        uri: str | None = None,
        step: int | None = None,
        progress: Progress | None = None,
        non_tensors: NonTensors = "error",
    ) -> int:
        """Fill preallocated buffers of any layout from a checkpoint: ``uri`` (newest complete step
        there, or ``step``), else the newest complete checkpoint the catalog knows. ``progress``:
        ``progress(done_bytes, total_bytes)`` as bytes are copied (:mod:`astate_store.model.progress`).

        Raises:
            CheckpointNotFound: no complete checkpoint; CheckpointCorrupted: checksum or file errors;
            LayoutError: a buffer that does not fit.
        """
        buffers = normalize(buffers, "restore(buffers)", non_tensors)
        return self._checkpointing.restore(buffers, uri, step, progress)

    def recover(
        self,
        tensors: Mapping[str, Any],
        *,
        timeout: float = 60.0,
        uri: str | None = None,
        non_tensors: NonTensors = "error",
    ) -> int | None:
        """For a (re)started publisher rank: fence the previous session, fill this rank's
        preallocated ``tensors`` with the newest committed state — from live sources (surviving
        replicas, consumers that re-serve it) or else the newest complete checkpoint — and
        republish it in the new session so consumers carry on.

        Every rank of the new session agrees on one step through etcd first (docs/protocol.md,
        "Session model"). A checkpoint older than the newest committed step is restored but not
        republished (it can never commit again); the next ``put`` must then use a step > ``latest()``.

        Returns:
            The recovered step, or None when nothing was ever committed or checkpointed.

        Raises:
            RecoveryError: no step every rank could fetch (naming the ranks and why), or a rank
                did not report within ``timeout``.
        """
        tensors = normalize(tensors, "recover(tensors)", non_tensors)
        return self._recovery.recover(tensors, timeout, uri)

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
        self._checkpointing.close()
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


def check_wait(step: object, timeout: object, what: str) -> tuple[int | None, float | None]:
    """A call's ``step`` (None or a step number) and ``timeout`` (None or seconds >= 0), checked
    before anything is waited on.

    Raises:
        LayoutError: naming the call and the bad argument.
    """
    if step is not None:
        step = check_step(step, LayoutError)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise LayoutError(
                f"{what}(timeout=...) must be None or a number of seconds >= 0, got {timeout!r}"
            )
        timeout = float(timeout)
    return step, timeout  # type: ignore[return-value]


class LiveFigures:
    """The figures of ``Store.stats`` and ``/metrics`` that other objects own, read from them
    each time stats are taken (``StoreMetrics.live``): the etcd request counters and skipped
    records of the catalog and the recovery agreement, and the staging memory the publisher and
    the converter hold now."""

    def __init__(
        self, catalog: Catalog, agreement: RecoveryAgreement, publisher: Publisher, converter: Converter
    ):
        self.catalog, self.agreement = catalog, agreement
        self.publisher, self.converter = publisher, converter

    def __call__(self) -> dict[str, int]:
        client = self.catalog.client
        return {
            "bad_records": self.catalog.skipped_records + self.agreement.skips.count,
            "etcd_rpcs": client.rpcs,
            "etcd_background_rpcs": client.background_rpcs,
            "etcd_retries": client.retries,
            "snapshot_bytes": self.publisher.staging[0],
            "conversion_bytes": self.converter.staging_bytes,
        }

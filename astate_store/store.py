"""The public façade: ``connect`` -> ``Store.put`` / ``Store.get_into`` / ``Store.latest``.

A ``Store`` holds one namespace's roles and delegates to them (docs/architecture.md):

    put:      publisher (layout -> snapshot slot / in place / streamed -> catalog)
    get_into: consumer (catalog -> sources -> plan -> transport -> buffers), conversion
    serve:    serving (re-serving pulled buffers as a source)
    checkpoint / restore / recover: recovery
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .catalog import Catalog
from .catalog.config import EtcdConfig
from .context import StoreContext, StoreOptions
from .consumer import Consumer
from .conversion import Converter
from .etcd_server import shared_endpoint
from .errors import LayoutError
from .layout import TensorLike, check_step
from .publisher import Publisher
from .recovery import Recovery
from .registry import Registry
from .serving import Serving
from .topology import AffinityChoice, AffinityConfig
from .transport import Transport

__all__ = ["connect", "Store", "StagingInfo"]

log = logging.getLogger("astate_store")


def connect(namespace: str, *, etcd: str | Sequence[str] | EtcdConfig | None = None, etcd_ca: str | None = None,
            etcd_cert: str | None = None, etcd_key: str | None = None, etcd_user: str | None = None,
            etcd_password: str | None = None, rank: int | None = None, world_size: int | None = None,
            **options: Any) -> "Store":
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
        **options: see :class:`Store`.

    Each ``etcd*`` argument left None is read from its environment variable: ``ASTATE_ETCD``,
    ``ASTATE_ETCD_CA``, ``ASTATE_ETCD_CERT``, ``ASTATE_ETCD_KEY``, ``ASTATE_ETCD_USER``,
    ``ASTATE_ETCD_PASSWORD``; an explicit argument always wins.

    Raises:
        CatalogError: a malformed endpoint, half a credential, a TLS file that does not exist.
        CatalogUnavailable: etcd could not be reached or started.
        CatalogAuthError: (at the first request) TLS settings, credentials or permissions that do
            not match etcd's.
    """
    if not etcd:
        etcd = None  # "" or []: as if not given (the embedded etcd)
    config = EtcdConfig.from_args(etcd, ca=etcd_ca, cert=etcd_cert, key=etcd_key, user=etcd_user,
                                  password=etcd_password, default_endpoint=shared_endpoint)
    r = int(os.environ.get("RANK", 0)) if rank is None else rank
    w = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    return Store(namespace, etcd=config, rank=r, world_size=w, **options)


@dataclass(frozen=True)
class StagingInfo:
    """Staging memory a store holds: the snapshot pool (``snapshot_slots`` versions of this
    rank's tensors, on ``device``) and the consumer's conversion staging."""

    snapshot_bytes: int
    snapshot_slots: int
    device: str | None
    conversion_bytes: int


class Store:
    """A namespace's versioned tensors: publish with :meth:`put`, pull with :meth:`get_into`.

    Args:
        namespace, rank, world_size: as in :func:`connect`.
        endpoint: etcd's endpoints as a string (``host:port``, ``https://host:port``, comma-separated;
            no credentials, nothing read from the environment), or an :class:`EtcdConfig`.
        etcd: an :class:`EtcdConfig` (endpoints, TLS, credentials), e.g. ``EtcdConfig.from_env()``;
            give this or ``endpoint``.
        transport: ``"auto"`` (shared memory + cma on one host), ``"shm"`` or ``"tcp"`` (several hosts).
        session_id: id shared by the ranks of one publisher group (default ``$ASTATE_SESSION_ID``, or
            torchrun's run id and restart count; ranks > 0 otherwise join the live session).
        retention: committed versions whose metadata etcd keeps.
        lease_ttl: seconds after which a silent process counts as dead.
        staging_depth: snapshot slots (versions live at once) of the publisher's pool.
        staging_cap_bytes: the most staging memory this store may use, for snapshots and for
            dtype conversion on pull (chunks are pipelined through it). A snapshot larger than the
            cap is streamed from the tensors themselves: ``put`` then returns once the live
            consumers have pulled it.
        read_timeout: seconds one batched pull may take before ``PeerUnreachable``.
        retire_timeout: seconds a publisher waits for readers before reusing memory.
        window: outstanding UCX requests per pull.
        affinity: NUMA/NIC affinity (:class:`~astate_store.topology.AffinityConfig`); None reads
            ``ASTATE_AFFINITY`` / ``ASTATE_NUMA_NODE``; False turns it off.
        prepack: consumers ask publishers for contiguous copies of pieces they would otherwise read
            as many small runs (the planner's cost model decides), and publishers build them in
            their snapshot slots.
    """

    def __init__(self, namespace: str, *, endpoint: str | EtcdConfig | None = None, etcd: EtcdConfig | None = None,
                 rank: int = 0, world_size: int = 1,
                 transport: str = "auto", session_id: str | None = None, retention: int = 4,
                 lease_ttl: float = 10.0, staging_depth: int = 2, staging_cap_bytes: int | None = None,
                 read_timeout: float = 120.0, retire_timeout: float = 30.0, window: int = 256,
                 affinity: AffinityConfig | bool | None = None, prepack: bool = True):
        self.namespace, self.rank, self.world_size = namespace, rank, world_size
        if (endpoint is None) == (etcd is None):
            raise TypeError("Store needs exactly one of endpoint= (a string or EtcdConfig) and etcd= (an EtcdConfig)")
        config = EtcdConfig.parse(etcd if etcd is not None else endpoint)  # type: ignore[arg-type]
        self.catalog = Catalog(config, namespace, retention=retention, lease_ttl=lease_ttl)
        options = StoreOptions(transport, staging_depth, staging_cap_bytes, read_timeout, retire_timeout, window,
                               prepack)
        if affinity is False:
            affinity = AffinityConfig(enabled=False)
        self._ctx = StoreContext(
            namespace, self.catalog, options, rank=rank, world_size=world_size,
            session_id=session_id or os.environ.get("ASTATE_SESSION_ID") or _torchrun_session(),
            affinity=affinity if isinstance(affinity, AffinityConfig) else AffinityConfig.from_env())
        registry = Registry(lambda: self._ctx.transport)
        self._publisher = Publisher(self._ctx, registry)
        self._converter = Converter(self._ctx)
        self._consumer = Consumer(self._ctx, self._converter)
        self._serving = Serving(self._ctx, registry,
                                lambda: (self._consumer.delivered_step, self._consumer.buffers.entries))
        self._recovery = Recovery(self._ctx, self._publisher,
                                  lambda bufs, step, timeout: self.get_into(bufs, step=step, timeout=timeout))
        self._closed = False

    # ---- state ---------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        return self._ctx.transport

    @property
    def stats(self) -> dict[str, int]:
        """Counters: ``plans``, ``plan_hits``, ``torn_retries`` (discarded reads), ``reads`` and
        ``local_conversions`` (of the last pull), ``streamed_puts``, ``layouts_published``, and
        ``skipped_records`` (bad records read from etcd and skipped; see README "Blobs")."""
        self._ctx.stats["skipped_records"] = self.catalog.skipped_records
        return self._ctx.stats

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
        step, timeout = _check_wait(step, timeout, "wait")
        return self.catalog.versions.wait_for(step, timeout=timeout)

    # ---- publishing ----------------------------------------------------------------------

    def put(self, step: int, tensors: Mapping[str, TensorLike], *, copy: bool = True) -> bool:
        """Publish this rank's piece of version ``step``.

        Args:
            step: the version number; ``latest`` only moves forward.
            tensors: names -> ``torch.Tensor`` (the whole tensor) or ``Shard`` (a box of it).
            copy: True (default): snapshot into registered staging memory; the caller may change
                its tensors as soon as ``put`` returns. False: publish the tensors' memory in place
                (no copy); the caller must call :meth:`retire` before changing them.

        Returns:
            True if this put completed the version (all ranks have put it).

        Raises:
            LayoutError: bad names, dtypes, boxes (before anything is published).
            StaleSessionError: a newer session of the namespace fenced this one.
            CatalogUnavailable: etcd unreachable.
        """
        entries = self._publisher.begin(tensors, "put(tensors)", every_step=True)
        return self._publisher.put(step, entries, copy=copy)

    def retire(self, timeout: float | None = None) -> int:
        """Before changing tensors published with ``copy=False``: mark those versions retired and
        wait (bounded) for their in-flight readers. Readers that were still reading discard their
        bytes and retry on a newer version. Returns the number of readers that had not finished.

        Raises:
            StaleSessionError: the session was fenced.
        """
        return self._publisher.retire(timeout)

    # ---- consuming -----------------------------------------------------------------------

    def get_into(self, buffers: Mapping[str, TensorLike], *, step: int | None = None,
                 timeout: float | None = None) -> int:
        """Pull the newest committed version >= ``step`` into preallocated buffers, in place.

        Args:
            buffers: names -> preallocated ``torch.Tensor`` (the whole tensor) or ``Shard`` (a box),
                any strides; a subset of the published names is fine. A floating buffer of another
                floating dtype than the published one is converted during the pull.
            step: the oldest acceptable step (None: any committed version).
            timeout: seconds to wait for that version (None: wait indefinitely for the commit;
                each pull is still bounded by ``read_timeout``).

        Returns:
            The step delivered; every buffer holds bytes of that step only.

        Raises:
            LayoutError: unknown name, or shape/box/dtype that does not fit (before any byte moves).
            WaitTimeout: no such version committed in time.
            PeerUnreachable: a publisher died or did not answer within ``read_timeout``.
            TornReadError: the version kept being retired under the reader (too many retries).
        """
        step, timeout = _check_wait(step, timeout, "get_into")
        if self._serving.active:
            self._serving.withdraw()  # these buffers may be among the re-served ones: withdraw before writing
        return self._consumer.get_into(buffers, step, timeout)

    def serve(self, step: int, buffers: Mapping[str, TensorLike], *, group: str | None = None) -> None:
        """Offer buffers that :meth:`get_into` just filled with ``step`` as an extra source of that
        step, so later consumers and recovering publishers can pull from this process instead of
        the trainers. Members of one ``group`` (e.g. the TP ranks of one rollout instance) together
        serve whole tensors; a process holding whole tensors can serve alone (the default group).
        The next :meth:`get_into` withdraws the offer first (waiting, bounded, for its readers).

        Raises:
            LayoutError: the buffers were not all filled with ``step`` by this store.
        """
        self._serving.serve(step, buffers, group)

    def unserve(self) -> int:
        """Withdraw every re-served step; returns readers that had not finished within the wait."""
        return self._serving.withdraw()

    # ---- checkpoints and recovery ---------------------------------------------------------

    def checkpoint(self, step: int, uri: str, *, asynchronous: bool = False) -> Any:
        """Write this rank's shards of committed version ``step`` to storage (any ``pyarrow.fs``
        URI or local path); the rank that completes the set commits it and records it in the
        catalog. Every publisher rank calls it. Replicated shards are written by one rank only.

        Args:
            asynchronous: snapshot the shards and write in a background thread; returns a
                ``concurrent.futures.Future`` of the same result instead of waiting.

        Returns:
            True if the checkpoint is complete after this call (it is then in the catalog).

        Raises:
            CheckpointError: the step is not committed, or this rank no longer holds it.
        """
        return self._recovery.checkpoint(step, uri, asynchronous)

    def restore(self, buffers: Mapping[str, TensorLike], *, uri: str | None = None, step: int | None = None) -> int:
        """Fill preallocated buffers of any layout from a checkpoint: ``uri`` (newest complete step
        there, or ``step``), else the newest complete checkpoint the catalog knows.

        Raises:
            CheckpointNotFound: no complete checkpoint; CheckpointCorrupted: checksum or file errors;
            LayoutError: a buffer that does not fit.
        """
        return self._recovery.restore(buffers, uri, step)

    def recover(self, tensors: Mapping[str, TensorLike], *, timeout: float = 60.0, uri: str | None = None
                ) -> int | None:
        """For a (re)started publisher rank: fence the previous session, fill this rank's
        preallocated ``tensors`` with the newest committed state — from live sources (surviving
        replicas, consumers that re-serve it) or else the newest complete checkpoint — and
        republish it in the new session so consumers carry on.

        Every rank of the new session agrees on one step through etcd first (README "Session
        model"). A checkpoint older than the newest committed step is restored but not
        republished (it can never commit again); the next ``put`` must then use a step > ``latest()``.

        Returns:
            The recovered step, or None when nothing was ever committed or checkpointed.

        Raises:
            RecoveryError: no step every rank could fetch (naming the ranks and why), or a rank
                did not report within ``timeout``.
        """
        return self._recovery.recover(tensors, timeout, uri)

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the session (members, layouts and readers vanish at once) and free memory.

        Memory that peers may be reading right now — re-served buffers, snapshot slots, tensors
        published in place — is withdrawn or retired first (readers waited for up to
        ``retire_timeout``, then told their bytes are torn), so no reader keeps bytes of memory
        that is freed or handed back to the caller."""
        if self._closed:
            return
        self._closed = True
        for what, release in (("re-served buffers", self._serving.withdraw), ("published steps", self._publisher.retire_all)):
            try:
                release()
            except Exception as exc:  # closing goes on; readers of that memory then fail or retry
                log.warning("close(): could not withdraw %s: %s", what, exc)
        self._recovery.close()
        self._converter.close()
        self.catalog.close()
        self._ctx.close_transport()
        self._publisher.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_wait(step: object, timeout: object, what: str) -> tuple[int | None, float | None]:
    """A call's ``step`` (None or a step number) and ``timeout`` (None or seconds >= 0), checked
    before anything is waited on.

    Raises:
        LayoutError: naming the call and the bad argument.
    """
    if step is not None:
        step = check_step(step, LayoutError)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise LayoutError(f"{what}(timeout=...) must be None or a number of seconds >= 0, got {timeout!r}")
        timeout = float(timeout)
    return step, timeout  # type: ignore[return-value]


def _torchrun_session() -> str | None:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return f"{run}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return None


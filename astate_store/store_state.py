"""The read-only part of the ``Store`` façade: what a store and its namespace hold now.

``StoreState`` is a base of ``store.Store`` (as ``recovery.StoreRecovery`` is): its accessors read
the store's roles (transport, stats, staging) and the catalog (``latest``, ``wait``, ``keys``,
``meta``); nothing here changes state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from astate_store.catalog import Catalog
from astate_store.context import StoreContext
from astate_store.errors import LayoutError
from astate_store.get import kv
from astate_store.get.conversion import Converter
from astate_store.metrics import Stats
from astate_store.model.layout import check_step
from astate_store.model.usermeta import decode_meta
from astate_store.put.publisher import Publisher
from astate_store.recovery import Recovery
from astate_store.transport import Transport
from astate_store.transport.topology import AffinityChoice

__all__ = ["StagingInfo", "StoreState", "check_wait"]


@dataclass(frozen=True)
class StagingInfo:
    """Staging memory a store holds: the snapshot pool (``snapshot_slots`` versions of this
    rank's tensors, on ``device``) and the consumer's conversion staging."""

    snapshot_bytes: int
    snapshot_slots: int
    device: str | None
    conversion_bytes: int


class StoreState:
    """The ``Store`` accessors of its state and its namespace's versions (``store.Store`` sets the
    attributes below)."""

    rank: int
    catalog: Catalog
    _ctx: StoreContext
    _publisher: Publisher
    _converter: Converter
    _recovery: Recovery

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
        data = self._recovery.meta(step, r, uri)
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

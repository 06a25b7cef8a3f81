"""The public façade: ``connect`` -> ``Store.put`` / ``Store.get_into`` / ``Store.latest``.

put:  tensors -> layout (validate) -> staging (snapshot) or registration (zero-copy) -> catalog.
get:  catalog (wait, begin_read) -> plan (cached) -> transport (one batched get) -> buffers -> end_read.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Hashable, Mapping

import numpy as np
import torch

from . import codec, plan as planner
from .catalog import Catalog, CheckpointEntry, Layout, Version
from .errors import (
    CheckpointError,
    CheckpointNotFound,
    LayoutError,
    PeerUnreachable,
    TornReadError,
    TransportError,
    VersionNotFound,
    WaitTimeout,
)
from .etcd_server import shared_endpoint
from .layout import (
    Box,
    Shard,
    ShardRecord,
    TensorLike,
    TensorLayout,
    contiguous_strides,
    group_layouts,
    merge_tensor_layout,
    is_floating,
    itemsize,
    local_box,
    torch_dtype,
)
from .staging import SnapshotPool, StagingCapExceeded
from .topology import AffinityChoice, AffinityConfig, affinity_for, alloc_on_node, apply_env, pinned
from .transport import UcxTransport

__all__ = ["connect", "Store"]

log = logging.getLogger("astate_store")

_MAX_TORN_RETRIES = 8


@dataclass(frozen=True)
class _Group:
    """One set of sources that together hold whole tensors: the publishers, or a re-serving group.
    ``sources`` maps the planner's source id to (transport peer key, publisher rank or None, layout);
    a publisher's base offset (its staging slot) changes every step and is looked up per version."""

    gid: str
    layouts: Mapping[str, TensorLayout]
    sources: Mapping[int, tuple[Hashable, int | None, Layout]]
    key: object
    packed: tuple[ShardRecord, ...] = ()  # contiguous copies publishers built for this consumer
    shards_key: object = None  # the shard layout alone (packed copies left out)
    converted: tuple[ShardRecord, ...] = ()  # copies built in another dtype (converted on the publisher)


@dataclass(frozen=True)
class _Conversion:
    """A converted pull, ready to run: per chunk (transport ops into a staging half, the staging
    view in the source dtype, the destination view)."""

    name: str
    chunks: list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, eq=False)
class _Entry:
    """One validated user tensor: the local piece and where it sits in the global tensor."""

    name: str
    tensor: torch.Tensor
    box: Box
    global_shape: tuple[int, ...]
    dtype: str


def _validate(tensors: Mapping[str, TensorLike], what: str) -> list[_Entry]:
    if not isinstance(tensors, Mapping):
        raise LayoutError(f"{what} must map names to tensors or Shards, got {type(tensors).__name__}")
    if not tensors:
        raise LayoutError(f"{what} is empty")
    out = []
    for name in sorted(tensors):
        t, box, gshape, dtype = local_box(name, tensors[name])
        if t.device.type not in ("cpu", "cuda"):
            raise LayoutError(f"tensor {name!r}: device {t.device} is not supported (cpu or cuda)")
        out.append(_Entry(name, t, box, gshape, dtype))
    return out


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor view spans (first to one past last element)."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), (last + 1) * t.element_size()


def connect(namespace: str, *, etcd: str | None = None, rank: int | None = None, world_size: int | None = None,
            **options: Any) -> "Store":
    """Open the store of one namespace (one versioned state, e.g. ``"policy"``).

    Args:
        namespace: the state's name, ``[A-Za-z0-9_.-]{1,128}``.
        etcd: ``host:port`` of etcd (comma-separated for a cluster); None starts or reuses the
            embedded single-host etcd (``$ASTATE_ETCD`` wins when set).
        rank: this process's publisher rank; default ``$RANK`` or 0.
        world_size: publisher group size; default ``$WORLD_SIZE`` or 1.
        **options: see :class:`Store`.

    Raises:
        CatalogUnavailable: etcd could not be reached or started.
    """
    endpoint = etcd or shared_endpoint()
    r = int(os.environ.get("RANK", 0)) if rank is None else rank
    w = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    return Store(namespace, endpoint=endpoint, rank=r, world_size=w, **options)


class Store:
    """A namespace's versioned tensors: publish with :meth:`put`, pull with :meth:`get_into`.

    Args:
        namespace, endpoint, rank, world_size: as in :func:`connect`.
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

    def __init__(self, namespace: str, *, endpoint: str, rank: int = 0, world_size: int = 1,
                 transport: str = "auto", session_id: str | None = None, retention: int = 4,
                 lease_ttl: float = 10.0, staging_depth: int = 2, staging_cap_bytes: int | None = None,
                 read_timeout: float = 120.0, retire_timeout: float = 30.0, window: int = 256,
                 affinity: AffinityConfig | bool | None = None, prepack: bool = True):
        self.namespace, self.rank, self.world_size = namespace, rank, world_size
        self.catalog = Catalog(endpoint, namespace, retention=retention, lease_ttl=lease_ttl)
        self._session_id = session_id or os.environ.get("ASTATE_SESSION_ID") or _torchrun_session()
        self._transport_mode = transport
        self._transport: UcxTransport | None = None
        self._staging_depth, self._staging_cap = staging_depth, staging_cap_bytes
        self.read_timeout, self.retire_timeout, self.window = read_timeout, retire_timeout, window
        self._pool: SnapshotPool | None = None
        self._pool_device: torch.device | None = None
        self._conv_buf: torch.Tensor | None = None
        self._stage_lid: str | None = None  # layout of the snapshot slots
        self._inplace_lid: str | None = None  # layout of tensors published in place
        self._layout_sig: object = None
        self._zero_copy_live: list[int] = []
        self._registered: dict[tuple[int, int], int] = {}
        self._zero_copy_entries: list[_Entry] = []
        self._serving: list[tuple[int, str, str]] = []
        self._delivered_step: int | None = None
        self._async_ckpt: Any = None
        self._dest_fp: object = None
        self._dest_seen: list[tuple[str, object, int, int]] | None = None
        self._dest_entries: list[_Entry] = []
        self._fetcher: ThreadPoolExecutor | None = None
        self._reader_id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self._planner = planner.Planner()
        self._connected: dict[Hashable, str] = {}  # peer -> layout id its rkeys come from
        # Consumers spread over replicas and groups without talking to each other.
        self._rotation = zlib.crc32(self._reader_id.encode()) & 0xFFFF
        self._groups_cache: OrderedDict[object, dict[str, _Group]] = OrderedDict()
        self._ops_cache: OrderedDict[object, tuple[np.ndarray, list[_Conversion]]] = OrderedDict()
        self._closed = False
        self._prepack = prepack
        self._pack_key: object = None
        self._consumer_known = False
        self._packs_refused: tuple[object, ...] = ()
        if affinity is False:
            affinity = AffinityConfig(enabled=False)
        self._affinity_cfg = affinity if isinstance(affinity, AffinityConfig) else AffinityConfig.from_env()
        self.affinity: AffinityChoice | None = None
        self.stats: dict[str, int] = {"plans": 0, "plan_hits": 0, "torn_retries": 0, "reads": 0}

    # ---- shared --------------------------------------------------------------------------

    @property
    def transport(self) -> UcxTransport:
        return self._ensure_transport(None)

    def _ensure_transport(self, device: torch.device | None) -> UcxTransport:
        """Create the UCX context near the buffers' device: NIC choice via UCX_NET_DEVICES (unless
        the user set it) and the progress thread pinned to the local NUMA node (threads inherit
        the creating thread's CPU mask)."""
        if self._transport is None:
            self.affinity = affinity_for(device, self._affinity_cfg)
            apply_env(self.affinity)
            with pinned(self.affinity.cpus):
                self._transport = UcxTransport(mode=self._transport_mode, window=self.window)  # type: ignore[arg-type]
        return self._transport

    def wait(self, step: int | None = None, timeout: float | None = None) -> int:
        """Block until a version >= ``step`` is committed (any when None); returns the newest step.

        Raises:
            WaitTimeout: none within ``timeout`` seconds.
        """
        return self.catalog.wait_for(step, timeout=timeout)

    def _alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        node = self.affinity.numa_node if self.affinity is not None else None
        return alloc_on_node(nbytes, node)

    def latest(self) -> int | None:
        """The newest committed step, or None before the first commit.

        Raises:
            CatalogUnavailable: etcd unreachable within the retry budget.
        """
        return self.catalog.latest()

    def close(self) -> None:
        """Leave the session (members, layouts and readers vanish at once) and free memory."""
        if self._closed:
            return
        self._closed = True
        if self._async_ckpt is not None:
            self._async_ckpt.close()
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
        self.catalog.close()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._pool = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        entries = _validate(tensors, "put(tensors)")
        self._ensure_transport(entries[0].tensor.device)
        if self.catalog.session is None:
            self.catalog.open_session(rank=self.rank, world_size=self.world_size, session_id=self._session_id)
        if copy:
            try:
                lid, base = self._stage(step, entries)
            except StagingCapExceeded as exc:
                return self._put_streamed(step, entries, exc)
        else:
            lid, base = self._register_in_place(entries), 0
            if self._zero_copy_live:
                log.warning("put(copy=False) of step %d while steps %s were not retired: call store.retire() "
                            "before changing published tensors", step, self._zero_copy_live)
            self._zero_copy_live.append(step)
            self._zero_copy_entries = entries
        return self.catalog.put_piece(step, lid, base)

    def _stage(self, step: int, entries: list[_Entry]) -> tuple[str, int]:
        devices = {e.tensor.device for e in entries}
        if len(devices) > 1:
            raise LayoutError(f"put(copy=True): tensors are on several devices {sorted(map(str, devices))}; "
                              "one snapshot pool per store serves one device")
        device = devices.pop()
        if self._pool is not None and self._pool_device != device:
            self._pool = None
        if self._pool is None:
            self._pool = SnapshotPool(self._staging_depth, self._staging_cap, lambda n: self._alloc(n, device),
                                      self.transport.register_tensor, self.transport.unregister)
            self._pool_device = device
        pool = self._pool
        items = [(e.name, e.dtype, e.global_shape, e.box) for e in entries]
        packs = self._pack_requests(entries) if self._prepack else ()
        if packs and packs == self._packs_refused:
            packs = ()  # already known not to fit the staging cap
        if pool.signature != (tuple(items), tuple(packs)):
            # The slots are laid out anew: every version still in them must be retired first.
            for old_step in {x for x in pool.slot_step if x is not None}:
                self.catalog.retire(old_step, timeout=self.retire_timeout)
        try:
            changed = pool.configure(items, packs)
        except LayoutError:
            if not packs:
                raise
            log.warning("rank %d: consumers' pre-pack requests do not fit the staging cap; serving runs", self.rank)
            self._packs_refused = packs
            changed = pool.configure(items, ())
        if changed or self._stage_lid is None:
            assert pool.region is not None
            recs = [(se, ShardRecord(se.name, se.dtype, se.global_shape, se.box, contiguous_strides(se.box.sizes),
                                     self.rank, pool.region, se.offset)) for se in pool.entries]
            self._stage_lid = self._publish_layout([r for se, r in recs if se.source < 0],
                                                   [(se.consumer, r) for se, r in recs if se.source >= 0])
        k, old = pool.next_slot()
        if old is not None:
            # The slot still holds an older version: readers of it must be done or will discard.
            self.catalog.retire(old, timeout=self.retire_timeout)
        pool.fill(k, [e.tensor for e in entries], step)
        _sync_device(device)  # a CUDA copy is asynchronous: the slot must hold step's bytes before commit
        return self._stage_lid, k * pool.slot_size

    def _put_streamed(self, step: int, entries: list[_Entry], why: Exception) -> bool:
        """A snapshot larger than the staging cap: publish the tensors in place and return only
        once every live consumer has pulled this step (then retire it), so the caller may still
        change its tensors as soon as ``put`` returns; no staging memory is used."""
        log.warning("rank %d: %s; streaming step %d from the tensors themselves (put waits for consumers)",
                    self.rank, why, step)
        consumers = self.catalog.consumer_ids() - {self._reader_id}
        committed = self.catalog.put_piece(step, self._register_in_place(entries), 0)
        late = self.catalog.wait_delivered(step, consumers, timeout=self.retire_timeout)
        if late:
            log.warning("rank %d: %d consumers did not pull step %d within %.0fs", self.rank, len(late), step,
                        self.retire_timeout)
        self.catalog.retire(step, timeout=self.retire_timeout)
        return committed

    def _register_in_place(self, entries: list[_Entry]) -> str:
        shards = []
        for e in entries:
            addr, nbytes = _storage_span(e.tensor)
            region = self._in_place_region(e.tensor, addr, nbytes)
            shards.append(ShardRecord(e.name, e.dtype, e.global_shape, e.box, tuple(e.tensor.stride()), self.rank,
                                      region, addr - self.transport.region(region).base))
        sig = tuple(shards)
        if sig != self._layout_sig or self._inplace_lid is None:
            self._inplace_lid = self._publish_layout(shards)
            self._layout_sig = sig
        for d in {e.tensor.device for e in entries}:
            _sync_device(d)  # kernels still writing the tensors must finish before the commit
        return self._inplace_lid

    def _in_place_region(self, t: torch.Tensor, addr: int, nbytes: int) -> int:
        """The registered region holding a tensor's storage, registered once per storage."""
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        region = self._registered.get(key)
        if region is None:
            region = self.transport.register_tensor(t)
            self._registered[key] = region
        info = self.transport.region(region)
        assert info.base <= addr and addr + nbytes <= info.base + info.size
        return region

    def _pack_requests(self, entries: list[_Entry]) -> tuple[tuple[str, int, Box, str | None], ...]:
        """Consumers' pre-pack requests this rank can serve: (consumer, shard index, box, dtype)."""
        out = []
        for consumer, name, box, dtype in self.catalog.pack_requests(self.rank):
            for i, e in enumerate(entries):
                if e.name == name and e.box.intersect(box) == box and box.numel and (
                        dtype is None or (is_floating(dtype) and is_floating(e.dtype))):
                    out.append((consumer, i, box, None if dtype == e.dtype else dtype))
                    break
        return tuple(out)

    def _publish_layout(self, shards: list[ShardRecord], packed: list[tuple[str, ShardRecord]] = ()) -> str:
        desc = codec.encode("ucx_descriptor", self.transport.descriptor())
        lid = self.catalog.write_layout(shards, desc, packed)
        log.info("rank %d: publishing layout %s (%d shards, %d pre-packed copies)", self.rank, lid, len(shards),
                 len(packed))
        return lid

    def retire(self, timeout: float | None = None) -> int:
        """Before changing tensors published with ``copy=False``: mark those versions retired and
        wait (bounded) for their in-flight readers. Readers that were still reading discard their
        bytes and retry on a newer version. Returns the number of readers that had not finished.

        Raises:
            StaleSessionError: the session was fenced.
        """
        left = 0
        for s in self._zero_copy_live:
            left += self.catalog.retire(s, timeout=self.retire_timeout if timeout is None else timeout)
        self._zero_copy_live.clear()
        return left

    # ---- re-serving (P2P fan-out) ---------------------------------------------------------

    def serve(self, step: int, buffers: Mapping[str, TensorLike], *, group: str | None = None) -> None:
        """Offer buffers that :meth:`get_into` just filled with ``step`` as an extra source of that
        step, so later consumers and recovering publishers can pull from this process instead of
        the trainers. Members of one ``group`` (e.g. the TP ranks of one rollout instance) together
        serve whole tensors; a process holding whole tensors can serve alone (the default group).
        The next :meth:`get_into` withdraws the offer first (waiting, bounded, for its readers).

        Raises:
            LayoutError: the buffers were not all filled with ``step`` by this store.
        """
        entries = _validate(buffers, "serve(buffers)")
        delivered = {e.tensor.data_ptr() for e in self._dest_entries} if step == self._delivered_step else set()
        for e in entries:
            if e.tensor.data_ptr() not in delivered:
                raise LayoutError(f"tensor {e.name!r}: serve() of step {step} needs buffers that get_into "
                                  "filled with that step")
        shards = []
        for e in entries:
            addr, nbytes = _storage_span(e.tensor)
            region = self._in_place_region(e.tensor, addr, nbytes)
            shards.append(ShardRecord(e.name, e.dtype, e.global_shape, e.box, tuple(e.tensor.stride()), 0,
                                      region, addr - self.transport.region(region).base))
        desc = codec.encode("ucx_descriptor", self.transport.descriptor())
        grp = group or f"solo-{self._reader_id}"
        lid = self.catalog.add_replica(step, grp, self._reader_id, shards, desc)
        self._serving.append((step, grp, lid))
        log.info("re-serving step %d as %s/%s (%d tensors)", step, grp, self._reader_id, len(shards))

    def unserve(self) -> int:
        """Withdraw every re-served step; returns readers that had not finished within the wait."""
        left = 0
        for step, grp, lid in self._serving:
            left += self.catalog.remove_replica(step, grp, self._reader_id, lid, timeout=self.retire_timeout)
        self._serving.clear()
        return left

    # ---- checkpoints and recovery ---------------------------------------------------------

    def _held(self, step: int) -> list[tuple[ShardRecord, torch.Tensor]]:
        """This rank's shards of ``step`` as (record, tensor) while it still holds them."""
        pool = self._pool
        if pool is not None and step in pool.slot_step and pool.buffer is not None:
            k = pool.slot_step.index(step)
            out = []
            for se in pool.entries:
                if se.source >= 0:
                    continue  # a pre-packed copy, not a shard
                off = k * pool.slot_size + se.offset
                t = pool.buffer[off: off + se.nbytes].view(torch_dtype(se.dtype)).view(se.box.sizes)
                out.append((ShardRecord(se.name, se.dtype, se.global_shape, se.box, contiguous_strides(se.box.sizes),
                                        self.rank, 0, 0), t))
            return out
        if step in self._zero_copy_live and self._zero_copy_entries:
            return [(ShardRecord(e.name, e.dtype, e.global_shape, e.box, tuple(e.tensor.stride()), self.rank, 0, 0),
                     e.tensor) for e in self._zero_copy_entries]
        raise CheckpointError(f"rank {self.rank} no longer holds step {step} (its staging slot was reused); "
                              "checkpoint a step right after putting it")

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
        from . import checkpoint as ckpt

        s = self.catalog.session
        version = self.catalog.layouts_of(self.catalog.read_version(step))
        if s is None or version.epoch != s.epoch:
            raise CheckpointError(f"step {step} was not committed by this store's session")
        layouts = group_layouts(x for lay in version.layouts.values() for x in lay.shards)
        shards = ckpt.owned_shards(self._held(step), layouts, self.rank)

        def finish(_part: Any = None) -> bool:
            done = ckpt.try_commit(uri, step, self.world_size, attempt=s.session_id)
            if done:
                self.catalog.record_checkpoint(CheckpointEntry(step, str(uri), self.world_size,
                                                               sum(t.nbytes for t in layouts.values()),
                                                               time.time()))
            return done

        if asynchronous:
            if self._async_ckpt is None:
                self._async_ckpt = ckpt.AsyncCheckpointer()
            part = self._async_ckpt.save(uri, step, self.rank, self.world_size, shards, attempt=s.session_id)
            done: Future[bool] = Future()

            def chain(f: Future[Any]) -> None:
                try:
                    f.result()
                    done.set_result(finish())
                except BaseException as exc:  # delivered to the caller through the future
                    done.set_exception(exc)

            part.add_done_callback(chain)
            return done
        ckpt.write_part(uri, step, self.rank, self.world_size, shards, attempt=s.session_id)
        return finish()

    def restore(self, buffers: Mapping[str, TensorLike], *, uri: str | None = None, step: int | None = None) -> int:
        """Fill preallocated buffers of any layout from a checkpoint: ``uri`` (newest complete step
        there, or ``step``), else the newest complete checkpoint the catalog knows.

        Raises:
            CheckpointNotFound: no complete checkpoint; CheckpointCorrupted: checksum or file errors;
            LayoutError: a buffer that does not fit.
        """
        from . import checkpoint as ckpt

        if uri is None:
            known = [c for c in self.catalog.checkpoints() if step is None or c.step == step]
            if not known:
                raise CheckpointNotFound(f"namespace {self.namespace!r}: the catalog knows no checkpoint"
                                         + ("" if step is None else f" of step {step}"))
            uri, step = known[-1].uri, known[-1].step
        return int(ckpt.restore(uri, buffers, step=step))

    def recover(self, tensors: Mapping[str, TensorLike], *, timeout: float = 60.0, uri: str | None = None
                ) -> int | None:
        """For a (re)started publisher rank: fence the previous session, fill this rank's
        preallocated ``tensors`` with the newest committed state — from live sources (surviving
        replicas, consumers that re-serve it) or else the newest complete checkpoint — and
        republish it in the new session so consumers carry on.

        Returns:
            The recovered step, or None when nothing was ever committed or checkpointed.

        Raises:
            CheckpointCorrupted: the only copy left is a damaged checkpoint.
        """
        entries = _validate(tensors, "recover(tensors)")
        self._ensure_transport(entries[0].tensor.device)
        if self.catalog.session is None:
            self.catalog.open_session(rank=self.rank, world_size=self.world_size, session_id=self._session_id)
        got: int | None = None
        latest = self.catalog.latest()
        if latest is not None:
            try:
                got = self.get_into(tensors, step=latest, timeout=timeout)
                log.info("rank %d recovered step %d from live sources", self.rank, got)
            except (PeerUnreachable, VersionNotFound, TornReadError, WaitTimeout) as exc:
                log.warning("rank %d: step %d has no live source (%s); trying checkpoints", self.rank, latest, exc)
        if got is None:
            try:
                got = self.restore(tensors, uri=uri)
                log.info("rank %d recovered step %d from a checkpoint", self.rank, got)
            except CheckpointNotFound:
                if latest is not None:
                    raise PeerUnreachable(f"namespace {self.namespace!r}: step {latest} has no live source and "
                                          "no checkpoint exists") from None
                return None
        self.put(got, tensors)
        return got

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
        dests = self._dests(buffers)
        self._ensure_transport(dests[0].tensor.device)
        if not self._consumer_known:
            # Publishers that stream oversized snapshots wait for known consumers.
            self.catalog.register_consumer(self._reader_id, [])
            self._consumer_known = True
        if self._serving:
            self.unserve()  # these buffers may be among the re-served ones: withdraw before writing
        deadline = None if timeout is None else time.monotonic() + timeout
        want = step
        torn = 0
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            s = self.catalog.wait_for(want, timeout=remaining)
            try:
                version = self.catalog.begin_read(s, self._reader_id)
            except VersionNotFound:
                # Retired or dropped between the wait and the read: only a newer one can serve.
                want = s + 1
                continue
            try:
                version = self.catalog.layouts_of(version)
                self._pull(version, dests)
            except BaseException:
                self.catalog.end_read(s, self._reader_id)
                raise
            if self.catalog.end_read(s, self._reader_id):
                self._delivered_step = s  # the buffers in self._dest_entries hold step s
                return s
            torn += 1
            self.stats["torn_retries"] += 1
            log.info("step %d was retired while being read; retrying on a newer version", s)
            if torn > _MAX_TORN_RETRIES:
                raise TornReadError(f"namespace {self.namespace!r}: step {s} and {torn - 1} newer ones were "
                                    "retired while being read; the publisher changes memory faster than it "
                                    "can be read")
            want = s + 1

    def _dests(self, buffers: Mapping[str, TensorLike]) -> list[_Entry]:
        """Validated buffers. A steady-state call with the same tensor objects at the same
        addresses skips validation; the check allocates nothing that the garbage collector
        tracks, because with 10,000 buffers per pull collections cost more than the check."""
        seen = self._dest_seen
        if seen is not None and len(seen) == len(buffers):
            for (name, v), (sname, sv, ptr, numel) in zip(buffers.items(), seen):
                t = v.tensor if isinstance(v, Shard) else v
                if name != sname or v is not sv or not isinstance(t, torch.Tensor) or t.data_ptr() != ptr \
                        or t.numel() != numel:
                    break
            else:
                return self._dest_entries
        dests = _validate(buffers, "get_into(buffers)")
        self._dest_seen = [(n, v, (v.tensor if isinstance(v, Shard) else v).data_ptr(),
                            (v.tensor if isinstance(v, Shard) else v).numel()) for n, v in buffers.items()]
        self._dest_entries = dests
        # Plans are keyed by the buffers' layout (names, boxes, strides, addresses).
        self._dest_fp = tuple((e.name, e.box, e.dtype, e.tensor.stride(), e.tensor.data_ptr()) for e in dests)
        return dests

    def _pull(self, version: Version, dests: list[_Entry]) -> None:
        groups = self._source_groups(version)
        # A source may have died without its lease expiring yet: retry on the other groups.
        tries = [groups]
        if "pub" in groups and len(groups) > 1:
            tries += [{k: v for k, v in groups.items() if k != "pub"}, {"pub": groups["pub"]}]
        for i, gs in enumerate(tries):
            if i and not all(any(e.name in g.layouts for g in gs.values()) for e in dests):
                continue  # these sources cannot serve every buffer
            try:
                self._pull_from(version, gs, dests)
                return
            except TransportError:
                # Endpoints of a failed read may be closed: connect and plan afresh next time.
                self._connected.clear()
                self._ops_cache.clear()
                if i == len(tries) - 1:
                    raise
                log.info("step %d: a source failed; retrying with other sources", version.step)

    @staticmethod
    def _bases(version: Version, g: "_Group") -> dict[int, int]:
        return {sid: (0 if r is None else version.pieces[r].base_offset) for sid, (_p, r, _l) in g.sources.items()}

    def _pull_from(self, version: Version, groups: Mapping[str, "_Group"], dests: list[_Entry]) -> None:
        if not groups:
            raise PeerUnreachable(
                f"namespace {self.namespace!r}: step {version.step}: publisher ranks {sorted(version.missing)} "
                "are gone (their leases expired) and no consumer re-serves the version")
        # Steady state: same sources, same buffers, same staging slots -> the ready-made batch.
        bases = tuple(p.base_offset for _r, p in sorted(version.pieces.items()))
        key = (version.layout_key, version.missing, tuple(sorted(groups)), self._dest_fp, bases)
        work = self._ops_cache.get(key)
        if work is None:
            work = self._build_pull(version, groups, dests)
            self._ops_cache[key] = work
            while len(self._ops_cache) > 8:
                self._ops_cache.popitem(last=False)
        else:
            self._ops_cache.move_to_end(key)
            self.stats["plan_hits"] += 1
        ops, conversions = work
        self.stats["reads"] = len(ops) + sum(len(c[0]) for conv in conversions for c in conv.chunks)
        self.stats["local_conversions"] = len(conversions)
        if len(ops):
            self.transport.get(ops, timeout=self.read_timeout)  # every same-dtype read in one call
        for conv in conversions:
            self._run_conversion(conv)

    def _build_pull(self, version: Version, groups: Mapping[str, "_Group"], dests: list[_Entry]
                    ) -> tuple[np.ndarray, list["_Conversion"]]:
        assigned = self._assign(groups, dests)
        batches, conversions = [], []
        for gid, items in assigned.items():
            g = groups[gid]
            self._connect(g)
            bases = self._bases(version, g)
            same = [e for e in items if e.dtype == g.layouts[e.name].dtype]
            convert = [e for e in items if e.dtype != g.layouts[e.name].dtype]
            cp = None
            if same:
                ptrs = np.asarray([e.tensor.data_ptr() for e in same], dtype=np.int64)
                cp = self._plan(g, self._dest_records(same))
                batches.append(self._to_transport_ops(g, bases, cp.reads, ptrs))
            for e in convert:
                ready = self._converted_layout(g, e)
                if ready is not None:  # the publisher already converted this buffer's pieces
                    cg = replace(g, layouts={e.name: ready}, packed=(), key=(g.key, "conv", e.name, e.dtype))
                    reads = self._plan(cg, self._dest_records([e])).reads
                    batches.append(self._to_transport_ops(cg, bases, reads,
                                                          np.asarray([e.tensor.data_ptr()], dtype=np.int64)))
                else:
                    conversions.append(self._plan_conversion(g, bases, e))
            if self._prepack and gid == "pub":
                self._request_packs(g, same, cp, convert)
        ops = np.concatenate(batches) if batches else np.empty((0, 5), dtype=np.int64)
        return ops, conversions

    def _converted_layout(self, g: "_Group", e: _Entry) -> TensorLayout | None:
        """The publisher-converted copies of this buffer's pieces, if together they cover it."""
        recs = tuple(r for r in g.converted if r.name == e.name and r.dtype == e.dtype
                     and e.box.intersect(r.box) == r.box)
        if not recs or sum(r.box.numel for r in recs) != e.box.numel:
            return None
        return TensorLayout(e.name, e.dtype, e.global_shape, recs)

    def _source_groups(self, version: Version) -> dict[str, "_Group"]:
        """The alternative sources of a version: the publishers (when all are alive) and each
        re-serving group, with the tensors each can serve whole."""
        key = ("groups", version.layout_key, version.missing)
        hit = self._groups_cache.get(key)
        if hit is not None:
            self._groups_cache.move_to_end(key)
            return hit
        groups: dict[str, _Group] = {}
        if not version.missing:
            src = {r: (("pub", version.layouts[r].epoch, r), r, version.layouts[r]) for r in version.layouts}
            layouts = group_layouts(s for lay in version.layouts.values() for s in lay.shards)
            mine = [rec for lay in version.layouts.values() for c, rec in lay.packed if c == self._reader_id]
            groups["pub"] = _Group("pub", layouts, src, version.layout_key,
                                   tuple(r for r in mine if r.dtype == layouts[r.name].dtype),
                                   tuple(version.layouts[r].shards for r in sorted(version.layouts)),
                                   tuple(r for r in mine if r.dtype != layouts[r.name].dtype))
        by_group: dict[str, list[str]] = {}
        for m in sorted(version.replica_layouts):
            by_group.setdefault(version.replicas[m].group, []).append(m)
        for gname, members in sorted(by_group.items()):
            src, shards = {}, []
            for i, m in enumerate(members):
                lay = version.replica_layouts[m]
                src[i] = (("replica", m), None, lay)
                shards += [replace(s, rank=i) for s in lay.shards]
            by_name: dict[str, list[ShardRecord]] = {}
            for s in shards:
                by_name.setdefault(s.name, []).append(s)
            layouts = {}
            for n, recs in sorted(by_name.items()):
                try:
                    layouts[n] = merge_tensor_layout(n, recs)
                except LayoutError:
                    continue  # the group holds only part of this tensor: not a source of it
            if layouts:
                groups["g:" + gname] = _Group("g:" + gname, layouts, src,
                                              tuple((m, version.replica_layouts[m].layout_id) for m in members))
        self._groups_cache[key] = groups
        while len(self._groups_cache) > 8:  # re-serving consumers come and go: keep it bounded
            self._groups_cache.popitem(last=False)
        return groups

    def _assign(self, groups: Mapping[str, "_Group"], dests: list[_Entry]) -> dict[str, list[_Entry]]:
        """Pick one source group per buffer: checks fit first (before any byte moves), then spreads
        consumers over the groups that hold the tensor, deterministically per consumer."""
        out: dict[str, list[_Entry]] = {}
        order = sorted(groups)
        for i, e in enumerate(dests):
            cands = [g for g in order if e.name in groups[g].layouts]
            if not cands:
                names = sorted({n for g in groups.values() for n in g.layouts})
                raise LayoutError(f"tensor {e.name!r} is not in step's published tensors ({', '.join(names[:8])}"
                                  f"{', ...' if len(names) > 8 else ''})")
            lay = groups[cands[0]].layouts[e.name]
            if lay.global_shape != e.global_shape:
                raise LayoutError(f"tensor {e.name!r}: buffer expects global shape {e.global_shape}, published "
                                  f"global shape is {lay.global_shape}")
            if e.dtype != lay.dtype and not (is_floating(e.dtype) and is_floating(lay.dtype)):
                raise LayoutError(f"tensor {e.name!r}: buffer dtype {e.dtype} does not match published dtype "
                                  f"{lay.dtype}, and {lay.dtype} -> {e.dtype} is not a float conversion")
            out.setdefault(cands[(self._rotation + i) % len(cands)], []).append(e)
        return out

    def _connect(self, g: "_Group") -> None:
        for sid, (peer, _base, lay) in g.sources.items():
            if self._connected.get(peer) == lay.layout_id:
                continue
            desc = codec.decode("ucx_descriptor", lay.transport)
            try:
                self.transport.connect(peer, desc)
            except TransportError as exc:
                raise PeerUnreachable(f"cannot connect to source {peer}: {exc}") from exc
            self._connected[peer] = lay.layout_id

    def _dest_records(self, dests: list[_Entry]) -> tuple[ShardRecord, ...]:
        return tuple(ShardRecord(e.name, e.dtype, e.global_shape, e.box, tuple(e.tensor.stride()), -1, i, 0)
                     for i, e in enumerate(dests))

    def _plan(self, g: "_Group", dests: tuple[ShardRecord, ...]) -> Any:
        before = self._planner.misses
        packed = {self._reader_id: g.packed} if g.packed else None
        cp = self._planner.plan_consumer(g.layouts, dests, consumer=self._reader_id, rotation=self._rotation,
                                         packed=packed, key=(g.key, dests))
        self.stats["plans" if self._planner.misses != before else "plan_hits"] += 1
        return cp

    def _request_packs(self, g: "_Group", same: list[_Entry], cp: Any, convert: list[_Entry]) -> None:
        """Tell the publishers which pieces to build for this consumer: contiguous copies of
        strided pieces (the planner's cost model picks them) and converted copies of the pieces
        of buffers in another float dtype. Sent only when the shard layout or the buffers change."""
        dests = self._dest_records(same)
        key = (g.shards_key, dests, self._dest_records(convert))
        if key == self._pack_key:
            return
        items = [] if cp is None else (cp.pack_items if not g.packed else self._planner.plan_consumer(
            g.layouts, dests, consumer=self._reader_id, rotation=self._rotation).pack_items)
        packs: list[tuple[int, str, Box, str | None]] = [(it.source.rank, it.source.name, it.box, None)
                                                         for it in items]
        for e in convert:
            by_box: dict[Box, list[int]] = {}
            for s in g.layouts[e.name].shards:
                by_box.setdefault(s.box, []).append(s.rank)
            for box, ranks in sorted(by_box.items(), key=lambda kv: (kv[0].offsets, kv[0].sizes)):
                piece = e.box.intersect(box)
                if piece is not None:
                    packs.append((sorted(ranks)[self._rotation % len(ranks)], e.name, piece, e.dtype))
        self.catalog.register_consumer(self._reader_id, packs)
        self._pack_key = key
        if packs:
            log.info("asked publishers for %d pre-packed pieces", len(packs))

    def _to_transport_ops(self, g: "_Group", bases: Mapping[int, int], reads: np.ndarray, dst_base: np.ndarray
                          ) -> np.ndarray:
        """Plan rows -> (peer index, region, remote offset, local address, length), vectorized."""
        n = max(g.sources) + 1
        peer_idx = np.full(n, -1, dtype=np.int64)
        base = np.zeros(n, dtype=np.int64)
        for sid, (peer, _r, _lay) in g.sources.items():
            peer_idx[sid] = self.transport.peer_index(peer)
            base[sid] = bases[sid]
        src = reads["src_rank"].astype(np.int64)
        ops = np.empty((len(reads), 5), dtype=np.int64)
        ops[:, 0] = peer_idx[src]
        ops[:, 1] = reads["src_region"]
        ops[:, 2] = reads["src_offset"] + base[src]
        ops[:, 3] = dst_base[reads["dst_region"]] + reads["dst_offset"]
        ops[:, 4] = reads["length"]
        return ops

    def _plan_conversion(self, g: "_Group", bases: Mapping[int, int], e: _Entry) -> "_Conversion":
        """A buffer of another float dtype: its source bytes go through two staging halves of
        ``staging_cap_bytes`` in chunks of whole rows; chunk k+1 is fetched while chunk k is
        converted into the buffer in place."""
        src_dtype = g.layouts[e.name].dtype
        isz = itemsize(src_dtype)
        half = max(1, (self._staging_cap or (64 << 20)) // 2)
        sizes = e.box.sizes
        if not sizes:
            boxes = [e.box]
        else:
            row = max(1, int(np.prod(sizes[1:], dtype=np.int64)) * isz)
            if row > half and len(sizes) > 1:
                raise LayoutError(f"tensor {e.name!r}: one row of {row} bytes exceeds half the staging cap "
                                  f"{self._staging_cap}; raise staging_cap_bytes")
            per = max(1, half // row)
            boxes = [Box((e.box.offsets[0] + i,) + e.box.offsets[1:], (min(per, sizes[0] - i),) + sizes[1:])
                     for i in range(0, sizes[0], per)]
        staging = self._conversion_staging(2 * min(half, e.box.numel * isz), e.tensor.device)
        halves = (staging[: staging.numel() // 2], staging[staging.numel() // 2:])
        recs = tuple(ShardRecord(e.name, src_dtype, e.global_shape, c, contiguous_strides(c.sizes), -1, i, 0)
                     for i, c in enumerate(boxes))
        reads = self._plan(g, recs).reads  # every chunk in one planning call
        order = np.argsort(reads["dst_region"], kind="stable")
        reads = reads[order]
        cuts = np.searchsorted(reads["dst_region"], np.arange(len(boxes) + 1))
        chunks = []
        for i, c in enumerate(boxes):
            buf = halves[i % 2]
            ops = self._to_transport_ops(g, bases, reads[cuts[i]:cuts[i + 1]],
                                         np.full(len(boxes), buf.data_ptr(), dtype=np.int64))
            src = buf[: c.numel * isz].view(torch_dtype(src_dtype)).view(c.sizes)
            local = tuple(slice(o - b, o - b + s) for o, b, s in zip(c.offsets, e.box.offsets, c.sizes))
            chunks.append((ops, src, e.tensor[local]))
        return _Conversion(e.name, chunks)

    def _run_conversion(self, conv: "_Conversion") -> None:
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="astate-fetch")
        fetch = lambda ops: self.transport.get(ops, timeout=self.read_timeout) if len(ops) else None  # noqa: E731
        pending = self._fetcher.submit(fetch, conv.chunks[0][0])
        for k, (_ops, src, dst) in enumerate(conv.chunks):
            pending.result()
            if k + 1 < len(conv.chunks):  # the other half: free since chunk k-1 was converted
                pending = self._fetcher.submit(fetch, conv.chunks[k + 1][0])
            with torch.no_grad():
                dst.copy_(src)
            _sync_device(dst.device)  # the next fetch into this half must not overtake the copy

    def _conversion_staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._conv_buf
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self._conv_buf = None
            buf = self._alloc(max(nbytes, 1), device)
            self._conv_buf = buf
        return buf


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _torchrun_session() -> str | None:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return f"{run}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return None


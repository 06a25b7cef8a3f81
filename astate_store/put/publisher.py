"""The publishing side of a store: ``put`` and ``retire``.

put: tensors -> layout (validated entries) -> memory peers will read (a snapshot slot, the
tensors in place, or a stream of them) -> catalog (layout record once, then this step's piece;
the rank whose piece completes the version commits it).

Readers and publishers follow the retire protocol (docs/protocol.md, "Zero-copy publishing"): memory that
a committed version points to is retired — no new readers, registered ones waited for (bounded)
or marked torn — before it changes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence

import torch

from astate_store.catalog.records import pad20
from astate_store.context import StoreContext, sync_device
from astate_store.errors import CheckpointError, LayoutError
from astate_store.model import codec
from astate_store.model.dtypes import torch_dtype
from astate_store.model.layout import ShardRecord, TensorLike
from astate_store.model.validated import ValidatedTensors
from astate_store.model.validation import Entry, validate_tensors, with_aliases
from astate_store.plan import Copy, servable
from astate_store.put.delta import DeltaStager
from astate_store.put.drain import drain, wait_pulled
from astate_store.put.registry import Registry
from astate_store.put.staging import SnapshotPool, StagingCapExceeded

__all__ = ["Publisher"]

log = logging.getLogger("astate_store")


def default_staging_cap(device: torch.device) -> int:
    """The snapshot staging a store may hold when ``staging_cap_bytes`` is not given: a quarter
    of the device's memory (GPU memory for CUDA tensors, RAM for host tensors). Past it the pool
    shrinks to one slot, then puts stream from the tensors (docs/api.md, "Options")."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def new_pool(ctx: StoreContext, device: torch.device) -> SnapshotPool:
    """The snapshot pool of a store's puts of tensors on ``device``; with delta versions a host
    pool compares as it copies (the compare-and-copy is the CPU's; docs/delta.md)."""
    opts = ctx.options
    cap = opts.staging_cap_bytes if opts.staging_cap_bytes is not None else default_staging_cap(device)
    stager = DeltaStager(opts.delta_budget) if opts.delta and device.type == "cpu" else None
    return SnapshotPool(
        opts.staging_depth, cap, lambda n: ctx.alloc(n, device, shared=True), ctx.transport, stager
    )


class Publisher:
    """One rank's publishing state: the snapshot pool, in-place registrations, live steps."""

    def __init__(self, ctx: StoreContext, registry: Registry):
        self.ctx, self.registry = ctx, registry
        self._pool: SnapshotPool | None = None
        self._pool_device: torch.device | None = None
        self._stage_lid: str | None = None  # layout of the snapshot slots
        self._inplace_lid: str | None = None  # layout of tensors published in place
        self._inplace_sig: object = None
        self._zero_copy_live: list[int] = []  # steps published in place and not retired yet
        self._zero_copy_entries: list[Entry] = []
        self._tensors = ValidatedTensors("put(tensors)")
        self._items: tuple[object, ...] = ()  # slot items of the entries last laid out
        self._items_of: list[Entry] | None = None
        self._packs: tuple[Copy, ...] = ()  # the copies built (or to build) in the slots
        self._packs_entries: list[Entry] | None = None  # the entries self._packs index into
        self._items_of_packs: list[Entry] | None = None
        self._packs_refused: tuple[Copy, ...] = ()
        self._nbytes_of: list[Entry] | None = None  # the entries _nbytes_cached was computed for
        self._nbytes_cached = 0
        self.last_step: int | None = None  # the newest step this rank put (what drain waits on)

    def publish(
        self, step: int, tensors: Mapping[str, TensorLike], *, copy: bool = True, meta: bytes | None = None
    ) -> bool:
        """The whole put sequence of ``Store.put``; True when this put completed the version.

        1. ``begin``: validate the tensors (cached while they are the same objects at the same
           addresses), then make sure a transport near their device and the session exist;
        2. ``put``: snapshot into a slot, publish in place, or stream; then the piece and, from
           the last rank, the commit, in one catalog transaction;
        3. ``wait_replicated``: with ``replicas=K``, until K replica servers hold the step.
        """
        entries = self.begin(tensors, "put(tensors)", every_step=True)
        committed = self.put(step, entries, copy=copy, meta=meta)
        self.wait_replicated(step)  # replicas=K: K replica servers hold it (docs/replicas.md)
        return committed

    def begin(self, tensors: Mapping[str, TensorLike], what: str, *, every_step: bool = False) -> list[Entry]:
        """Validate a publishing call's tensors, then make sure a transport (near their device)
        and the publisher session exist: nothing is created for bad input."""
        # ``put`` passes the same tensors every step: its validation is cached (see ``validated``).
        entries = self._tensors.validate(tensors) if every_step else validate_tensors(tensors, what)
        self.ctx.ensure_transport(entries[0].tensor.device)
        self.ctx.ensure_session()
        return entries

    def put(self, step: int, entries: list[Entry], *, copy: bool, meta: bytes | None = None) -> bool:
        """Publish this rank's piece of ``step`` (with its encoded ``meta``, see ``usermeta``);
        True when this put completed the version."""
        t0 = time.perf_counter()
        try:
            committed, mode = self._put(step, entries, copy, meta)
        except BaseException:
            self.ctx.stats.put_errors += 1  # a fence is logged where it is found (catalog.sessions)
            raise
        seconds = time.perf_counter() - t0
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self.ctx.stats.put_done(mode, self._nbytes(entries), seconds, step, committed)
        log.debug(
            "rank %d: put step %d (%s, %d bytes, %.4fs, committed: %s)",
            self.ctx.rank,
            step,
            mode,
            self._nbytes_cached,
            seconds,
            committed,
        )
        return committed

    def wait_replicated(self, step: int) -> None:
        """With ``replicas=K``: wait (bounded by ``replica_timeout``) until K replica servers
        offer committed ``step`` — a rank whose piece did not complete the version waits for the
        commit too (servers can only offer committed steps). Watch-based, O(1) requests.

        Raises:
            ReplicationTimeout: fewer than K servers held it in time (the step stays committed).
        """
        k = self.ctx.options.replicas
        if k:
            held = self.ctx.catalog.replicas.wait_servers(step, k, timeout=self.ctx.options.replica_timeout)
            log.debug("rank %d: step %d held by %d replica servers", self.ctx.rank, step, held)

    def _nbytes(self, entries: list[Entry]) -> int:
        """This rank's bytes of a put, computed once per validated list (a steady put reuses it)."""
        if entries is not self._nbytes_of:
            self._nbytes_of, self._nbytes_cached = (
                entries,
                sum(e.tensor.numel() * e.tensor.element_size() for e in entries),
            )
        return self._nbytes_cached

    def _put(self, step: int, entries: list[Entry], copy: bool, meta: bytes | None) -> tuple[bool, str]:
        """(committed, how it was published: ``copy``, ``in_place`` or ``streamed``)."""
        if copy:
            try:
                lid, base, word = self._stage(step, entries)
            except StagingCapExceeded as exc:
                return self._put_streamed(step, entries, exc, meta), "streamed"
            versions = self.ctx.catalog.versions
            delta = self._pool.delta.last if self._pool is not None and self._pool.delta is not None else None
            piece = versions.put_piece(step, lid, base, meta, self._slot_bases(), step_word=word, delta=delta)
            return piece, "copy"
        else:
            lid, base = self._in_place(entries), 0
            if self._zero_copy_live:
                log.warning(
                    "put(copy=False) of step %d while steps %s were not retired: call store.retire() "
                    "before changing published tensors",
                    step,
                    self._zero_copy_live,
                )
            self._zero_copy_live.append(step)
            self._zero_copy_entries = entries
        return self.ctx.catalog.versions.put_piece(step, lid, base, meta), "in_place"

    # ---- snapshots ------------------------------------------------------------------------

    def _pool_for(self, entries: list[Entry]) -> SnapshotPool:
        if entries is self._items_of and self._pool is not None:
            return self._pool  # the same validated tensors as the last put: same device
        devices = {e.tensor.device for e in entries}
        if len(devices) > 1:
            raise LayoutError(
                f"put(copy=True): tensors are on several devices {sorted(map(str, devices))}; "
                "one snapshot pool per store serves one device"
            )
        device = devices.pop()
        if self._pool is None or self._pool_device != device:
            self._pool = new_pool(self.ctx, device)
            self._pool_device = device
        return self._pool

    def _configure(self, pool: SnapshotPool, entries: list[Entry]) -> bool:
        """Lay out the slots for these entries and the pre-packed copies consumers asked for;
        True when the layout changed (it must then be published anew)."""
        if entries is not self._items_of:  # the cached entries list: unchanged tensors, no O(T) work
            self._items = tuple((e.name, e.dtype, e.global_shape, e.box) for e in entries)
            self._items_of = entries
        packs = self._copies(entries)
        if pool.signature != (self._items, packs):
            # The slots are laid out anew: every version still in them must be retired first.
            for old_step in {x for x in pool.slot_step if x is not None}:
                self.ctx.catalog.readers.retire(old_step, timeout=self.ctx.options.retire_timeout)
        try:
            return pool.configure(self._items, packs)
        except LayoutError:
            if not packs:
                raise
            log.warning(
                "rank %d: consumers' pre-pack requests do not fit the staging cap; serving runs",
                self.ctx.rank,
            )
            self._packs_refused, self._packs = packs, ()
            return pool.configure(self._items, ())

    def _copies(self, entries: list[Entry]) -> tuple[Copy, ...]:
        """The pre-packed copies to build: consumers' requests are read only after their records
        changed (a watch says so), and folded in only when they need a copy not built yet — a
        consumer joining with known geometry, or leaving, re-lays nothing out."""
        cons = self.ctx.catalog.consumers
        if not self.ctx.options.prepack or not (cons.changed() or entries is not self._items_of_packs):
            return self._packs
        wanted = servable(cons.pack_requests(self.ctx.rank), entries)
        self._items_of_packs = entries
        if wanted == self._packs_refused:
            wanted = ()  # already known not to fit the staging cap
        if not set(wanted) <= set(self._packs) or entries is not self._packs_entries:
            self._packs, self._packs_entries = wanted, entries
        return self._packs

    def _stage(self, step: int, entries: list[Entry]) -> tuple[str, int, tuple[int, int, int] | None]:
        """Snapshot the entries into the next slot: (layout id, its base offset, its step word)."""
        pool = self._pool_for(entries)
        if self._configure(pool, entries) or self._stage_lid is None:
            assert pool.region is not None
            recs = [(se, se.record(self.ctx.rank, pool.region, se.offset)) for se in pool.entries]
            self._stage_lid = self._publish_layout(
                with_aliases(entries, [r for se, r in recs if se.source < 0]),
                [r for se, r in recs if se.source >= 0],
            )
        k, old = pool.next_slot()
        if old is not None:
            # The slot still holds an older version: readers of it must be done or will discard.
            self.ctx.catalog.readers.retire(old, timeout=self.ctx.options.retire_timeout)
        pool.fill(k, [e.tensor for e in entries], step, key=entries)
        sync_device(entries[0].tensor.device)  # the slot must hold step's bytes before the commit
        return self._stage_lid, k * pool.slot_size, pool.step_word(k)

    def _slot_bases(self) -> list[int]:
        """Every slot's base offset in the staging pool (consumers map the next slot's pages ahead)."""
        pool = self._pool
        return [] if pool is None or pool.depth < 2 else [k * pool.slot_size for k in range(pool.depth)]

    def _put_streamed(self, step: int, entries: list[Entry], why: Exception, meta: bytes | None) -> bool:
        """A snapshot larger than the staging cap: publish the tensors in place and return only
        once every live consumer has pulled this step (then retire it), so the caller may still
        change its tensors as soon as ``put`` returns; no staging memory is used."""
        cat = self.ctx.catalog
        log.warning(
            "rank %d: %s; streaming step %d from the tensors themselves (put waits for consumers)",
            self.ctx.rank,
            why,
            step,
        )
        consumers = cat.consumers.ids() - {self.ctx.reader_id}
        committed = cat.versions.put_piece(step, self._in_place(entries), 0, meta)
        wait_pulled(self.ctx, step, consumers)
        return committed

    # ---- in place -------------------------------------------------------------------------

    def _in_place(self, entries: list[Entry]) -> str:
        """Register the entries' published spans (once; ``Registry``) and publish their layout
        when it changed. Registrations the earlier, retired in-place steps used and this put
        no longer publishes are released here (``_release_unused``)."""
        shards = with_aliases(entries, self.registry.acquire("put", entries, self.ctx.rank))
        if not self._zero_copy_live:
            # Every earlier in-place step was retired (retire(), or streamed and retired by
            # _put_streamed): only this put's references still matter.
            self.registry.release("put", keep_last=1)
        self._release_unused()
        sig = tuple(shards)
        if sig != self._inplace_sig or self._inplace_lid is None:
            self._inplace_lid = self._publish_layout(shards)
            self._inplace_sig = sig
        for d in {e.tensor.device for e in entries}:
            sync_device(d)  # kernels still writing the tensors must finish before the commit
        return self._inplace_lid

    def _publish_layout(self, shards: list[ShardRecord], packed: Sequence[ShardRecord] = ()) -> str:
        desc = codec.encode("ucx_descriptor", self.ctx.transport.descriptor())
        lid = self.ctx.catalog.versions.write_layout(shards, desc, packed)
        self.ctx.stats.layouts_published += 1
        log.info(
            "rank %d: publishing layout %s (%d shards, %d pre-packed copies)",
            self.ctx.rank,
            lid,
            len(shards),
            len(packed),
        )
        return lid

    # ---- drain ----------------------------------------------------------------------------

    def drain(self, timeout: float) -> int:
        """Before this rank exits: ``drain.drain`` (consumers finish reading) of the last step put."""
        return drain(self.ctx, self.last_step, timeout)

    # ---- retire and held state ------------------------------------------------------------

    def retire(self, timeout: float | None = None) -> int:
        """Retire every step published in place; returns readers that had not finished.

        The registrations those steps used stop being held; the next put re-acquires what it
        still publishes and releases the rest (a registration idle since an earlier retire is
        released here)."""
        t = self.ctx.options.retire_timeout if timeout is None else timeout
        left = sum(self.ctx.catalog.readers.retire(s, timeout=t) for s in self._zero_copy_live)
        self._zero_copy_live.clear()
        self._release_unused()  # idle since before this retire: no put wanted them again
        self.registry.release("put")
        return left

    def _release_unused(self) -> None:
        """Release hook: unregister registrations no live version and no offer holds, and
        keep ``stats.registrations`` current."""
        self.registry.sweep()
        self.ctx.stats.registrations = self.registry.count

    def retire_all(self) -> int:
        """Before this rank's memory is freed or handed back (``close``): leave the session (its
        layouts vanish, so new plans skip it and other sources — replicas — keep serving its
        steps), wait (bounded) for the readers registered on the steps it exposed, and mark those
        steps torn *for this rank only*, so a read planned from a cached layout is discarded.
        Returns readers that had not finished."""
        cat = self.ctx.catalog
        s = cat.session
        pool = self._pool
        steps = sorted(
            set(self._zero_copy_live)
            | {x for x in (pool.slot_step if pool is not None else ()) if x is not None}
        )
        if s is None or not steps:
            return 0
        cat.client.revoke(s.lease_id)
        me = pad20(s.rank)
        left = 0
        for step in steps:
            left += cat.readers.wait_readers(step, self.ctx.options.retire_timeout, torn_as=me)
            cat.readers.mark_torn(step, me)
        if pool is not None:
            pool.clear_words()  # the memory goes: a reader checking a word afterwards discards its bytes
        self._zero_copy_live.clear()
        return left

    def held(self, step: int) -> list[tuple[ShardRecord, torch.Tensor]]:
        """This rank's shards of ``step`` as (record, tensor) while it still holds them.

        Raises:
            CheckpointError: the step's memory was reused (or never published here).
        """
        pool = self._pool
        if pool is not None and step in pool.slot_step and pool.buffer is not None:
            base = pool.slot_step.index(step) * pool.slot_size
            out = []
            for se in pool.entries:
                if se.source >= 0:
                    continue  # a pre-packed copy, not a shard
                t = pool.buffer[base + se.offset : base + se.offset + se.nbytes]
                out.append((se.record(self.ctx.rank, 0, 0), t.view(torch_dtype(se.dtype)).view(se.box.sizes)))
            staged = self._items_of or []  # the entries the slots were laid out for, in slot order
            if any(e.aliases for e in staged):  # tied weights: their bytes under every name
                out = [(a, t) for e, (r, t) in zip(staged, out) for a in with_aliases([e], [r])]
            return out
        if step in self._zero_copy_live and self._zero_copy_entries:
            return [
                (r, e.tensor)
                for e in self._zero_copy_entries
                for r in with_aliases([e], [e.record(self.ctx.rank)])
            ]
        raise CheckpointError(
            f"rank {self.ctx.rank} no longer holds step {step} (its staging slot was reused); "
            "checkpoint a step right after putting it"
        )

    @property
    def staging(self) -> tuple[int, int, str | None]:
        """(bytes, slots, device) of the snapshot pool; (0, 0, None) before the first snapshot."""
        pool = self._pool
        if pool is None:
            return 0, 0, None
        return pool.nbytes, pool.depth, str(self._pool_device)

    def close(self) -> None:
        # Drop every reference to the caller's tensors and the snapshot slots now: a closed store's
        # objects hold reference cycles, and in a process with torch's ~10^5 long-lived objects the
        # cycle collector reaches them only every ~100 stores (issue 29's growth per open/close).
        if self._pool is not None:
            self._pool.clear_words()  # its memory goes: no reader may take a word for its bytes
        self._pool = None
        self._zero_copy_entries, self._items_of = [], None
        self._packs_entries, self._items_of_packs = None, None
        self._nbytes_of, self._packs, self._items = None, (), ()
        self._tensors = ValidatedTensors("put(tensors)")

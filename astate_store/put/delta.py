"""Change maps, the publisher's side (delta versions, docs/delta.md): while a put copies its shards
into a staging slot, the same pass compares them with the previous version (still in the
previous slot, or in this very slot at staging depth 1), encodes what changed per tile and
hashes every tile; the encoded tiles and one index row per tile go into the slot's delta area.

A slot is laid out as ``[snapshot | index rows | encoded changes]`` (``SnapshotPool`` asks
:meth:`DeltaStager.area_bytes` for the last two): the rows of version N describe the changes
from this rank's previous put to N, so they live and die with N's slot, under N's step word.

Call sequence (``SnapshotPool.fill`` -> :meth:`DeltaStager.stage`):

1. the base: the slot and step of this rank's last fill in the same slot layout (None after a
   new layout, or in a new process: every tile is then read whole);
2. the native compare-and-copy (``_delta.stage``) of every CPU shard whose tensor is contiguous
   and of the slot's dtype: one pass, three streams (tensor, base, slot), no extra copy; other
   shards are copied by torch and marked raw (with their digests);
3. tiles whose encoding does not fit the slot's room for changes (``delta_budget``) go raw;
4. the encoded tiles are placed after the index, and the rows written: the :class:`Delta` for
   the piece's record (``last``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from astate_store.catalog.deltas import Delta
from astate_store.model import delta_format as fmt
from astate_store.model.delta_native import GE_COLS, SH_COLS, TL_COLS, hashing, native, table, threads
from astate_store.model.dtypes import itemsize, torch_dtype

if TYPE_CHECKING:
    from astate_store.put.staging import SlotEntry, SnapshotPool

__all__ = ["DeltaStager", "ALIGN"]

log = logging.getLogger("astate_store.put.delta")

ALIGN = 256  # as the staging's shards
_STREAM_MIN = 32 << 20  # non-temporal stores past a last-level cache (as the plain copy)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _shards(entries: Sequence[SlotEntry]) -> list[SlotEntry]:
    """The slot's shard entries (pre-packed copies are not tracked: consumers of deltas read shards)."""
    return [e for e in entries if e.source < 0]


class _Geometry:
    """One slot layout's tiles: per shard its tiling and first row, and the delta area's parts."""

    def __init__(self, entries: Sequence[SlotEntry], data_end: int, slot_size: int):
        self.shards = _shards(entries)
        self.tilings = [fmt.tiling(tuple(e.box.sizes), itemsize(e.dtype)) for e in self.shards]
        counts = np.array([t.ntiles for t in self.tilings], dtype=np.int64)
        self.first = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)  # first row per shard
        self.ntiles = int(self.first[-1])
        self.index_at = data_end  # offsets within a slot
        self.data_at = data_end + _align(self.ntiles * fmt.ROW_BYTES)
        self.cap = max(0, slot_size - self.data_at)
        # per tile: elements and bytes (for the raw decision and the figures)
        self.elems = (
            np.concatenate([t.tile_elements() for t in self.tilings]).astype(np.int64)
            if self.ntiles
            else np.zeros(0, dtype=np.int64)
        )
        self.esize = np.repeat(np.array([t.esize for t in self.tilings], dtype=np.int64), counts)
        # the native rows without addresses: esize, C, TC, gc, P, TB, gb, nbands, first row
        self.rows = table(len(self.shards), SH_COLS, np.uint64)
        for i, (e, t) in enumerate(zip(self.shards, self.tilings)):
            self.rows[i, 3:] = (t.esize, t.C, t.TC, t.gc, t.P, t.TB, t.gb, t.nbands, self.first[i])
        self.offsets = np.array([e.offset for e in self.shards], dtype=np.uint64)


class DeltaStager:
    """The change maps of one snapshot pool (host memory only)."""

    def __init__(self, budget: float):
        self.budget = budget  # the changes' room per slot, a fraction of the snapshot bytes
        self._geo: tuple[object, _Geometry] | None = None  # (pool signature, geometry)
        self._eligible: tuple[object, np.ndarray, list[int]] | None = None  # (key, native shard idx, others)
        self._prev: tuple[int, int, object] | None = None  # (slot, step, pool signature) of the last fill
        self._arenas: object = None  # the native pass's per-thread buffers, kept from put to put
        self.last: Delta | None = None  # what the last stage() recorded

    # ---- layout ----------------------------------------------------------------------------

    def area_bytes(self, entries: Sequence[SlotEntry]) -> int:
        """The bytes a slot needs after its snapshot: the index rows, then the room for changes."""
        shards = _shards(entries)
        rows = fmt.index_rows([(tuple(e.box.sizes), itemsize(e.dtype)) for e in shards])
        data = sum(e.nbytes for e in shards)
        return _align(int(rows[-1]) * fmt.ROW_BYTES) + _align(int(self.budget * data))

    def _geometry(self, pool: SnapshotPool) -> _Geometry:
        if self._geo is None or self._geo[0] is not pool.signature:
            self._geo = (pool.signature, _Geometry(pool.entries, pool.data_bytes, pool.slot_size))
            self._eligible = None
        return self._geo[1]

    def _split(
        self, geo: _Geometry, tensors: Sequence[torch.Tensor], key: object
    ) -> tuple[np.ndarray, list[int]]:
        """(shards the native pass copies, the others): CPU tensors of the slot's dtype and shape,
        contiguous and not empty. Cached per ``key`` (the publisher's validated entries)."""
        hit = self._eligible
        if key is not None and hit is not None and hit[0] is key:
            return hit[1], hit[2]
        native_idx, rest = [], []
        for i, (e, t) in enumerate(zip(geo.shards, tensors)):
            if (
                t.device.type == "cpu"
                and t.dtype == torch_dtype(e.dtype)
                and t.is_contiguous()
                and tuple(t.shape) == tuple(e.box.sizes)
            ):
                if t.numel():
                    native_idx.append(i)
            else:
                rest.append(i)
        out = (np.array(native_idx, dtype=np.int64), rest)
        if key is not None:
            self._eligible = (key, *out)
        return out

    # ---- one put ---------------------------------------------------------------------------

    def base(self, pool: SnapshotPool) -> tuple[int, int] | None:
        """(slot, step) of the previous fill, while the pool's layout and that slot are unchanged."""
        p = self._prev
        if p is None or p[2] is not pool.signature or pool.slot_step[p[0]] != p[1]:
            return None
        return p[0], p[1]

    def stage(
        self, pool: SnapshotPool, k: int, tensors: Sequence[torch.Tensor], step: int, key: object = None
    ) -> None:
        """Copy the shard tensors into slot k, recording their changes since the base (steps in
        the module docstring); ``last`` holds the record afterwards."""
        assert pool.buffer is not None and pool.region is not None
        geo = self._geometry(pool)
        base = self.base(pool)
        nat, rest = self._split(geo, tensors, key)
        buf = pool.buffer
        ptr, slot = buf.data_ptr(), k * pool.slot_size
        rows = geo.rows[nat].copy()
        if len(nat):
            src = np.fromiter((tensors[i].data_ptr() for i in nat.tolist()), np.uint64, len(nat))
            rows[:, 0] = src
            rows[:, 1] = np.uint64(ptr + slot) + geo.offsets[nat]
            rows[:, 2] = np.uint64(ptr + base[0] * pool.slot_size) + geo.offsets[nat] if base else 0
        tiles = table(geo.ntiles, TL_COLS, np.uint64)
        nbytes = sum(int(tensors[i].nbytes) for i in nat.tolist())
        streaming = int(nbytes >= _STREAM_MIN and (base is None or base[0] != k))
        with torch.no_grad():
            arenas = native().stage(rows, tiles, threads=threads(), streaming=streaming, arenas=self._arenas)
            self._arenas = arenas
            if rest:
                self._copy_rest(pool, k, geo, tensors, rest, tiles)
        self._finish(pool, k, geo, tiles, arenas, base)
        self._prev = (k, step, pool.signature)

    def _copy_rest(
        self,
        pool: SnapshotPool,
        k: int,
        geo: _Geometry,
        tensors: Sequence[torch.Tensor],
        rest: list[int],
        tiles: np.ndarray,
    ) -> None:
        """Shards the native pass does not take (another device, dtype or layout): torch copies
        them, and their tiles are raw (read whole), with digests of the slot's bytes."""
        assert pool.buffer is not None
        base = k * pool.slot_size
        views = []
        for i in rest:
            e = geo.shards[i]
            views.append(
                pool.buffer[base + e.offset : base + e.offset + e.nbytes]
                .view(torch_dtype(e.dtype))
                .view(e.box.sizes)
            )
        torch._foreach_copy_(views, [tensors[i] for i in rest])
        for i in rest:
            t, lo = geo.tilings[i], int(geo.first[i])
            hi = lo + t.ntiles
            if not t.ntiles:
                continue
            tiles[lo:hi, 0] = (geo.elems[lo:hi].astype(np.uint64)) | np.uint64(fmt.ENC_RAW << fmt.ENC_SHIFT)
            if hashing():
                addr = pool.buffer.data_ptr() + base + geo.shards[i].offset
                tiles[lo:hi, 2] = slot_digests(addr, t)

    def _finish(
        self,
        pool: SnapshotPool,
        k: int,
        geo: _Geometry,
        tiles: np.ndarray,
        arenas: object,
        base: tuple[int, int] | None,
    ) -> None:
        """Raw where the changes do not fit; place the encoded tiles; write the index rows."""
        assert pool.buffer is not None and pool.region is not None
        lens = tiles[:, 1].astype(np.int64)
        word = tiles[:, 0]
        total = int(lens.sum())
        if total > geo.cap:
            # The densest tiles (most encoded bytes per byte of tile) are read whole instead.
            ratio = lens / np.maximum(geo.elems * geo.esize, 1)
            order = np.argsort(-ratio, kind="stable")
            left = total - np.cumsum(lens[order])  # bytes still encoded once order[:i+1] went raw
            raw = order[: int(np.argmax(left <= geo.cap)) + 1]
            counts = word[raw] & np.uint64(fmt.COUNT_MASK)
            word[raw] = counts | np.uint64(fmt.ENC_RAW << fmt.ENC_SHIFT)
            lens[raw] = 0
            log.info(
                "delta: %d of %d tiles go whole: their changes (%d bytes) pass the room of %d bytes "
                "(delta_budget)",
                len(raw),
                geo.ntiles,
                total,
                geo.cap,
            )
        slot = k * pool.slot_size
        data_at = slot + geo.data_at
        ends = data_at + np.cumsum(lens)
        begins = ends - lens
        moved = lens > 0
        if moved.any():
            place = np.stack(
                [
                    tiles[moved, 3],
                    lens[moved].astype(np.uint64),
                    (pool.buffer.data_ptr() + begins[moved]).astype(np.uint64),
                ],
                axis=1,
            )
            native().place(arenas, np.ascontiguousarray(place, dtype=np.uint64))
        index = pool.buffer.numpy()[slot + geo.index_at : slot + geo.index_at + geo.ntiles * fmt.ROW_BYTES]
        rows = index.view(np.uint64).reshape(-1, 4)
        rows[:, 0] = begins
        rows[:, 1] = ends
        rows[:, 2] = word
        rows[:, 3] = tiles[:, 2]
        counts = word & np.uint64(fmt.COUNT_MASK)
        digest = native().hash(np.ascontiguousarray(tiles[:, 2])) if hashing() and geo.ntiles else 0
        self.last = Delta(
            None if base is None else base[1],
            pool.region,
            slot + geo.index_at,
            geo.ntiles,
            data_at,
            int(lens.sum()),
            int(counts.sum()),
            int(geo.elems.sum()),
            digest,
        )

    def forget(self) -> None:
        """The slots' bytes can no longer serve as a base (the pool was laid out anew or freed)."""
        self._prev = None


def slot_digests(addr: int, t: fmt.Tiling) -> np.ndarray:
    """XXH3-64 of every tile of a contiguous shard at ``addr`` (this process's memory)."""
    R = max(t.R, 1)
    row_map = np.arange(R, dtype=np.int64) * t.C
    geo = table(1, GE_COLS)
    geo[0] = (t.esize, t.C, t.TC, t.nbands, t.gb, t.P, t.TB, row_map.ctypes.data, 0, t.C, 1, addr)
    ids = np.zeros((t.ntiles, 2), dtype=np.int64)
    ids[:, 1] = np.arange(t.ntiles)
    out = np.zeros(t.ntiles, dtype=np.uint64)
    native().digest(geo, ids, out, threads=threads())
    return out

"""The wire format of change maps (delta versions): how a shard is cut into tiles, what one index
row says about a tile, and which tiles a box of a shard touches. Pure: both the publisher
(``put/delta.py``) and the consumer (``get/delta.py``) compute the same numbers from it.

A shard (a contiguous box of ``sizes``, element size ``esize``) is seen as a 2-D array of ``R``
rows (every dim but the last) by ``C`` columns (the last dim), and cut into *tiles*: boxes of at
most ``TILE_BYTES`` bytes, so that a consumer reading part of a shard reads the changes of the
tiles its box touches and no others.

- Columns: ``C`` elements are cut into ``gc`` blocks of ``TC`` once a row holds at least
  ``COL_SPLIT_MIN`` elements: 8 blocks (else 4, else 2) when they are whole cache lines, so a
  consumer split on the last dim in that many even parts reads only its own blocks; else about 8
  blocks rounded up to whole lines (``_column_block``); narrower still where one row passes
  ``TILE_BYTES``.
- Rows: from the innermost leading dim outwards, whole dims while the tile stays within
  ``TILE_BYTES``; then dim ``d`` in blocks of ``t`` (so a split on ``d`` aligns too); the dims
  before ``d`` in blocks of 1. In the 2-D view a *band* is ``TB = t * M`` consecutive rows
  (``M``: rows per element of dim ``d``), and band ``j`` starts at row
  ``(j // gb) * P + (j % gb) * TB`` with ``P = sizes[d] * M`` rows per element of the dims
  before ``d``; the last band of each period may be shorter.
- Tile ``k`` is band ``k % nbands`` of column block ``k // nbands`` (column block major: a
  consumer split on the last dim reads one run of index rows per block).

Index rows (``ROW_BYTES``, four little-endian uint64 words), one per tile, in tile order, the
shards of a rank in the order of their byte offsets in the staging slot (distinct offsets: a
tied weight's aliases share their shard's tiles):

    (begin, end, count | encoding << ENC_SHIFT, digest)

``begin``/``end``: the tile's encoded bytes in the publisher's region (absolute offsets; empty
for ``ENC_NONE`` and ``ENC_RAW``); ``count``: elements changed since the base version;
``digest``: XXH3-64 of the tile at this version (0: unknown): of its bytes, its rows in order (the
compare-and-copy gathers a column block's rows while each is in cache).
Encodings (the bytes of a tile: an index part, then ``count`` values of ``esize`` bytes each,
the new values in index order):

- ``ENC_NONE``: nothing changed (count 0).
- ``ENC_VARINT``: the tile-local indices (row-major in the tile), each as the gap from the
  previous one minus one (the first: from -1), unsigned LEB128.
- ``ENC_BITMAP``: one bit per tile element (LSB first), set where it changed.
- ``ENC_RAW``: too dense to be worth a map: read the tile itself from the version's slot.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "FORMAT",
    "TILE_BYTES",
    "COL_SPLIT_MIN",
    "COL_BLOCKS",
    "ROW_BYTES",
    "ENC_NONE",
    "ENC_VARINT",
    "ENC_BITMAP",
    "ENC_RAW",
    "ENC_SHIFT",
    "COUNT_MASK",
    "Tiling",
    "tiling",
    "index_rows",
]

FORMAT = 2  # the delta record's ``format``: this tiling and these digests (1: before whole-line blocks)
TILE_BYTES = 32 << 10
COL_SPLIT_MIN = 512
COL_BLOCKS = 8
LINE_BYTES = 64  # a cache line: column blocks are whole lines where the row allows
ROW_BYTES = 32
ENC_NONE, ENC_VARINT, ENC_BITMAP, ENC_RAW = 0, 1, 2, 3
ENC_SHIFT = 56
COUNT_MASK = (1 << ENC_SHIFT) - 1


@dataclass(frozen=True)
class Tiling:
    """The tiles of one shard (see the module docstring for the fields' meaning)."""

    sizes: tuple[int, ...]  # the shard's box sizes (a 0-d shard counts as (1,))
    esize: int  # bytes per element
    R: int  # rows of the 2-D view: the product of every dim but the last
    C: int  # columns: the last dim
    TC: int  # columns per block
    gc: int  # column blocks
    d: int  # the leading dim cut in blocks of t (-1: every leading dim whole in a band)
    t: int  # elements of dim d per band
    M: int  # rows per element of dim d (the product of the dims between d and the last)
    P: int  # rows per element of the dims before d
    TB: int  # rows per band (the last of each period may hold fewer)
    gb: int  # bands per period
    nbands: int

    @property
    def ntiles(self) -> int:
        return self.nbands * self.gc

    def tile(self, k: int) -> tuple[int, int, int, int]:
        """(first row, rows, first column, columns) of tile ``k``."""
        cb, j = divmod(k, self.nbands)
        lead, blk = divmod(j, self.gb)
        row0 = lead * self.P + blk * self.TB
        c0 = cb * self.TC
        return row0, min(self.TB, self.P - blk * self.TB), c0, min(self.TC, self.C - c0)

    def tile_elements(self) -> np.ndarray:
        """Elements of every tile, in tile order (int64)."""
        j = np.arange(self.nbands, dtype=np.int64) % self.gb
        rows = np.minimum(self.TB, self.P - j * self.TB)
        cb = np.arange(self.gc, dtype=np.int64)
        cols = np.minimum(self.TC, self.C - cb * self.TC)
        return (cols[:, None] * rows[None, :]).reshape(-1)

    def _lead(self) -> tuple[tuple[int, ...], int]:
        """(sizes of the dims before d, index of the last leading dim)."""
        return (self.sizes[: self.d] if self.d >= 0 else ()), len(self.sizes) - 2

    def tiles_touching(self, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """Sorted ids of the tiles that hold some element of the box (relative to the shard)."""
        bands = self._bands(offsets, sizes)
        if self.C == 0 or not len(bands):
            return np.zeros(0, dtype=np.int64)
        c_lo, c_hi = offsets[-1] // self.TC, (offsets[-1] + sizes[-1] - 1) // self.TC
        cbs = np.arange(c_lo, c_hi + 1, dtype=np.int64)
        return (cbs[:, None] * self.nbands + bands[None, :]).reshape(-1)

    def tiles_within(self, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """Sorted ids of the tiles all of whose elements lie in the box (relative to the shard)."""
        touching = self.tiles_touching(offsets, sizes)
        if not len(touching):
            return touching
        n = len(self.sizes)
        # rows: a band is inside when its block of dim d is, and every dim after d (before the
        # last) is whole in the box
        if any(sizes[k] != self.sizes[k] for k in range(self.d + 1, n - 1)):
            return touching[:0]
        cb, j = np.divmod(touching, self.nbands)
        ok = np.ones(len(touching), dtype=bool)
        if self.d >= 0:
            blk = j % self.gb
            lo = blk * self.t
            hi = np.minimum(lo + self.t, self.sizes[self.d])
            ok &= (lo >= offsets[self.d]) & (hi <= offsets[self.d] + sizes[self.d])
        c0 = cb * self.TC
        c1 = np.minimum(c0 + self.TC, self.C)
        ok &= (c0 >= offsets[-1]) & (c1 <= offsets[-1] + sizes[-1])
        return touching[ok]

    def _bands(self, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        if any(s <= 0 for s in sizes):
            return np.zeros(0, dtype=np.int64)
        if self.d < 0:
            return np.zeros(1, dtype=np.int64)
        lead_sizes = self.sizes[: self.d]
        if lead_sizes:
            grids = np.meshgrid(
                *[np.arange(o, o + s, dtype=np.int64) for o, s in zip(offsets[: self.d], sizes[: self.d])],
                indexing="ij",
            )
            lead = np.ravel_multi_index(tuple(g.reshape(-1) for g in grids), lead_sizes).astype(np.int64)
        else:
            lead = np.zeros(1, dtype=np.int64)
        b_lo = offsets[self.d] // self.t
        b_hi = (offsets[self.d] + sizes[self.d] - 1) // self.t
        blocks = np.arange(b_lo, b_hi + 1, dtype=np.int64)
        return (lead[:, None] * self.gb + blocks[None, :]).reshape(-1)

    def rows_of(self, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """The 2-D rows (sorted, int64) the box (relative to the shard) holds."""
        lead = self.sizes[:-1]
        if not lead:
            return np.zeros(1 if all(s > 0 for s in sizes) else 0, dtype=np.int64)
        if any(s <= 0 for s in sizes):
            return np.zeros(0, dtype=np.int64)
        grids = np.meshgrid(
            *[np.arange(o, o + s, dtype=np.int64) for o, s in zip(offsets[:-1], sizes[:-1])], indexing="ij"
        )
        return np.ravel_multi_index(tuple(g.reshape(-1) for g in grids), lead).astype(np.int64)


def _column_block(C: int, esize: int) -> int:
    """Columns per block of a row of ``C`` elements cut in blocks: ``C / g`` for the first ``g`` of
    8, 4, 2 that divides ``C`` into blocks of whole cache lines (so the blocks of a row align, as
    do even tensor-parallel splits in up to ``g`` parts); else ``C / COL_BLOCKS`` rounded up to
    whole lines. Whole lines keep the publisher's streaming stores whole and two threads of a
    consumer off each other's lines."""
    line = max(1, LINE_BYTES // esize)
    for g in (COL_BLOCKS, COL_BLOCKS // 2, COL_BLOCKS // 4):
        if C % g == 0 and (C // g) % line == 0:
            return C // g
    tc = -(-C // COL_BLOCKS)
    return -(-tc // line) * line


@functools.lru_cache(maxsize=65536)
def tiling(sizes: tuple[int, ...], esize: int) -> Tiling:
    """The tiles of a shard of box ``sizes`` and element size ``esize`` (module docstring)."""
    shape = sizes if sizes else (1,)
    C = int(shape[-1])
    lead = [int(s) for s in shape[:-1]]
    R = math.prod(lead)
    tc = max(C, 1)
    if C >= COL_SPLIT_MIN:
        tc = _column_block(C, esize)
    tc = max(1, min(tc, TILE_BYTES // esize))
    gc = -(-C // tc) if C else 0
    budget = max(1, TILE_BYTES // (tc * esize))
    M, d, t = 1, -1, 1
    for k in range(len(lead) - 1, -1, -1):
        if lead[k] * M <= budget:
            M *= lead[k]
            continue
        d, t = k, max(1, budget // M)
        break
    if d < 0:
        P = TB = max(R, 1) if R else 0
        gb = 1 if R else 0
        nbands = gb
        return Tiling(shape, esize, R, C, tc, gc, -1, 1, R, P, TB, gb, nbands)
    P = lead[d] * M
    TB = t * M
    gb = -(-lead[d] // t)
    nbands = math.prod(lead[:d]) * gb
    return Tiling(shape, esize, R, C, tc, gc, d, t, M, P, TB, gb, nbands)


def index_rows(shards: Sequence[tuple[tuple[int, ...], int]]) -> np.ndarray:
    """Each shard's first index row, and the total as a last element: a prefix sum of the
    tiles of ``shards`` = (box sizes, element size), in slot order."""
    counts = np.fromiter((tiling(tuple(s), e).ntiles for s, e in shards), dtype=np.int64, count=len(shards))
    return np.concatenate(([0], np.cumsum(counts))).astype(np.int64)

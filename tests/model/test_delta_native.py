"""The change maps' native kernels (``native/astate_delta.c``) against plain numpy: the put's
compare-and-copy (its AVX-512 and SSE2 builds alike) copies every byte, finds exactly the elements
whose bits changed, encodes them so that they decode to those elements and values, and hashes
every tile as the consumer's ``digest`` does; and the tiling keeps column blocks in whole cache
lines. End-to-end pulls through these maps are in ``tests/get/test_delta.py``."""

from __future__ import annotations

import numpy as np
import pytest

from astate_store.model import delta_format as fmt
from astate_store.model.delta_native import GE_COLS, SH_COLS, TL_COLS, hashing, native

ALIGN = 256

# (rows, columns, element size): widths whose column blocks are whole lines (896 x bf16 in 4
# blocks, 4864 in 8), rounded up to lines (1000), narrower than a line (37), one column block
# (128), every element size, and a shard that starts off a line (the second one, 37 x 4 bytes)
SHAPES = [(300, 896, 2), (40, 4864, 2), (70, 1000, 2), (33, 37, 4), (20, 128, 2), (9, 600, 1), (17, 520, 8)]


def test_column_blocks_are_whole_cache_lines() -> None:
    assert (fmt.tiling((896, 896), 2).TC, fmt.tiling((896, 896), 2).gc) == (224, 4)
    assert (fmt.tiling((896, 4864), 2).TC, fmt.tiling((896, 4864), 2).gc) == (608, 8)
    assert (fmt.tiling((64, 896), 4).TC, fmt.tiling((64, 896), 4).gc) == (112, 8)
    assert fmt.tiling((8, 1000), 2).TC == 128  # about 8 blocks, rounded up to lines
    for rows, cols, esize in SHAPES:
        t = fmt.tiling((rows, cols), esize)
        assert t.gc == 1 or (t.TC * esize) % fmt.LINE_BYTES == 0


class Slot:
    """Shards of SHAPES laid out as a staging slot does (each at a multiple of ALIGN), the
    previous version in ``prev``, the new one in ``src`` with ``fraction`` of its elements
    changed (raw bits: signed zeros and NaN payloads count)."""

    def __init__(self, fraction: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.tilings = [fmt.tiling((r, c), e) for r, c, e in SHAPES]
        self.offsets, at = [], 0
        for r, c, e in SHAPES:
            self.offsets.append(at + (36 if e == 4 else 0))  # one shard off a line
            at = -(-(self.offsets[-1] + r * c * e) // ALIGN) * ALIGN
        self.nbytes = at
        self.prev = np.zeros(at + 64, dtype=np.uint8)[:at]
        self.src = [rng.integers(0, 256, size=r * c * e, dtype=np.uint8) for r, c, e in SHAPES]
        for s, o in zip(self.src, self.offsets):
            self.prev[o : o + len(s)] = s
        self.changed = []
        for s, (r, c, e) in zip(self.src, SHAPES):
            pick = np.flatnonzero(rng.random(r * c) < fraction)
            s.view(f"u{e}")[pick] ^= np.array(1 << (8 * e - 1), dtype=f"u{e}")  # the sign bit
            self.changed.append(pick)
        self.first = np.concatenate(([0], np.cumsum([t.ntiles for t in self.tilings]))).astype(np.int64)

    def table(self, dst: np.ndarray, prev: np.ndarray | None) -> np.ndarray:
        rows = np.zeros((len(SHAPES), SH_COLS), dtype=np.uint64)
        for i, (t, s, o) in enumerate(zip(self.tilings, self.src, self.offsets)):
            base = 0 if prev is None else prev.ctypes.data + o
            rows[i] = (s.ctypes.data, dst.ctypes.data + o, base, t.esize, t.C, t.TC, t.gc, t.P, t.TB, t.gb,
                       t.nbands, self.first[i])  # fmt: skip
        return rows


def _decode(data: bytes, enc: int, count: int, esize: int, elems: int) -> tuple[np.ndarray, bytes]:
    """(tile-local indices, values) of one encoded tile, as the format says."""
    n_idx = len(data) - count * esize
    head, vals = data[:n_idx], data[n_idx:]
    if enc == fmt.ENC_BITMAP:
        bits = np.unpackbits(np.frombuffer(head, np.uint8), bitorder="little")[:elems]
        return np.flatnonzero(bits), vals
    idx, at, gap, shift = [], -1, 0, 0
    for b in head:
        gap |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            at += gap + 1
            idx.append(at)
            gap = shift = 0
    return np.array(idx, dtype=np.int64), vals


def _tile_elements(t: fmt.Tiling, k: int) -> np.ndarray:
    """Shard element numbers of tile k, in the tile's order (row-major)."""
    row0, nrows, c0, w = t.tile(k)
    return ((np.arange(row0, row0 + nrows)[:, None]) * t.C + np.arange(c0, c0 + w)[None, :]).reshape(-1)


def _arena_bytes(arenas: object, loc: int, n: int) -> bytes:
    out = np.zeros(max(n, 1), dtype=np.uint8)
    place = np.array([[loc, n, out.ctypes.data]], dtype=np.uint64)
    native().place(arenas, place)
    return out[:n].tobytes()


@pytest.mark.parametrize("simd", [1, 0], ids=["best", "sse2"])
@pytest.mark.parametrize("fraction", [0.02, 0.3], ids=["sparse", "dense"])
@pytest.mark.parametrize("where", ["other-slot", "in-place"])
def test_compare_and_copy_finds_exactly_the_changed_elements(simd: int, fraction: float, where: str) -> None:
    slot = Slot(fraction)
    dst = slot.prev if where == "in-place" else np.zeros(slot.nbytes + 64, dtype=np.uint8)[: slot.nbytes]
    tiles = np.zeros((int(slot.first[-1]), TL_COLS), dtype=np.uint64)
    arenas = native().stage(slot.table(dst, slot.prev), tiles, threads=2, streaming=1, simd=simd)
    encs = set((tiles[:, 0] >> np.uint64(fmt.ENC_SHIFT)).tolist())
    assert (fmt.ENC_VARINT if fraction < 0.1 else fmt.ENC_BITMAP) in encs
    for i, (t, s, o, changed) in enumerate(zip(slot.tilings, slot.src, slot.offsets, slot.changed)):
        assert dst[o : o + len(s)].tobytes() == s.tobytes()  # every byte copied
        found = []
        for k in range(t.ntiles):
            word, n, digest, loc = (int(x) for x in tiles[slot.first[i] + k])
            enc, count = word >> fmt.ENC_SHIFT, word & fmt.COUNT_MASK
            elems = _tile_elements(t, k)
            if hashing():
                assert digest == native().hash(s.view(f"u{t.esize}")[elems].tobytes())
            if enc == fmt.ENC_NONE:
                continue
            if enc == fmt.ENC_RAW:  # not worth a map: every element of the tile is read
                found.append(elems[np.isin(elems, changed)])
                continue
            idx, vals = _decode(_arena_bytes(arenas, loc, n), enc, count, t.esize, len(elems))
            assert len(idx) == count and vals == s.view(f"u{t.esize}")[elems[idx]].tobytes()
            found.append(elems[idx])
        got = np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)
        assert np.array_equal(got, np.sort(changed)), t


@pytest.mark.parametrize("simd", [1, 0], ids=["best", "sse2"])
def test_without_a_base_every_tile_is_raw_and_copied(simd: int) -> None:
    slot = Slot(0.02)
    dst = np.zeros(slot.nbytes, dtype=np.uint8)
    tiles = np.zeros((int(slot.first[-1]), TL_COLS), dtype=np.uint64)
    native().stage(slot.table(dst, None), tiles, threads=2, streaming=0, simd=simd)
    for s, o in zip(slot.src, slot.offsets):
        assert dst[o : o + len(s)].tobytes() == s.tobytes()
    assert ((tiles[:, 0] >> np.uint64(fmt.ENC_SHIFT)) == fmt.ENC_RAW).all()


@pytest.mark.skipif(not hashing(), reason="XXH3 not found in the xxhash package")
def test_consumer_digests_match_the_publishers() -> None:
    slot = Slot(0.02)
    dst = np.zeros(slot.nbytes, dtype=np.uint8)
    tiles = np.zeros((int(slot.first[-1]), TL_COLS), dtype=np.uint64)
    native().stage(slot.table(dst, slot.prev), tiles, threads=2)
    for i, (t, o) in enumerate(zip(slot.tilings, slot.offsets)):
        row_map = np.arange(t.R, dtype=np.int64) * t.C
        geo = np.zeros((1, GE_COLS), dtype=np.int64)
        at = dst.ctypes.data + o
        geo[0] = (t.esize, t.C, t.TC, t.nbands, t.gb, t.P, t.TB, row_map.ctypes.data, 0, t.C, 1, at)
        ids = np.zeros((t.ntiles, 2), dtype=np.int64)
        ids[:, 1] = np.arange(t.ntiles)
        out = np.zeros(t.ntiles, dtype=np.uint64)
        native().digest(geo, ids, out, threads=2)
        assert np.array_equal(out, tiles[slot.first[i] : slot.first[i + 1], 2])


def _leb(gaps: list[int]) -> bytes:
    out = bytearray()
    for g in gaps:
        while g >= 0x80:
            out.append((g & 0x7F) | 0x80)
            g >>= 7
        out.append(g)
    return bytes(out)


@pytest.mark.parametrize("simd", [1, 0], ids=["best", "scalar"])
def test_decode_checks_every_tile_before_it_writes_one(simd: int) -> None:
    """Pass A of a tile wholly inside its box: the gaps' count and sum against the tile, at every
    length of gap; only a well-formed tile is applied (pass B), every value where its index says."""
    t = fmt.tiling((64, 256), 2)  # one column block: tile 0 is 64 x 256 = 16384 elements
    elems = int(t.tile_elements()[0])
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(elems, 300, replace=False))
    idx[-1] = elems - 1  # the last element: the largest index a tile may name
    gaps = (np.diff(np.concatenate(([-1], idx))) - 1).tolist()
    cases = {  # name: (index stream, count, well-formed)
        "good": (_leb(gaps), len(idx), True),
        "two-byte gaps": (_leb([12000] + [200] * 10), 11, True),
        "one count too many": (_leb(gaps), len(idx) + 1, False),
        "past the tile": (_leb([elems - 5, 10]), 2, False),
        "cut in a gap": (_leb(gaps)[:-1] + b"\x80", len(idx), False),
        "a three-byte gap": (_leb([1 << 14]), 1, False),  # 16384: past the tile
        "a dangling continuation byte": (_leb([5]) + b"\x80", 1, False),  # in a last block shorter than 64
    }
    row_map = np.arange(t.R, dtype=np.int64) * t.C
    for name, (stream, count, ok) in cases.items():
        vals = rng.integers(1, 1 << 15, size=count, dtype=np.uint16)
        data = np.frombuffer(stream + vals.tobytes(), np.uint8).copy()
        dest = np.zeros(t.R * t.C, dtype=np.uint16)
        geo = np.zeros((1, GE_COLS), dtype=np.int64)
        geo[0] = (2, t.C, t.TC, t.nbands, t.gb, t.P, t.TB, row_map.ctypes.data, 0, t.C, 1, dest.ctypes.data)
        tiles = np.zeros((1, 7), dtype=np.int64)
        tiles[0, :5] = (0, 0, data.ctypes.data, count | (fmt.ENC_VARINT << fmt.ENC_SHIFT), len(data))
        bad, inside = native().decode(geo, tiles, threads=1, check=1, simd=simd)
        assert (bad == -1) == ok, name
        if not ok:
            continue
        assert inside == count, name
        native().decode(geo, tiles, threads=1, check=0, simd=simd)
        at = np.cumsum(np.array(_gaps(stream)) + 1) - 1
        want = np.zeros_like(dest)
        want[at] = vals
        assert np.array_equal(dest, want), name


def _gaps(stream: bytes) -> list[int]:
    out, g, shift = [], 0, 0
    for b in stream:
        g |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            out.append(g)
            g = shift = 0
    return out

"""The native copy loop (``copy_rows``): the memcpy of same-host mapped reads and of puts.

Threads take chunks of the concatenated rows in turn (a chunk may start and end inside a row),
and copies above a last-level cache use non-temporal stores. Whatever the threads, the chunk
cuts and the stores, every row must land byte for byte and nothing outside the rows may change.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astate_store.transport import binding
from astate_store.transport.binding import copy_rows, copy_streaming, native

SRC = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8)


def _plan(src: np.ndarray, dst: np.ndarray, rows: list[tuple[int, int, int]]) -> np.ndarray:
    plan = np.array([(src.ctypes.data + s, dst.ctypes.data + d, n) for s, d, n in rows], dtype=np.uint64)
    return plan.reshape(-1, 3)


def _expected(dst: np.ndarray, rows: list[tuple[int, int, int]]) -> np.ndarray:
    want = dst.copy()
    for s, d, n in rows:
        want[d : d + n] = SRC[s : s + n]
    return want


def _disjoint_rows(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Rows with odd lengths and offsets (zero-length ones too), destinations disjoint, in
    shuffled order, so chunks cut rows at unaligned places."""
    lens = draw(st.lists(st.integers(0, 70_000), min_size=1, max_size=40))
    gaps = draw(st.lists(st.integers(0, 77), min_size=len(lens), max_size=len(lens)))
    rows, at = [], draw(st.integers(0, 63))
    for n, g in zip(lens, gaps):
        s = draw(st.integers(0, SRC.size - n))
        rows.append((s, at, n))
        at += n + g
    return draw(st.permutations(rows))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.composite(_disjoint_rows)(),
    threads=st.integers(1, 4),
    streaming=st.sampled_from([-1, 0, 1]),
    split=st.sampled_from([0, 1 << 12, 8 << 20]),
)
def test_rows_land_exactly(
    rows: list[tuple[int, int, int]], threads: int, streaming: int, split: int
) -> None:
    dst = np.full(sum(n for _, _, n in rows) + 77 * len(rows) + 200, 0xA5, dtype=np.uint8)
    want = _expected(dst, rows)
    native().copy_rows(_plan(SRC, dst, rows), threads=threads, streaming=streaming, split_bytes=split)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("streaming", [0, 1, -1])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_big_rows_cut_into_chunks(threads: int, streaming: int) -> None:
    """40 MiB (above the streaming threshold) in one row and in a few thousand 7-byte-skewed
    rows: with several threads it is cut into 1 MiB+ chunks, inside rows."""
    n = 40 << 20
    src = np.random.default_rng(threads).integers(0, 256, n + 64, dtype=np.uint8)
    dst = np.zeros(n + 128, dtype=np.uint8)
    one = np.array([[src.ctypes.data + 3, dst.ctypes.data + 5, n]], dtype=np.uint64)
    native().copy_rows(one, threads=threads, streaming=streaming)
    assert np.array_equal(dst[5 : 5 + n], src[3 : 3 + n]) and not dst[:5].any() and not dst[5 + n :].any()
    piece = 12_345
    m = n // piece
    dst[:] = 0
    plan = np.empty((m, 3), dtype=np.uint64)
    plan[:, 0] = src.ctypes.data + 7 + np.arange(m, dtype=np.uint64) * piece
    plan[:, 1] = dst.ctypes.data + 1 + np.arange(m, dtype=np.uint64)[::-1] * piece  # reversed order
    plan[:, 2] = piece
    native().copy_rows(plan, threads=threads, streaming=streaming)
    got = dst[1 : 1 + m * piece].reshape(m, piece)[::-1].reshape(-1)
    assert np.array_equal(got, src[7 : 7 + m * piece]) and dst[0] == 0 and not dst[1 + m * piece :].any()


@pytest.mark.parametrize("streaming", [0, 1])
def test_chunk_edges_on_row_edges_and_empty_rows(streaming: int) -> None:
    """Rows of exactly one chunk (1 MiB, the smallest) with empty rows between them: chunk
    starts fall on row starts and on the empty rows."""
    piece, m = 1 << 20, 40
    src = np.random.default_rng(3).integers(0, 256, piece * m, dtype=np.uint8)
    dst = np.zeros(piece * m, dtype=np.uint8)
    rows = []
    for i in range(m):
        rows.append((src.ctypes.data + i * piece, dst.ctypes.data + (m - 1 - i) * piece, piece))
        rows.append((src.ctypes.data, dst.ctypes.data, 0))
    plan = np.array(rows, dtype=np.uint64)
    native().copy_rows(plan, threads=3, streaming=streaming)
    assert np.array_equal(dst.reshape(m, piece)[::-1].reshape(-1), src)


def test_empty_plan_and_bad_plans() -> None:
    native().copy_rows(np.empty((0, 3), dtype=np.uint64), threads=4, streaming=1)
    with pytest.raises(ValueError, match="3 columns"):
        native().copy_rows(np.zeros((2, 4), dtype=np.uint64))
    with pytest.raises(TypeError):
        native().copy_rows(np.zeros((1, 3), dtype=np.uint64), streaming="yes")


def test_streaming_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """ASTATE_COPY_STREAMING picks the stores; ``copy_rows`` passes it (and the threads) on."""
    for env, want in (("", -1), ("0", 0), ("off", 0), ("1", 1), ("yes", 1), ("junk", -1)):
        monkeypatch.setenv("ASTATE_COPY_STREAMING", env)
        assert copy_streaming() == want
    seen: list[dict[str, int]] = []
    real = native().copy_rows
    monkeypatch.setattr(native(), "copy_rows", lambda plan, **k: (seen.append(k), real(plan, **k)))
    monkeypatch.setenv("ASTATE_COPY_STREAMING", "0")
    monkeypatch.setenv("ASTATE_COPY_THREADS", "3")
    dst = np.zeros(100, dtype=np.uint8)
    copy_rows(_plan(SRC, dst, [(10, 0, 100)]))
    copy_rows(_plan(SRC, dst, [(10, 0, 100)]), threads=1)
    assert seen == [{"threads": 3, "streaming": 0}, {"threads": 1, "streaming": 0}]
    assert np.array_equal(dst, SRC[10:110]) and binding.copy_threads() == 3

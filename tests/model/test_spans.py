"""Byte ranges merged into runs (``spans.span_runs``): what prefaulting maps for a pull."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astate_store.model.spans import span_runs

ranges = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 1 << 22), st.integers(0, 1 << 16)), max_size=200
)


@settings(max_examples=200, deadline=None)
@given(ranges, st.integers(1, 1 << 18), st.integers(1, 8))
def test_runs_cover_every_range_and_keep_the_widest_gaps(
    rs: list[tuple[int, int, int]], gap: int, max_runs: int
) -> None:
    key = np.array([k for k, _, _ in rs], dtype=np.int64)
    lo = np.array([a for _, a, _ in rs], dtype=np.int64)
    hi = lo + np.array([n for _, _, n in rs], dtype=np.int64)
    runs = span_runs(key, lo, hi, gap=gap, max_runs=max_runs)
    per: dict[int, list[tuple[int, int]]] = {}
    for k, a, b in runs:
        per.setdefault(k, []).append((a, b))
    assert runs == sorted(runs)
    real = [(k, a, a + n) for k, a, n in rs if n]
    assert set(per) == {k for k, _, _ in real}
    for k, a, b in real:  # every range inside one run of its key
        assert any(x <= a and b <= y for x, y in per[k])
    starts = {(k, a) for k, a, _ in real}
    ends = {(k, b) for k, _, b in real}
    for k, spans in per.items():
        assert len(spans) <= max_runs
        assert all((k, a) in starts and (k, b) in ends for a, b in spans)  # no byte invented at the edges
        gaps = [c - b for (_, b), (c, _) in zip(spans, spans[1:])]
        assert all(g >= gap for g in gaps)  # closer ranges share a run
        # the gaps kept are the widest: every gap closed inside a run is no wider than those kept
        inside = _inner_gaps([(a, b) for kk, a, b in real if kk == k])
        closed = [g for g in inside if g > 0 and g not in gaps]
        if gaps and closed and len(spans) == max_runs:
            assert max(closed) <= min(gaps)


def _inner_gaps(rs: list[tuple[int, int]]) -> list[int]:
    """The holes between the union's pieces of these ranges."""
    out, reach = [], None
    for a, b in sorted(rs):
        if reach is not None and a > reach:
            out.append(a - reach)
        reach = b if reach is None else max(reach, b)
    return out


def test_runs_examples() -> None:
    # overlapping, touching, near (under the gap) and far ranges; an empty one is dropped
    got = span_runs([0, 0, 0, 0, 0, 1], [0, 50, 100, 100_000, 7, 5], [60, 100, 150, 100_010, 7, 9], gap=1000)
    assert got == [(0, 0, 150), (0, 100_000, 100_010), (1, 5, 9)]
    assert span_runs([], [], []) == []
    # four equally spaced ranges thinned to two runs: the first gap stays (stable)
    assert span_runs([0] * 4, [0, 10, 20, 30], [5, 15, 25, 35], gap=1, max_runs=2) == [(0, 0, 5), (0, 10, 35)]
    # offsets near 2**40 with many keys take the per-key path of the running maximum
    keys = np.arange(1 << 12, dtype=np.int64)
    big = span_runs(keys, np.full(len(keys), 1 << 50), np.full(len(keys), (1 << 50) + 8))
    assert big == [(k, 1 << 50, (1 << 50) + 8) for k in range(1 << 12)]
    with pytest.raises(ValueError, match="max_runs"):
        span_runs([0], [0], [1], max_runs=0)

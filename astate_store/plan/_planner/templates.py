"""Run geometry: the coalesced run template of copying one box between two strided memories.

Templates depend only on (sizes, source strides, destination strides, item sizes), so each is
computed once per distinct geometry and shared by every consumer and layer that has it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from astate_store.plan._planner.util import unique_rows

#: ``(n_runs, run_elems, outer)``: see ``run_template``.
Template = tuple[int, int, tuple[tuple[int, int, int], ...]]


def run_template(sz: Sequence[int], ss: Sequence[int], ds: Sequence[int]) -> Template:
    """Coalesced run structure of copying a box of sizes ``sz`` between memories with element
    strides ``ss`` (source) and ``ds`` (destination).

    Returns ``(n_runs, run_elems, outer)``, ``outer`` a tuple of ``(size, src_stride, dst_stride)``
    from outermost to innermost; enumerating it row-major gives increasing source addresses.
    """
    if any(s == 0 for s in sz):
        return (0, 0, ())
    # innermost run: absorb every dim that is dense in both memories at the current run length
    rem = [d for d in range(len(sz)) if sz[d] > 1]
    run = 1
    progress = True
    while progress:
        progress = False
        for d in rem:
            if ss[d] == run and ds[d] == run:
                run *= sz[d]
                rem.remove(d)
                progress = True
                break
    # outer dims by decreasing source stride; neighbours that nest in both memories merge
    outer = sorted(((sz[d], ss[d], ds[d]) for d in rem), key=lambda x: (-x[1], -x[2]))
    merged: list[tuple[int, int, int]] = []
    for size, s, d in outer:
        if merged and merged[-1][1] == s * size and merged[-1][2] == d * size:
            merged[-1] = (merged[-1][0] * size, s, d)
        else:
            merged.append((size, s, d))
    n = 1
    for size, _, _ in merged:
        n *= size
    return (n, run, tuple(merged))


def rel_offsets(tm: Template, sisz: int, disz: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets of each run of a template relative to the piece origin (src, dst)."""
    src = np.zeros(1, np.int64)
    dst = np.zeros(1, np.int64)
    for size, s, d in tm[2]:
        ar = np.arange(size, dtype=np.int64)
        src = (src[:, None] + ar[None, :] * (s * sisz)).ravel()
        dst = (dst[:, None] + ar[None, :] * (d * disz)).ravel()
    if tm[0] == 0:
        return src[:0], dst[:0]
    return src, dst


class Templates:
    """Interned templates of one plan: ids index the parallel lists; relative run offsets are
    built lazily (only multi-run templates of a materialized consumer need them)."""

    def __init__(self) -> None:
        self.index: dict[tuple, int] = {}
        self.n: list[int] = []
        self.run: list[int] = []
        self.tm: list[Template] = []
        self.sisz: list[int] = []
        self.disz: list[int] = []
        self._rel: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, sz: tuple, ss: tuple, ds: tuple, sisz: int, disz: int) -> int:
        k = (sz, ss, ds, sisz, disz)
        i = self.index.get(k)
        if i is None:
            tm = run_template(sz, ss, ds)
            i = len(self.n)
            self.index[k] = i
            self.n.append(tm[0])
            self.run.append(tm[1])
            self.tm.append(tm)
            self.sisz.append(sisz)
            self.disz.append(disz)
        return i

    def copy(self) -> Templates:
        """An independent copy (interning more templates into it leaves this one as it is)."""
        new = Templates()
        new.index, new.n, new.run, new.tm = dict(self.index), list(self.n), list(self.run), list(self.tm)
        new.sisz, new.disz, new._rel = list(self.sisz), list(self.disz), dict(self._rel)
        return new

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(n_runs, run_elems, src itemsize, dst itemsize)`` per template id."""
        return (
            np.array(self.n, np.int64),
            np.array(self.run, np.int64),
            np.array(self.sisz, np.int64),
            np.array(self.disz, np.int64),
        )

    def rel(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        r = self._rel.get(i)
        if r is None:
            r = rel_offsets(self.tm[i], self.sisz[i], self.disz[i])
            self._rel[i] = r
        return r


def template_ids(tmpl: Templates, key_rows: np.ndarray, D: int) -> np.ndarray:
    """Template id per row of ``[sz(D), ss(D), ds(D), sisz, disz]`` (deduplicated first)."""
    if len(key_rows) == 0:
        return np.zeros(0, np.int64)
    uk, _, inv = unique_rows(key_rows)
    ids = np.empty(len(uk), np.int64)
    for j, row in enumerate(uk.tolist()):
        ids[j] = tmpl.get(
            tuple(row[:D]), tuple(row[D : 2 * D]), tuple(row[2 * D : 3 * D]), row[3 * D], row[3 * D + 1]
        )
    return ids[inv.reshape(-1)]

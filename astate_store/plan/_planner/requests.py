"""Stage 2, consumer requests: deduplicate the consumers' destination sequences and compile the
distinct ones into validated arrays (boxes, strides, dtypes, buffers).

Consumers with equal requests (a fleet of identical TP ranks) share every later per-piece
computation, so this stage decides how much work the rest of the pipeline does.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from astate_store.errors import PlanError
from astate_store.model.dtypes import DTYPE_CODES, FLOATING
from astate_store.model.layout import ShardRecord
from astate_store.plan._planner.shards import Sources
from astate_store.plan._planner.util import unique_rows


def dedupe_requests(
    requests: Mapping[Hashable, Sequence[ShardRecord]], consumers: list
) -> tuple[list[tuple], np.ndarray]:
    """Distinct request sequences and the sequence index of every consumer.

    Sequences are shared by object identity first (cheap), then by equal content; a consumer's
    position among those sharing its sequence is the default rotation.
    """
    seq_u: dict[int, int] = {}
    by_content: dict[tuple, list[int]] = {}
    seqs: list = []
    u_of_c = np.zeros(len(consumers), np.int64)
    for i, cid in enumerate(consumers):
        seq = requests[cid]
        u = seq_u.get(id(seq))
        if u is None:
            tup = tuple(seq)
            try:
                ck = (len(tup), hash(tup))
            except TypeError:
                ck = (len(tup), id(seq))
            for cand in by_content.get(ck, ()):
                if tuple(seqs[cand]) == tup:
                    u = cand
                    break
            if u is None:
                u = len(seqs)
                seqs.append(tup)
                by_content.setdefault(ck, []).append(u)
            seq_u[id(seq)] = u
        u_of_c[i] = u
    return seqs, u_of_c


def _overlaps(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a strided box addresses some byte twice (strides sorted must each clear the span
    of the dims inside them)."""
    dims = sorted((st, sz) for sz, st in zip(sizes, strides) if sz > 1)
    span = 1
    for st, sz in dims:
        if st < span:
            return True
        span += st * (sz - 1)
    return False


def _check_records(src: Sources, recs: list[ShardRecord]) -> tuple[list[int], list[int]]:
    """Tensor id and dtype code of each destination record, checking type, tensor, ndim, shape
    and dtype name against the layout."""
    tid = src.tid
    for r in recs:
        if not isinstance(r, ShardRecord):
            raise PlanError(f"destination must be a ShardRecord, got {type(r).__name__}")
    names = [r.name for r in recs]
    tids = [tid.get(nm, -1) for nm in names]
    for nm, t in zip(names, tids):
        if t < 0:
            raise PlanError(f"tensor {nm!r}: requested but not in the layout")
    shapes = src.shapes
    for r, t in zip(recs, tids):
        gs = shapes[t]
        if len(r.box.offsets) != len(gs) or len(r.strides) != len(gs):
            raise PlanError(
                f"tensor {r.name!r}: destination box {r.box.offsets}+{r.box.sizes} / strides "
                f"{tuple(r.strides)} have a different ndim than the tensor {gs}"
            )
        if tuple(r.global_shape) != gs:
            raise PlanError(
                f"tensor {r.name!r}: destination global shape {tuple(r.global_shape)} disagrees "
                f"with the layout {gs}"
            )
    codes = [DTYPE_CODES.get(r.dtype, -1) for r in recs]
    for r, c in zip(recs, codes):
        if c < 0:
            raise PlanError(f"tensor {r.name!r}: unknown destination dtype {r.dtype!r}")
    return tids, codes


class Requests:
    """Destination records of the distinct request sequences, concatenated (one row each).

    ``u`` is the row's sequence index, ``index`` its position in that sequence; ``lo``/``sz``/
    ``st`` are padded to the sources' ``D`` dims like ``Sources``.
    """

    def __init__(self, src: Sources, seqs: list[Sequence[ShardRecord]]):
        D = src.D
        recs: list[ShardRecord] = []
        u_list: list[int] = []
        idx_list: list[int] = []
        for u, seq in enumerate(seqs):
            seq = list(seq)
            recs.extend(seq)
            u_list.extend([u] * len(seq))
            idx_list.extend(range(len(seq)))
        n = len(recs)
        self.n = n
        self.recs = recs
        self.u = np.array(u_list, np.int64)
        self.index = np.array(idx_list, np.int64)
        tids, codes = _check_records(src, recs)
        pad0 = [(0,) * (D - k) for k in range(D + 1)]
        pad1 = [(1,) * (D - k) for k in range(D + 1)]
        self.t = np.array(tids, np.int64)
        self.code = np.array(codes, np.int64)
        if n:
            self.lo = np.array(
                [pad0[len(r.box.offsets)] + tuple(r.box.offsets) for r in recs], np.int64
            ).reshape(n, D)
            self.sz = np.array([pad1[len(r.box.sizes)] + tuple(r.box.sizes) for r in recs], np.int64).reshape(
                n, D
            )
            self.st = np.array([pad0[len(r.strides)] + tuple(r.strides) for r in recs], np.int64).reshape(
                n, D
            )
        else:
            self.lo = np.zeros((0, D), np.int64)
            self.sz = np.zeros((0, D), np.int64)
            self.st = np.zeros((0, D), np.int64)
        self.region = np.fromiter((r.region for r in recs), np.int64, n)
        self.off = np.fromiter((r.byte_offset for r in recs), np.int64, n)
        self._check_bounds(src)
        self.scode = src.t_code[self.t] if n else np.zeros(0, np.int64)
        self._check_conversion(src)
        self._check_aliasing(D)

    def _check_bounds(self, src: Sources) -> None:
        n, D, recs = self.n, src.D, self.recs
        shp = src.t_shape[self.t] if n else np.zeros((0, D), np.int64)
        bad = (self.lo < 0) | (self.sz < 0) | (self.lo + self.sz > shp)
        if bad.any():
            i = int(np.flatnonzero(bad.any(axis=1))[0])
            r = recs[i]
            raise PlanError(
                f"tensor {r.name!r}: destination box {r.box.offsets}+{r.box.sizes} is out of bounds "
                f"of the global shape {tuple(r.global_shape)}"
            )
        bad = (self.st < 0).any(axis=1) | (self.off < 0)
        if bad.any():
            r = recs[int(np.flatnonzero(bad)[0])]
            raise PlanError(f"tensor {r.name!r}: destination with negative strides or byte offset")

    def _check_conversion(self, src: Sources) -> None:
        # the data path converts only between float dtypes
        scode = self.scode
        diff = scode != self.code
        bad = diff & ~(FLOATING[scode] & FLOATING[self.code])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            r = self.recs[i]
            raise PlanError(
                f"tensor {r.name!r}: cannot convert {src.dtypes[self.t[i]]} to {r.dtype}; only "
                "float <-> float conversions are allowed"
            )

    def _check_aliasing(self, D: int) -> None:
        # a destination whose strides overlap would have a byte written twice; checked once per
        # distinct (sizes, strides)
        if not self.n:
            return
        key = np.concatenate([self.sz, self.st], axis=1)
        uk, first, _ = unique_rows(key)
        for row, i in zip(uk.tolist(), first.tolist()):
            if _overlaps(row[:D], row[D:]):
                r = self.recs[i]
                raise PlanError(
                    f"tensor {r.name!r}: destination strides {tuple(r.strides)} for sizes "
                    f"{r.box.sizes} overlap themselves"
                )

"""benchmarks/peers.py's shared work: the planner's reads for the sync_bench layout rebuild the
rollout's tensors exactly (so every peer that does those reads is checked against the same bytes)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import _peer_workers as P  # noqa: E402


def test_planner_reads_rebuild_the_rollout_buffer() -> None:
    work = P.build_work(1 / 32)
    regions = [P.make_region(work, r).numpy() for r in range(P.TP)]
    flat = torch.zeros(work.dst_bytes, dtype=torch.uint8)
    dst = flat.numpy()
    covered = np.zeros(work.dst_bytes, dtype=np.int8)
    for rank, reads in enumerate(work.reads):
        assert len(reads) and (reads[:, 0] + reads[:, 2] <= work.region_bytes[rank]).all()
        for src, off, n in reads:
            dst[off : off + n] = regions[rank][src : src + n]
            covered[off : off + n] += 1
    assert P.verify(work, flat) == []
    views = P.dst_views(work, flat)
    for name, t in views.items():  # every tensor byte written exactly once; padding untouched
        off = work.dst_offsets[name]
        assert (covered[off : off + t.numel() * 4] == 1).all(), name
    assert int(covered.sum()) == work.nbytes == sum(t.numel() * 4 for t in views.values())
    # row-parallel matrices are split on dim 1: one read per row half, so the plan has many rows
    assert work.n_reads > 2 * len(work.spec)


def test_a_wrong_offset_is_caught() -> None:
    work = P.build_work(1 / 32)
    flat = torch.zeros(work.dst_bytes, dtype=torch.uint8)
    regions = [P.make_region(work, r).numpy() for r in range(P.TP)]
    dst = flat.numpy()
    for rank, reads in enumerate(work.reads):
        for i, (src, off, n) in enumerate(reads):
            shift = 256 if (rank, i) == (1, 3) else 0  # one read from the wrong place
            dst[off : off + n] = regions[rank][src + shift : src + shift + n]
    assert len(P.verify(work, flat)) == 1

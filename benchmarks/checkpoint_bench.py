"""Checkpoint write / restore throughput on local disk, next to plain pyarrow writes and mmap reads.

Prints ONE JSON line. The model (default 2 GiB of float32, 8 tensors) is held by 2 in-process
"ranks" (row halves); every figure is total bytes / wall seconds, best of ``--reps`` runs. Reads
hit a warm page cache (the files were just written); writes go to the page cache (``*_fsync_*``:
flushed to disk with fsync).

    python benchmarks/checkpoint_bench.py [--gib 2] [--reps 3] [--dir /tmp]

Keys: bytes; checksum (the default: xxh3_64 with xxhash installed, else crc32); write_gbps
(write_part x2 + try_commit, default checksum, no fsync) vs plain_write_gbps (the same
bytes through LocalFileSystem.open_output_stream) -> ratio_write; write_fsync_gbps vs
plain_write_fsync_gbps; restore_gbps (same layout, verified) vs mmap_read_gbps (memory-map the files,
copy into preallocated tensors) -> ratio_restore; restore_noverify_gbps; restore_reshard_gbps
(column halves, two consumers in turn; each verifies every block it touches, which for column
halves is every block) -> ratio_reshard; restore_reshard_noverify_gbps; restore_bf16_gbps (fp32 -> bf16 while
reading); *_crc32_* with checksum="crc32" when the default is not crc32.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch

from astate_store import checkpoint as ck
from astate_store.model.layout import Shard


def _interleave(cases: dict, reps: int, out: dict) -> None:
    """Best wall time of each case over ``reps`` rounds; each round runs every case once."""
    best = {k: float("inf") for k in cases}
    for _ in range(reps):
        for k, (fn, before) in cases.items():
            before()
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    out.update(best)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--tensors", type=int, default=8)
    args = ap.parse_args()

    cols = 16384
    total = int(args.gib * (1 << 30))
    rows = max(2, total // (args.tensors * cols * 4) // 2 * 2)
    shape = (rows, cols)
    nbytes = args.tensors * rows * cols * 4
    torch.manual_seed(0)
    full = {f"layer{i}.w": torch.from_numpy(np.empty(shape, np.float32)) for i in range(args.tensors)}
    for t in full.values():
        t.uniform_()
    half = rows // 2
    parts = [
        ck.local_shards(
            {n: Shard(t[r * half : (r + 1) * half], (r * half, 0), shape) for n, t in full.items()}, rank=r
        )
        for r in range(2)
    ]
    root = tempfile.mkdtemp(prefix="astate-ckpt-bench-", dir=args.dir)
    out: dict[str, Any] = {
        "bytes": nbytes,
        "tensors": args.tensors,
        "shape": list(shape),
        "ranks": 2,
        "reps": args.reps,
        "cache": "writes: page cache, from a clean (synced) state; reads: warm page cache",
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "checksum": ck.DEFAULT_CHECKSUM,
    }
    step = [0]
    try:
        fs = pafs.LocalFileSystem()

        def fresh(d: str) -> Callable[[], None]:
            """Each case deletes only its own previous output, so every case reuses the pages it
            freed, then syncs: every timed write starts with no dirty pages pending."""

            def run() -> None:
                shutil.rmtree(d, ignore_errors=True)
                os.sync()

            return run

        def ckpt(d: str, checksum: str | None = None, fsync: bool = False) -> Callable[[], None]:
            def run() -> None:
                step[0] += 1
                for r in range(2):
                    ck.write_part(d, step[0], r, 2, parts[r], checksum=checksum, fsync=fsync)
                assert ck.try_commit(d, step[0], 2, fsync=fsync)

            return run

        def plain(d: str, fsync: bool = False) -> Callable[[], None]:
            def run() -> None:
                os.makedirs(d, exist_ok=True)
                for r in range(2):
                    p = os.path.join(d, f"rank-{r}.bin")
                    with fs.open_output_stream(p, compression=None) as f:
                        for rec, t in parts[r]:
                            flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                            for i in range(0, len(flat), 16 << 20):
                                f.write(flat[i : i + (16 << 20)])
                    if fsync:
                        fd = os.open(p, os.O_RDONLY)
                        os.fsync(fd)
                        os.close(fd)

            return run

        # Writes, interleaved per rep so checkpoint and plain see the same machine state.
        writes: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}
        for key, fn, d in (
            ("write_s", ckpt, "w"),
            ("plain_write_s", plain, "p"),
            ("write_fsync_s", lambda d: ckpt(d, fsync=True), "wf"),
            ("plain_write_fsync_s", lambda d: plain(d, fsync=True), "pf"),
        ):
            writes[key] = (fn(os.path.join(root, d)), fresh(os.path.join(root, d)))
        other = ck.DEFAULT_CHECKSUM != "crc32"
        if other:
            d = os.path.join(root, "wc")
            writes["write_crc32_s"] = (ckpt(d, "crc32"), fresh(d))
        _interleave(writes, args.reps, out)
        for d in os.listdir(root):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)

        # Reads: complete checkpoints and the plain files, all in the page cache.
        plain_dir = os.path.join(root, "plain")
        ckpt(root)()
        main_step = step[0]
        if other:
            ckpt(root, "crc32")()
        crc_step = step[0]
        plain(plain_dir)()
        dst = {n: torch.from_numpy(np.zeros(shape, np.float32)) for n in full}

        def mmap_read() -> None:
            for r in range(2):
                p = os.path.join(plain_dir, f"rank-{r}.bin")
                with open(p, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                src = torch.from_numpy(np.frombuffer(mm, np.uint8))
                pos = 0
                for rec, _ in parts[r]:
                    n = rec.nbytes
                    dst[rec.name][r * half : (r + 1) * half].reshape(-1).view(torch.uint8).copy_(
                        src[pos : pos + n]
                    )
                    pos += n
                del src
                mm.close()

        ch = cols // 2
        col_bufs = [
            {n: Shard(torch.from_numpy(np.zeros((rows, ch), np.float32)), (0, c * ch), shape) for n in full}
            for c in range(2)
        ]

        def reshard(step: int, verify: bool = True) -> Callable[[], None]:
            def run() -> None:
                for c in range(2):
                    ck.restore(root, col_bufs[c], step=step, verify=verify)

            return run

        bf = {n: torch.zeros(shape, dtype=torch.bfloat16) for n in full}
        noop = lambda: None  # noqa: E731
        reads: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {
            "mmap_read_s": (mmap_read, noop),
            "restore_s": (lambda: ck.restore(root, dst, step=main_step), noop),
            "restore_noverify_s": (lambda: ck.restore(root, dst, step=main_step, verify=False), noop),
            "restore_reshard_s": (reshard(main_step), noop),
            "restore_reshard_noverify_s": (reshard(main_step, False), noop),
            "restore_bf16_s": (lambda: ck.restore(root, bf, step=main_step), noop),
        }
        if other:
            reads["restore_crc32_s"] = (lambda: ck.restore(root, dst, step=crc_step), noop)
            reads["restore_reshard_crc32_s"] = (reshard(crc_step), noop)
        _interleave(reads, args.reps, out)
        for n, t in full.items():
            assert torch.equal(dst[n], t), n
            assert torch.equal(col_bufs[1][n].tensor, t[:, ch:]), n
        assert torch.equal(bf["layer0.w"], full["layer0.w"].to(torch.bfloat16))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for k in list(out):
        if k.endswith("_s"):
            out[k[:-2] + "_gbps"] = round(nbytes / out.pop(k) / 1e9, 3)
    out["ratio_write"] = round(out["write_gbps"] / out["plain_write_gbps"], 3)
    out["ratio_write_fsync"] = round(out["write_fsync_gbps"] / out["plain_write_fsync_gbps"], 3)
    out["ratio_restore"] = round(out["restore_gbps"] / out["mmap_read_gbps"], 3)
    out["ratio_reshard"] = round(out["restore_reshard_gbps"] / out["mmap_read_gbps"], 3)
    print(json.dumps(out, sort_keys=True))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

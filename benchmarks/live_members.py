"""What reading publisher liveness costs a pull: ``begin_read`` + ``end_read`` of one committed
step of W publisher ranks, with W live member records (the range ``begin_read`` reads in its
transaction since "pull from whatever is alive") against none (the same transaction, an empty
range), side by side in one run on one embedded etcd. Metadata only: no tensors, no transport.

One JSON line per W: ``median_ms_members`` and ``median_ms_none`` (begin_read + end_read),
``ratio`` (members / none), ``member_bytes`` (bytes of the member records read per pull).

Usage: python benchmarks/live_members.py [--ranks 8,128,1024] [--reads 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from astate_store.catalog import Catalog  # noqa: E402
from astate_store.catalog.records import pad20  # noqa: E402
from astate_store.etcd.embedded import EmbeddedEtcd  # noqa: E402
from astate_store.model import codec  # noqa: E402

STEP, EPOCH = 1, 1


def commit(cat: Catalog, world: int) -> None:
    """A committed step of ``world`` pieces, written straight (as the commit transaction would)."""
    c, raw = cat.client, cat.client.raw
    lid = mid = "0" * 24
    for r in range(world):
        raw.put(
            c.key("versions", pad20(STEP), "pieces", pad20(EPOCH), pad20(r)),
            codec.encode(
                "piece",
                {
                    "step": STEP,
                    "epoch": EPOCH,
                    "rank": r,
                    "world_size": world,
                    "layout_id": lid,
                    "base_offset": 0,
                    "manifest_id": mid,
                },
            ),
        )
    raw.put(
        c.key("versions", pad20(STEP), "commit"),
        codec.encode(
            "commit", {"step": STEP, "epoch": EPOCH, "world_size": world, "committed_at": time.time()}
        ),
    )


def members(cat: Catalog, world: int) -> int:
    """Member records of every rank (as ``Sessions.open`` writes them); returns their bytes."""
    c, n = cat.client, 0
    for r in range(world):
        rec = codec.encode("member", {"epoch": EPOCH, "rank": r, "host": "bench-host", "pid": 100000 + r})
        c.raw.put(c.key("members", pad20(EPOCH), pad20(r)), rec)
        n += len(rec) + len(c.key("members", pad20(EPOCH), pad20(r)))
    return n


def timed_reads(cat: Catalog, reads: int) -> tuple[float, int]:
    """Median seconds of begin_read + end_read, and how many ranks the reads saw missing."""
    out, missing = [], 0
    for i in range(reads):
        t0 = time.perf_counter()
        v = cat.readers.begin_read(STEP, "bench")
        cat.readers.end_read(STEP, "bench", [])
        out.append(time.perf_counter() - t0)
        missing = len(v.missing)
    return statistics.median(out), missing


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="8,128,1024")
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "live_members.jsonl"))
    a = ap.parse_args()
    server = EmbeddedEtcd().start()
    try:
        for world in map(int, a.ranks.split(",")):
            with_m, without = (Catalog(server.endpoint, f"lm-{uuid.uuid4().hex[:8]}") for _ in range(2))
            commit(with_m, world)
            commit(without, world)
            nbytes = members(with_m, world)
            timed_reads(with_m, 10)  # warm both (connections, decode caches)
            timed_reads(without, 10)
            ms, none, m_missing, n_missing = [], [], 0, 0
            for _round in range(3):  # interleaved rounds: the same load on both
                t, m_missing = timed_reads(with_m, a.reads // 3)
                ms.append(t)
                t, n_missing = timed_reads(without, a.reads // 3)
                none.append(t)
            assert m_missing == 0 and n_missing == world, (m_missing, n_missing)
            row = {
                "bench": "live_members",
                "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                "load1": os.getloadavg()[0],
                "ranks": world,
                "reads": a.reads,
                "median_ms_members": round(statistics.median(ms) * 1e3, 3),
                "median_ms_none": round(statistics.median(none) * 1e3, 3),
                "ratio": round(statistics.median(ms) / statistics.median(none), 3),
                "member_bytes": nbytes,
            }
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            for cat in (with_m, without):
                cat.delete_all(force=True)
                cat.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()

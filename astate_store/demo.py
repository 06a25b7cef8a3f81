"""`make demo`: several publisher processes commit versions; a consumer prints what it sees."""

from __future__ import annotations

import multiprocessing as mp
import sys

from .catalog import Catalog
from .etcd_server import EmbeddedEtcd
from .layout import Box, ShardRecord

WORLD, STEPS, NS = 2, 3, "demo-policy"


def _trainer(endpoint: str, rank: int, barrier: object) -> None:
    cat = Catalog(endpoint, NS)
    cat.open_session(rank=rank, world_size=WORLD, session_id="demo")
    shard = ShardRecord("w", "float32", (8, 4), Box((4 * rank, 0), (4, 4)), (4, 1), rank, 0, 0)
    lid = cat.write_layout([shard], b"no data path yet")
    for step in range(STEPS):
        barrier.wait()  # type: ignore[attr-defined]
        cat.put_piece(step, lid)
    barrier.wait()  # type: ignore[attr-defined]
    cat.close()


def main() -> int:
    ctx = mp.get_context("spawn")
    with EmbeddedEtcd() as etcd:
        print(f"embedded etcd at {etcd.endpoint}")
        barrier = ctx.Barrier(WORLD)
        procs = [ctx.Process(target=_trainer, args=(etcd.endpoint, r, barrier)) for r in range(WORLD)]
        for p in procs:
            p.start()
        cons = Catalog(etcd.endpoint, NS)
        for step in range(STEPS):
            got = cons.wait_for(step, timeout=60)
            v = cons.layouts_of(cons.read_version(got))
            print(f"consumer sees step {got} committed by epoch {v.epoch}: "
                  + ", ".join(f"rank {r} holds {lay.shards[0].box}" for r, lay in sorted(v.layouts.items())))
        for p in procs:
            p.join(60)
        cons.close()
        return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main())

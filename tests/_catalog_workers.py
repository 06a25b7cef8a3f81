"""Child-process entry points for catalog concurrency tests (spawned, so importable at top level)."""

from __future__ import annotations

import os
import time

from astate_store.catalog import Catalog
from astate_store.model.layout import Box, ShardRecord


def row_shard(rank: int, world: int, rows: int = 8, cols: int = 4) -> ShardRecord:
    per = rows // world
    return ShardRecord("w", "float32", (rows, cols), Box((rank * per, 0), (per, cols)), (cols, 1), rank, 0, 0)


def publish(
    endpoint: str,
    ns: str,
    rank: int,
    world: int,
    steps: list[int],
    session_id: str,
    barrier: object,
    results: object,
) -> None:
    """One publisher rank: join the session, then write its piece of every step."""
    cat = Catalog(endpoint, ns)
    cat.sessions.open(rank=rank, world_size=world, session_id=session_id)
    lid = cat.versions.write_layout([row_shard(rank, world)], b"rank%d" % rank)
    barrier.wait()  # type: ignore[attr-defined]
    committed = [cat.versions.put_piece(s, lid) for s in steps]
    results.put((rank, committed))  # type: ignore[attr-defined]
    cat.close()


def hold_session(endpoint: str, ns: str, ttl: float, ready: object) -> None:
    """Open a session with a short lease, report, then wait to be SIGKILLed."""
    cat = Catalog(endpoint, ns, lease_ttl=ttl)
    cat.sessions.open(rank=0, world_size=2)
    ready.put(os.getpid())  # type: ignore[attr-defined]
    while True:
        time.sleep(1)


def commit_racer(
    endpoint: str,
    ns: str,
    epoch_steps: list[int],
    session_id: str,
    rank: int,
    world: int,
    barrier: object,
    results: object,
) -> None:
    cat = Catalog(endpoint, ns)
    cat.sessions.open(rank=rank, world_size=world, session_id=session_id)
    lid = cat.versions.write_layout([row_shard(rank, world)], b"x")
    barrier.wait()  # type: ignore[attr-defined]
    seen = []
    for s in epoch_steps:
        cat.versions.put_piece(s, lid)
        seen.append(cat.versions.latest())
    results.put(seen)  # type: ignore[attr-defined]
    cat.close()

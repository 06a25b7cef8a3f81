"""Worker processes for ``benchmarks/peers.py``: the shared read plan and one role per system.

The work is the same for every system: the trainer->rollout reads of the sync_bench layout
(TP=2 Megatron trainer -> TP=1 rollout). :func:`build_work` lays the trainer shards out as the
snapshot pool does (``SnapshotPool``: shards in order, 256-byte aligned) and asks our planner
(``plan_consumer``) for the reads of a rollout whose buffers are views of one flat buffer; every
peer then reads exactly those ``(src_rank, src_offset, dst_offset, length)`` ranges.

Values are :func:`_sync_workers.fill_values` (a function of tensor name and global index), so a
publisher fills its region and the rollout checks its buffer tensor by tensor, byte for byte,
without shipping any bytes between processes.

Every worker talks to the driver through queues: it answers ``(role, "ok", payload)`` or
``(role, "error", text)`` and never raises out of its entry point.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _sync_workers as W
import numpy as np
import torch

ALIGN = 256  # staging.ALIGN: the snapshot pool's shard alignment
TP = 2


@dataclass
class Work:
    """The layout and the plan: what every system moves."""

    spec: W.Spec
    # per trainer rank: [(name, box, byte offset in its region)], region bytes
    shards: list[list[tuple[str, W.Box, int]]]
    region_bytes: list[int]
    dst_offsets: dict[str, int]  # name -> byte offset of the rollout's view in its flat buffer
    dst_bytes: int
    reads: list[np.ndarray]  # per rank: (n, 3) int64 (src_offset, dst_offset, length)

    @property
    def nbytes(self) -> int:
        return int(sum(int(r[:, 2].sum()) for r in self.reads))

    @property
    def n_reads(self) -> int:
        return int(sum(len(r) for r in self.reads))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def build_work(gib: float) -> Work:
    """The sync_bench layout and the reads our planner makes for it (pure; no etcd, no transport)."""
    from astate_store.model.layout import Box, ShardRecord, contiguous_strides, group_layouts
    from astate_store.plan import plan_consumer

    spec = W.transformer_spec(gib)
    shards: list[list[tuple[str, W.Box, int]]] = []
    region_bytes, records = [], []
    for rank in range(TP):
        off, mine = 0, []
        for name, (shape, kind) in spec.items():
            box = W.box_of("megatron", shape, kind, rank, TP)
            mine.append((name, box, off))
            records.append(
                ShardRecord(name, "float32", shape, Box(*box), contiguous_strides(box[1]), rank, 0, off)
            )
            off += _aligned(int(np.prod(box[1])) * 4)
        shards.append(mine)
        region_bytes.append(max(off, ALIGN))
    dst_offsets, off, request = {}, 0, []
    for name, (shape, _) in spec.items():
        dst_offsets[name] = off
        request.append(
            ShardRecord(
                name, "float32", shape, Box((0,) * len(shape), shape), contiguous_strides(shape), 0, 0, off
            )
        )
        off += _aligned(int(np.prod(shape)) * 4)
    plan = plan_consumer(group_layouts(records), request).reads
    if plan["convert"].any() or (plan["src_region"] != 0).any():
        raise RuntimeError("unexpected plan: conversions or several regions")
    reads = []
    for rank in range(TP):
        r = plan[plan["src_rank"] == rank]
        reads.append(np.stack([r["src_offset"], r["dst_offset"], r["length"]], axis=1).astype(np.int64))
    return Work(spec, shards, region_bytes, dst_offsets, off, reads)


# ---------------------------------------------------------------------------------------- memory


def make_region(work: Work, rank: int) -> torch.Tensor:
    """This trainer rank's region: every shard at its pool offset, filled with its values."""
    buf = torch.zeros(work.region_bytes[rank], dtype=torch.uint8)
    for name, box, off in work.shards[rank]:
        n = int(np.prod(box[1])) * 4
        W.fill_values(buf[off : off + n].view(torch.float32).view(box[1]), name, box, work.spec[name][0])
    return buf


def dst_views(work: Work, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name, (shape, _) in work.spec.items():
        off, n = work.dst_offsets[name], int(np.prod(shape)) * 4
        out[name] = flat[off : off + n].view(torch.float32).view(shape)
    return out


def verify(work: Work, flat: torch.Tensor) -> list[str]:
    """Names of tensors whose bytes differ from the trainer's values (empty: all equal)."""
    bad = []
    for name, t in dst_views(work, flat).items():
        shape = work.spec[name][0]
        want = torch.empty(shape, dtype=torch.float32)
        W.fill_values(want, name, ((0,) * len(shape), shape), shape)
        if not torch.equal(t.view(torch.int32), want.view(torch.int32)):
            bad.append(name)
    return bad


def timed_runs(work: Work, flat: torch.Tensor, once: Callable[[], None], iters: int) -> dict[str, Any]:
    """Warm-up (connect, first touch of the plan) then ``iters`` timed runs; each result is
    checked: the buffer is zeroed before the warm-up and before a last extra run, and both are
    verified byte for byte."""
    flat.zero_()
    t0 = time.perf_counter()
    once()
    first = time.perf_counter() - t0
    bad = verify(work, flat)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    flat.zero_()
    once()
    bad += [b for b in verify(work, flat) if b not in bad]
    med = statistics.median(times)
    return {
        "gbps": round(work.nbytes / med / 1e9, 3),
        "seconds": round(med, 4),
        "best_gbps": round(work.nbytes / min(times) / 1e9, 3),
        "first_seconds": round(first, 4),
        "times": [round(t, 4) for t in times],
        "verified": not bad,
        "mismatched": bad[:5],
    }


def _answer(out: Any, role: str, fn: Callable[[], Any]) -> None:
    try:
        out.put((role, "ok", fn()))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        out.put((role, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))


def _set_env(env: dict[str, str]) -> None:
    for k, v in env.items():
        os.environ[k] = v


# ---------------------------------------------------------------------------------------- ours


def ours_publisher(rank: int, cfg: dict[str, Any], out: Any, stop: Any) -> None:
    """A trainer rank of astate-store: puts step 1 from its shards (snapshot into the pool)."""
    store = None

    def run() -> dict[str, Any]:
        nonlocal store
        from astate_store import Shard
        from astate_store.store import Store

        work = build_work(cfg["gib"])
        region = make_region(work, rank)
        params = {
            name: Shard(
                region[off : off + int(np.prod(box[1])) * 4].view(torch.float32).view(box[1]),
                box[0],
                work.spec[name][0],
            )
            for name, box, off in work.shards[rank]
        }
        store = Store(
            cfg["ns"],
            endpoint=cfg["endpoint"],
            rank=rank,
            world_size=TP,
            transport=cfg["transport"],
            session_id=cfg["ns"] + "-trainer",
        )
        t0 = time.perf_counter()
        store.put(1, params)
        return {"put_seconds": round(time.perf_counter() - t0, 4)}

    _answer(out, f"pub{rank}", run)
    stop.wait(600)
    if store is not None:
        store.close()


def ours_consumer(cfg: dict[str, Any], pubs: dict[int, Any], out: Any) -> None:
    """The rollout: ``get_into`` views of one flat buffer, the same step pulled repeatedly."""

    def run() -> dict[str, Any]:
        from astate_store.store import Store

        work = build_work(cfg["gib"])
        flat = torch.zeros(work.dst_bytes, dtype=torch.uint8)
        bufs = dst_views(work, flat)
        store = Store(cfg["ns"], endpoint=cfg["endpoint"], transport=cfg["transport"])
        rows = [0]
        orig = store.transport.get

        def counted(ops: Any, **kw: Any) -> None:  # rows per pull, to compare with the plan
            rows[0] += len(ops)
            orig(ops, **kw)

        store.transport.get = counted  # type: ignore[method-assign]
        try:
            store.wait(1, timeout=120)
            res = timed_runs(work, flat, lambda: store.get_into(bufs, step=1, timeout=120), cfg["iters"])
            res["rows_per_pull"] = rows[0] // (cfg["iters"] + 2)
            t = store.transport
            res["streamed_bytes_per_pull"] = getattr(t, "streamed_bytes", 0) // (cfg["iters"] + 2)
            res["paths"] = sorted(
                {
                    "streamed" if i.streamed else "direct" if i.direct else "ucx"
                    for i in (t.peer_info(p) for p in t.peers)
                }
            )  # type: ignore[attr-defined]
        finally:
            store.close()
        return res

    _answer(out, "consumer", run)


# ---------------------------------------------------------------------------------------- NIXL


def _nixl_agent(name: str, prog_thread: bool) -> Any:
    import logging

    from nixl_cu12._api import nixl_agent, nixl_agent_config

    logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout, our JSON's stream
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread, backends=["UCX"]))


def nixl_publisher(rank: int, cfg: dict[str, Any], out: Any, stop: Any) -> None:
    """A NIXL agent that registers this rank's region (DRAM) and hands out its metadata."""
    _set_env(cfg.get("env", {}))
    keep: list[Any] = []

    def run() -> dict[str, Any]:
        work = build_work(cfg["gib"])
        region = make_region(work, rank)
        agent = _nixl_agent(f"pub{rank}", cfg["pub_prog_thread"])
        agent.register_memory([(region.data_ptr(), region.numel(), 0, "")], "DRAM")
        keep.extend([agent, region])
        return {"meta": agent.get_agent_metadata(), "base": region.data_ptr(), "name": f"pub{rank}"}

    _answer(out, f"pub{rank}", run)
    if not keep or cfg["pub_prog_thread"]:
        stop.wait(600)
        return
    # No progress thread: the target's UCX worker must still be progressed for the reads UCX
    # serves with the target's help (small gets, tcp), as a serving loop would.
    agent = keep[0]
    deadline = time.monotonic() + 600
    pause = float(cfg.get("pub_poll_s", 0.0))
    while not stop.is_set() and time.monotonic() < deadline:
        agent.get_new_notifs()
        if pause:
            time.sleep(pause)


def nixl_consumer(cfg: dict[str, Any], pubs: dict[int, Any], out: Any) -> None:
    """One NIXL READ per trainer rank with the plan's descriptors, prepared once, posted each run."""
    _set_env(cfg.get("env", {}))

    def run() -> dict[str, Any]:
        work = build_work(cfg["gib"])
        flat = torch.zeros(work.dst_bytes, dtype=torch.uint8)
        agent = _nixl_agent("rollout", cfg["prog_thread"])
        agent.register_memory([(flat.data_ptr(), flat.numel(), 0, "")], "DRAM")
        handles = []
        for rank in range(TP):
            name = agent.add_remote_agent(pubs[rank]["meta"])
            r = work.reads[rank]
            n = len(r)
            local = np.stack([flat.data_ptr() + r[:, 1], r[:, 2], np.zeros(n, np.int64)], axis=1).astype(
                np.uint64
            )
            remote = np.stack([pubs[rank]["base"] + r[:, 0], r[:, 2], np.zeros(n, np.int64)], axis=1).astype(
                np.uint64
            )
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
            rh = agent.prep_xfer_dlist(name, remote, "DRAM")
            while True:  # metadata loads asynchronously: the remote side may not be ready yet
                try:
                    idx = np.arange(n, dtype=np.int32)
                    handles.append(agent.make_prepped_xfer("READ", lh, idx, rh, idx))
                    break
                except Exception:  # noqa: BLE001
                    if not agent.check_remote_metadata(name):
                        time.sleep(0.05)
                        continue
                    raise

        def once() -> None:
            for h in handles:
                st = agent.transfer(h)
                if st == "ERR":
                    raise RuntimeError("NIXL transfer posting failed")
            pending = list(handles)
            deadline = time.monotonic() + cfg.get("timeout", 120.0)
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError("NIXL READ did not complete in time")
                nxt = []
                for h in pending:
                    st = agent.check_xfer_state(h)
                    if st == "ERR":
                        raise RuntimeError("NIXL transfer failed")
                    if st != "DONE":
                        nxt.append(h)
                pending = nxt

        res = timed_runs(work, flat, once, cfg["iters"])
        res["descriptors"] = work.n_reads
        return res

    _answer(out, "consumer", run)


# ---------------------------------------------------------------------------------------- Mooncake


MOONCAKE_BATCH = 1024  # larger batches fail on its TCP transport ("TCP lane queue-full")


def _mooncake_engine(host: str) -> Any:
    os.environ.setdefault("GLOG_minloglevel", "2")  # its per-connection INFO lines, not errors
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize returned {rc}")
    return te


def mooncake_publisher(rank: int, cfg: dict[str, Any], out: Any, stop: Any) -> None:
    keep: list[Any] = []

    def run() -> dict[str, Any]:
        work = build_work(cfg["gib"])
        region = make_region(work, rank)
        te = _mooncake_engine(cfg["host"])
        rc = te.register_memory(region.data_ptr(), region.numel())
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory returned {rc}")
        keep.extend([te, region])
        return {"target": f"{cfg['host']}:{te.get_rpc_port()}", "base": region.data_ptr()}

    _answer(out, f"pub{rank}", run)
    stop.wait(600)


def mooncake_consumer(cfg: dict[str, Any], pubs: dict[int, Any], out: Any) -> None:
    """``batch_transfer_sync_read`` of the plan's ranges, batches of <= 1024, one thread per trainer
    rank (the call blocks; two ranks in flight at once)."""

    def run() -> dict[str, Any]:
        work = build_work(cfg["gib"])
        flat = torch.zeros(work.dst_bytes, dtype=torch.uint8)
        te = _mooncake_engine(cfg["con_host"])
        rc = te.register_memory(flat.data_ptr(), flat.numel())
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory returned {rc}")
        batches: list[list[tuple[str, list[int], list[int], list[int]]]] = []
        for rank in range(TP):
            r = work.reads[rank]
            mine = []
            for i in range(0, len(r), MOONCAKE_BATCH):
                b = r[i : i + MOONCAKE_BATCH]
                mine.append(
                    (
                        pubs[rank]["target"],
                        (flat.data_ptr() + b[:, 1]).tolist(),
                        (pubs[rank]["base"] + b[:, 0]).tolist(),
                        b[:, 2].tolist(),
                    )
                )
            batches.append(mine)
        errors: list[str] = []

        def lane(mine: list[tuple[str, list[int], list[int], list[int]]]) -> None:
            for target, local, remote, lengths in mine:
                rc = te.batch_transfer_sync_read(target, local, remote, lengths)
                if rc != 0:
                    errors.append(f"batch_transfer_sync_read returned {rc}")
                    return

        def once() -> None:
            ts = [threading.Thread(target=lane, args=(m,)) for m in batches[1:]]
            for t in ts:
                t.start()
            lane(batches[0])
            for t in ts:
                t.join()
            if errors:
                raise RuntimeError(errors[0])

        res = timed_runs(work, flat, once, cfg["iters"])
        res["batches"] = sum(len(b) for b in batches)
        return res

    _answer(out, "consumer", run)


# ---------------------------------------------------------------------------------------- stream


def _stream_rows(base: int, rows: np.ndarray, col: int) -> tuple[np.ndarray, np.ndarray]:
    """The reads as socket rows (address, length): at column ``col`` (0: source offset, 1:
    destination) of a buffer at ``base``."""
    return (np.uint64(base) + rows[:, col].astype(np.uint64)), rows[:, 2].astype(np.uint64)


def stream_publisher(rank: int, cfg: dict[str, Any], out: Any, stop: Any) -> None:
    """A trainer rank that streams its plan ranges, in plan order, to a rollout that asks: the
    two-sided design a store without one-sided reads would use (no per-read request)."""
    import socket

    from astate_store.transport.stream import move_rows

    ready = threading.Event()
    info: dict[str, Any] = {}

    def serve() -> None:
        work = build_work(cfg["gib"])
        region = make_region(work, rank)
        addr, length = _stream_rows(region.data_ptr(), work.reads[rank], 0)
        ls = socket.create_server((cfg["host"], 0))
        info["addr"] = (cfg["host"], ls.getsockname()[1])
        ready.set()
        conn, _ = ls.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while conn.recv(1) == b"g":  # one request per pull; b"" (closed): done
            move_rows(conn, addr, length, send=True)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    _answer(out, f"pub{rank}", lambda: (ready.wait(300), info["addr"])[1])
    stop.wait(600)


def stream_consumer(cfg: dict[str, Any], pubs: dict[int, Any], out: Any) -> None:
    """The rollout: per trainer rank one connection and one thread scattering its stream into the
    rows' destinations (the store's socket loop, ``move_rows``)."""
    import socket

    from astate_store.transport.stream import move_rows

    def run() -> dict[str, Any]:
        work = build_work(cfg["gib"])
        flat = torch.zeros(work.dst_bytes, dtype=torch.uint8)
        conns = [socket.create_connection(tuple(pubs[r]), timeout=120) for r in range(TP)]
        plans = [_stream_rows(flat.data_ptr(), work.reads[r], 1) for r in range(TP)]
        errors: list[str] = []

        def lane(r: int) -> None:
            try:
                move_rows(conns[r], *plans[r], send=False)
            except Exception as exc:  # noqa: BLE001 - re-raised by once()
                errors.append(f"rank {r}: {exc}")

        def once() -> None:
            for c in conns:
                c.sendall(b"g")
            ts = [threading.Thread(target=lane, args=(r,)) for r in range(1, TP)]
            for t in ts:
                t.start()
            lane(0)
            for t in ts:
                t.join()
            if errors:
                raise RuntimeError(errors[0])

        res = timed_runs(work, flat, once, cfg["iters"])
        for c in conns:
            c.close()
        return res

    _answer(out, "consumer", run)


def entry(fn: str, out: Any, *args: Any) -> None:
    """Process entry point: run ``fn(*args)``; ``out`` is the driver's answer queue. (In the
    two-host case the driver starts the process through ``ip netns exec``, which also mounts
    the namespace's own /sys: UCX reads its network devices there.)"""
    try:
        globals()[fn](*args)
    except BaseException as exc:  # noqa: BLE001 - the roles answer themselves; this is a last resort
        out.put((fn, "error", f"{type(exc).__name__}: {exc}"))


def etcd_main(host: str, out: Any, stop: Any) -> None:
    """An embedded etcd bound to ``host`` (inside a namespace: the two-host case)."""
    from astate_store.etcd.embedded import EmbeddedEtcd

    try:
        with EmbeddedEtcd(host=host) as e:
            out.put(("etcd", "ok", e.endpoint))
            stop.wait(1800)
    except BaseException as exc:  # noqa: BLE001
        out.put(("etcd", "error", f"{type(exc).__name__}: {exc}"))


def gloo_main(rank: int, addr: str, port: int, nbytes: int, iters: int, ifname: str | None, out: Any) -> None:
    """Two processes: broadcast ``nbytes`` from rank 0 with torch.distributed gloo; rank 1 checks
    every byte of the last broadcast. ``ifname``: the device gloo must use (else it follows the
    host name, i.e. loopback)."""
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    import torch.distributed as dist

    def run() -> dict[str, Any]:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
        n = nbytes // 4
        t = torch.arange(n, dtype=torch.int32) if rank == 0 else torch.zeros(n, dtype=torch.int32)
        times = []
        for i in range(iters + 1):  # the first is warm-up (connection, first touch)
            if rank == 1:
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(t, src=0)
            if i:
                times.append(time.perf_counter() - t0)
        ok = bool(torch.equal(t, torch.arange(n, dtype=torch.int32))) if rank == 1 else True
        dist.barrier()
        dist.destroy_process_group()
        return {"times": times, "ok": ok}

    _answer(out, f"gloo{rank}", run)


ROLES: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {
    "ours": (ours_publisher, ours_consumer),
    "nixl": (nixl_publisher, nixl_consumer),
    "mooncake": (mooncake_publisher, mooncake_consumer),
    "stream": (stream_publisher, stream_consumer),
}

"""Streamed tcp reads from ONE publisher, over one connection vs several ("lanes"); ONE JSON line.

The case sync_bench and peers.py do not cover: a rollout reading from fewer trainer ranks than it
has cores (a TP=1 trainer, an expert-parallel rank holding what one rollout needs). A pull aims for
``ASTATE_STREAM_LANES`` connections in all (default: the cores, at most 8), so one publisher is read
over several; each connection's receive copy runs on its own core.

One publisher process (rank 0 of 1, tcp mode) puts ``--gib`` of fp32 in 16 tensors once. For each
lanes setting (``--lanes``, comma list) a fresh consumer process (started with
``ASTATE_STREAM_LANES`` set) pulls that version ``--pulls`` times into preallocated buffers; the
settings alternate over ``--rounds`` rounds, as this machine's speed drifts. Reference in the same
run: a gloo broadcast of the same bytes between 2 processes (peers.py's). ``--hosts 2``: publisher and
etcd in one network namespace, the consumers (and gloo's receiver) in another, joined by a veth link
(needs root and iproute2; peers.py's set-up).

Keys: gbps{lanes: median over rounds of each consumer's median pull}, rounds[{lanes: gbps}],
first_pull_seconds{lanes: median}, gloo_gbps, ratio_lanes (the default setting / 1 lane),
ratio_gloo (default setting / gloo), lanes_default, verified (every consumer's last pull, into zeroed
buffers, checked, and every pull's bytes streamed, none through UCX).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.spawn
import os
import statistics
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, ".."))

import peers  # noqa: E402
import torch  # noqa: E402
from _hosts import netns_python  # noqa: E402

CTX = mp.get_context("spawn")
TENSORS = 16
TIMEOUT = 300.0


def _numel(gib: float) -> int:
    return int(gib * (1 << 30)) // 4 // TENSORS


def publisher(endpoint: str, ns: str, gib: float, ready: Any, done: Any) -> None:
    from astate_store.store import Store

    store = Store(ns, endpoint=endpoint, rank=0, world_size=1, transport="tcp", session_id=ns + "-pub")
    try:
        n = _numel(gib)
        store.put(1, {f"w{i}": torch.arange(n, dtype=torch.float32) + i for i in range(TENSORS)})
        ready.put(1)
        done.get(timeout=TIMEOUT * 4)  # serve until the driver is done
    finally:
        store.close()


def consumer(endpoint: str, ns: str, gib: float, pulls: int, lanes: int, out: Any) -> None:
    os.environ["ASTATE_STREAM_LANES"] = str(lanes)  # this process's setting, read when its transport starts
    from astate_store.store import Store

    store = Store(ns, endpoint=endpoint, transport="tcp", session_id=f"{ns}-sub-{os.getpid()}")
    try:
        n = _numel(gib)
        bufs = {f"w{i}": torch.zeros(n, dtype=torch.float32) for i in range(TENSORS)}
        times = []
        for _ in range(pulls + 1):  # the first pull (connect + plan) is reported apart
            t0 = time.perf_counter()
            store.get_into(bufs, step=1)
            times.append(time.perf_counter() - t0)
        for b in bufs.values():  # one more, untimed, into zeroed buffers: what is checked
            b.zero_()
        store.get_into(bufs, step=1)
        ref = torch.arange(n, dtype=torch.float32)
        ok = all(bool(torch.equal(bufs[f"w{i}"], ref + i)) for i in range(TENSORS))
        transport = store.transport
        # no pull fell back to UCX: every pull streamed its bytes and then its publisher's 8-byte step word
        streamed = transport.streamed_bytes == (pulls + 2) * (n * 4 * TENSORS + 8)
        out.put(
            {
                "first": times[0],
                "median": statistics.median(times[1:]),
                "verified": ok and streamed,
                "lanes": transport._stream_reader.lanes,
            }
        )
    finally:
        store.close()


def _start(target: Any, args: tuple[Any, ...], netns: str | None) -> Any:
    """A spawned process running ``target(*args)``, inside ``netns`` when given (peers.py's way)."""
    p = CTX.Process(target=target, args=args, daemon=True)
    exe = mp.spawn.get_executable()
    if netns is not None:
        mp.spawn.set_executable(netns_python(netns))
    try:
        p.start()
    finally:
        mp.spawn.set_executable(exe)
    return p


def run_consumer(
    endpoint: str, ns: str, gib: float, pulls: int, lanes: int, netns: str | None
) -> dict[str, Any]:
    out = CTX.Queue()
    p = _start(consumer, (endpoint, ns, gib, pulls, lanes, out), netns)
    try:
        res = out.get(timeout=TIMEOUT)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert res["lanes"] == lanes, res
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="bytes published, GiB of fp32 (default 1)")
    ap.add_argument("--pulls", type=int, default=5, help="timed pulls per consumer after its first")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the settings, alternating")
    ap.add_argument("--lanes", default=None, help="comma list of lane settings (default: 1 and the default)")
    ap.add_argument("--no-gloo", action="store_true", help="skip the gloo reference")
    ap.add_argument(
        "--hosts",
        type=int,
        default=1,
        choices=[1, 2],
        help="2: publisher and consumers in two network namespaces over veth (root)",
    )
    args = ap.parse_args()
    from astate_store.transport.stream import default_lanes

    default = default_lanes()
    settings = [int(x) for x in args.lanes.split(",")] if args.lanes else sorted({1, default})
    nbytes = _numel(args.gib) * 4 * TENSORS
    result: dict[str, Any] = {
        "bench": "stream_lanes",
        "bytes": nbytes,
        "cores": len(os.sched_getaffinity(0)),
        "hosts": args.hosts,
        "lanes_default": default,
        "rounds": [],
        "verified": True,
    }
    with peers.Hosts(args.hosts == 2) as hosts, peers.Etcd(hosts) as endpoint:
        ns = f"lanes-{os.getpid()}"
        ready, done = CTX.Queue(), CTX.Queue()
        pub = _start(publisher, (endpoint, ns, args.gib, ready, done), hosts.a)
        try:
            ready.get(timeout=TIMEOUT)
            firsts: dict[int, list[float]] = {k: [] for k in settings}
            for _ in range(args.rounds):
                row = {}
                for k in settings:
                    res = run_consumer(endpoint, ns, args.gib, args.pulls, k, hosts.b)
                    row[str(k)] = round(nbytes / res["median"] / 1e9, 3)
                    firsts[k].append(res["first"])
                    result["verified"] = result["verified"] and res["verified"]
                result["rounds"].append(row)
        finally:
            done.put(1)
            pub.join(60)
            if pub.is_alive():
                pub.kill()
        gloo = None if args.no_gloo else peers.run_gloo(nbytes, 5, hosts)
    result["gbps"] = {
        str(k): round(statistics.median(r[str(k)] for r in result["rounds"]), 3) for k in settings
    }
    result["first_pull_seconds"] = {str(k): round(statistics.median(v), 3) for k, v in firsts.items()}
    if 1 in settings and default in settings:
        result["ratio_lanes"] = round(result["gbps"][str(default)] / result["gbps"]["1"], 3)
    if gloo is not None:
        result["gloo_gbps"] = gloo.get("gbps")
        if gloo.get("gbps") and default in settings:
            result["ratio_gloo"] = round(result["gbps"][str(default)] / gloo["gbps"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The same reads done by astate-store and by the systems people would pick instead; ONE JSON line.

The work (``_peer_workers.build_work``): the trainer->rollout reads of the sync_bench layout
(a ~2 GiB fp32 GPT-like model, Megatron TP=2 trainer -> TP=1 rollout), i.e. the byte ranges our
planner produces for it (column-parallel halves are one read each; row-parallel matrices are one
read per row half). Each system runs in its own processes (2 trainer ranks, 1 rollout) and reads
exactly those ranges into one preallocated flat buffer:

* ``ours``: astate-store ``put`` (snapshot) on the trainers, ``get_into`` on the rollout;
* ``nixl``: NIXL agents (UCX backend, DRAM), one prepared READ per trainer rank with the plan's
  descriptors (prepared once, posted each run), ``enable_prog_thread=False`` on the rollout (its
  busy-polling thread costs on few cores). A trainer agent must still be progressed (without it
  the first READ never completes): over shm its main thread polls ``get_new_notifs`` (sleeping
  ``$PEERS_NIXL_POLL_S`` between polls, default 1 ms: 2x faster here than spinning, which takes
  the rollout's cores), over tcp it keeps NIXL's progress thread (reads are served by the target);
  tcp runs use our tcp mode's UCX settings (``UCX_TLS=tcp,self``, 1 MiB segments);
* ``mooncake``: Mooncake Transfer Engine (tcp, ``P2PHANDSHAKE``), ``batch_transfer_sync_read`` in
  batches of <= 1024, one thread per trainer rank;
* ``stream`` (tcp modes): the two-sided design bare: a trainer rank streams the source bytes of its
  reads in plan order to the rollout, which scatters them into their destinations (one thread per
  trainer rank), both through the store's socket loop (``stream.move_rows``: native ``sendmsg`` /
  ``recvmsg``, 1,024 buffers a call); one request byte per pull. Our tcp path is this design inside
  the store (``transport/stream.py``: plan rows as the request, keys and bounds checked), so
  ``ratio_stream`` is the store's overhead on it;
* ``memcpy``: torch ``copy_`` of the same number of bytes in one process (best of a few); also
  ``memcpy_streaming_gbps``, the same bytes through our copy loop with non-temporal stores;
* ``gloo``: a torch.distributed gloo broadcast of the same number of bytes between 2 processes.

Every system's result is checked byte for byte (the buffer is zeroed before a checked warm-up and
before a checked last run). Timed: the median of ``--iters`` runs after the warm-up.

Modes: ``--transport shm`` (default: one host, shared memory where a system can use it),
``--transport tcp`` (one host, loopback tcp for everyone), ``--hosts 2`` (two network-namespace
hosts joined by a veth link, tcp; needs root and iproute2; trainers on host A, rollout on host B).

Keys: ours_gbps, nixl_gbps, mooncake_gbps, stream_gbps, memcpy_gbps, gloo_gbps, ratio_nixl, ratio_mooncake,
ratio_stream, ratio_memcpy, ratio_gloo (ours / the other), memcpy_streaming_gbps, ratio_memcpy_streaming,
null_reasons{system: why}, systems{...details}.
A system that cannot be installed or run reports null and the reason.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import multiprocessing.spawn
import os
import queue
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, ".."))

import _peer_workers as P  # noqa: E402
from _hosts import VethPair, netns_python  # noqa: E402
from sync_bench import measure_memcpy  # noqa: E402

CTX = mp.get_context("spawn")
TIMEOUT = 600.0

# Peers that need CUDA (measured on this kind of machine; see docs/performance.md): reported as null.
CUDA_ONLY = {
    "torchstore": "torchstore 0.1.2 pins a CUDA torch 2.9.0 and torchmonarch; its import fails without "
    "libcuda.so.1 (no GPU here)",
    "checkpoint_engine": "checkpoint-engine 0.4.2 installs on CPU torch but its ParameterServer accepts only "
    "CUDA/NPU devices",
}
SYSTEMS = ("ours", "nixl", "mooncake", "stream", "memcpy", "gloo")
IMPORTS = {"nixl": "nixl_cu12", "mooncake": "mooncake.engine"}
INSTALL_HINT = {
    "nixl": "pip install nixl-cu12 (torch pinned first), or pip install -e .[peers]",
    "mooncake": "pip install mooncake-transfer-engine-non-cuda and apt-get install libibverbs1",
}


def _log(msg: str) -> None:
    if os.environ.get("PEERS_VERBOSE"):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
        return round(a / b, 3)
    return None


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def importable(module: str) -> str | None:
    """None if ``module`` imports in a fresh interpreter, else the reason (last line of the error)."""
    r = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )
    if r.returncode == 0:
        return None
    lines = [ln for ln in (r.stderr or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"import {module} exited {r.returncode}"


# ------------------------------------------------------------------------------------ processes


class Group:
    """Processes started through ``_peer_workers.entry``, answering on one queue."""

    def __init__(self) -> None:
        self.q = CTX.Queue()
        self.stop = CTX.Event()
        self.procs: list[Any] = []

    def start(self, fn: str, netns: str | None, *args: Any) -> None:
        p = CTX.Process(target=P.entry, args=(fn, self.q, *args), daemon=True)
        if netns is None:
            p.start()
        else:  # the interpreter started through `ip netns exec` (its own /sys, as a real host)
            exe = mp.spawn.get_executable()
            mp.spawn.set_executable(netns_python(netns))
            try:
                p.start()
            finally:
                mp.spawn.set_executable(exe)
        self.procs.append(p)

    def answers(self, n: int, timeout: float = TIMEOUT) -> dict[str, Any]:
        """``n`` answers by role; raises on an error answer, a dead process or the timeout."""
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < n:
            try:
                role, status, payload = self.q.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"worker exited with {dead}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer within {timeout:.0f}s")
                continue
            if status != "ok":
                raise RuntimeError(f"{role}: {str(payload).strip()[-1500:]}")
            got[role] = payload
        return got

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


def run_system(kind: str, cfg: dict[str, Any], hosts: Hosts) -> dict[str, Any]:
    """Two trainer ranks, then the rollout; the rollout's timed, verified result."""
    g = Group()
    try:
        for rank in range(P.TP):
            g.start(f"{kind}_publisher", hosts.a, rank, cfg, g.q, g.stop)
        pubs = g.answers(P.TP)
        g.start(f"{kind}_consumer", hosts.b, cfg, {r: pubs[f"pub{r}"] for r in range(P.TP)}, g.q)
        res = g.answers(1)["consumer"]
        if kind == "ours":
            res["put_seconds"] = max(pubs[f"pub{r}"]["put_seconds"] for r in range(P.TP))
        return res
    except Exception as exc:  # noqa: BLE001 - a failing system is reported, not fatal
        return {"error": str(exc)[:2000]}
    finally:
        g.close()


def run_gloo(nbytes: int, iters: int, hosts: Hosts) -> dict[str, Any]:
    g = Group()
    port = _free_port() if hosts.a is None else random.randint(20000, 40000)
    try:
        for rank, ns, dev in ((0, hosts.a, hosts.a_dev), (1, hosts.b, hosts.b_dev)):
            g.start("gloo_main", ns, rank, hosts.a_addr, port, nbytes, iters, dev, g.q)
        res = g.answers(2)
        per = [max(a, b) for a, b in zip(res["gloo0"]["times"], res["gloo1"]["times"])]
        med = statistics.median(per)
        return {
            "gbps": round(nbytes / med / 1e9, 3),
            "seconds": round(med, 4),
            "best_gbps": round(nbytes / min(per) / 1e9, 3),
            "verified": res["gloo1"]["ok"],
        }
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)[:2000]}
    finally:
        g.close()


# ------------------------------------------------------------------------------------ hosts


class Hosts(VethPair):
    """Where trainers (a) and the rollout (b) run: two network namespaces (``two``), or this host
    (a and b None, loopback addresses)."""

    def __init__(self, two: bool) -> None:
        super().__init__("peers")
        self.two = two
        if not two:
            self.a = self.b = self.a_dev = self.b_dev = None  # type: ignore[assignment]
            self.a_addr = self.b_addr = "127.0.0.1"

    def __enter__(self) -> Hosts:
        if not self.two:
            return self
        if os.geteuid() != 0:
            raise PermissionError("--hosts 2 needs root (network namespaces)")
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.two:
            self.close()


class Etcd:
    """The catalog for ``ours``: in host A's namespace in the two-host case."""

    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        self.g = Group()

    def __enter__(self) -> str:
        self.g.start("etcd_main", self.hosts.a, self.hosts.a_addr, self.g.q, self.g.stop)
        return str(self.g.answers(1, timeout=60)["etcd"])

    def __exit__(self, *exc: object) -> None:
        self.g.close()


# ------------------------------------------------------------------------------------ main


def configs(
    args: argparse.Namespace, hosts: Hosts, endpoint: str | None
) -> Iterator[tuple[str, dict[str, Any]]]:
    tcp = args.transport == "tcp" or hosts.two
    base = {"gib": args.gib, "iters": args.iters}
    if endpoint is not None:
        yield (
            "ours",
            dict(
                base, ns=f"peers-{uuid.uuid4().hex[:8]}", endpoint=endpoint, transport="tcp" if tcp else "shm"
            ),
        )
    # the same UCX settings our tcp mode uses (1 MiB segments: ~4x the default here)
    ucx_tcp = {"UCX_TLS": "tcp,self", "UCX_TCP_TX_SEG_SIZE": "1M", "UCX_TCP_RX_SEG_SIZE": "1M"}
    yield (
        "nixl",
        dict(
            base,
            prog_thread=False,
            pub_prog_thread=tcp,
            env=ucx_tcp if tcp else {},
            pub_poll_s=float(os.environ.get("PEERS_NIXL_POLL_S", "0.001")),
        ),
    )
    yield "mooncake", dict(base, host=hosts.a_addr, con_host=hosts.b_addr)
    if tcp:
        yield "stream", dict(base, host=hosts.a_addr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="model size in GiB of fp32 (default 2)")
    ap.add_argument("--iters", type=int, default=5, help="timed runs per system after a checked warm-up")
    ap.add_argument(
        "--transport", default="shm", choices=["shm", "tcp"], help="one host: shared memory or tcp"
    )
    ap.add_argument(
        "--hosts",
        type=int,
        default=1,
        choices=[1, 2],
        help="2: trainers and rollout in two network namespaces over a veth link (tcp; root)",
    )
    ap.add_argument("--only", default=",".join(SYSTEMS), help="comma list of systems to run")
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.iters < 1:
        ap.error("--gib must be > 0 and --iters >= 1")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if not only or only - set(SYSTEMS):
        ap.error(f"--only takes a comma list of {','.join(SYSTEMS)}; got {args.only!r}")
    t_start = time.perf_counter()
    work = P.build_work(args.gib)
    out: dict[str, Any] = {
        "bytes": work.nbytes,
        "reads": work.n_reads,
        "reads_per_rank": [len(r) for r in work.reads],
        "gib": args.gib,
        "transport": "tcp" if args.hosts == 2 else args.transport,
        "hosts": args.hosts,
        "iters": args.iters,
        "host_cpus": os.cpu_count(),
        "layout": "sync_bench transformer, Megatron TP=2 trainer -> TP=1 rollout, fp32",
    }
    del work
    systems: dict[str, Any] = {}
    reasons: dict[str, str] = dict(CUDA_ONLY)
    try:
        hosts = Hosts(args.hosts == 2).__enter__()
    except (OSError, subprocess.CalledProcessError) as exc:
        out["error"] = f"cannot make two network-namespace hosts here: {exc}"
        print(json.dumps(out), flush=True)
        return 1
    try:
        etcd = Etcd(hosts)
        endpoint = etcd.__enter__() if "ours" in only else None
        try:
            for kind, cfg in configs(args, hosts, endpoint):
                if kind not in only:
                    continue
                why = importable(IMPORTS[kind]) if kind in IMPORTS else None
                if why:
                    reasons[kind] = f"not importable ({why}); install: {INSTALL_HINT[kind]}"
                    continue
                _log(f"{kind} ...")
                systems[kind] = run_system(kind, cfg, hosts)
                _log(f"{kind}: {json.dumps(systems[kind])[:300]}")
                gc.collect()
        finally:
            if endpoint is not None:
                etcd.__exit__()
        if "memcpy" in only:
            systems["memcpy"] = measure_memcpy(out["bytes"])
            systems["memcpy"]["what"] = (
                "torch copy_ of the same bytes, one process, best of 4 (gbps_streaming: "
                "our copy loop's non-temporal stores, one row)"
            )
        if "gloo" in only:
            systems["gloo"] = run_gloo(out["bytes"], max(3, args.iters), hosts)
    finally:
        hosts.__exit__()
    for name in SYSTEMS:
        s = systems.get(name)
        ok = isinstance(s, dict) and "gbps" in s and s.get("verified", True)
        out[f"{name}_gbps"] = s["gbps"] if ok else None
        if not ok and name not in reasons:
            reasons[name] = (
                "not run (--only)"
                if s is None
                else s.get("error", "result not verified: bytes differ")
                if isinstance(s, dict)
                else "?"
            )
    if args.transport == "shm" and args.hosts == 1:
        reasons.setdefault("stream", "a tcp socket stream: run in the tcp modes only")
    for other in ("nixl", "mooncake", "stream", "memcpy", "gloo"):
        out[f"ratio_{other}"] = _ratio(out["ours_gbps"], out[f"{other}_gbps"])
    memcpy = systems.get("memcpy")
    out["memcpy_streaming_gbps"] = memcpy.get("gbps_streaming") if isinstance(memcpy, dict) else None
    out["ratio_memcpy_streaming"] = _ratio(out["ours_gbps"], out["memcpy_streaming_gbps"])
    out["torchstore_gbps"] = out["checkpoint_engine_gbps"] = None
    out["null_reasons"] = reasons
    out["systems"] = systems
    out["total_seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

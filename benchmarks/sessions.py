"""Many cheap sessions: one writer process holds N agent sessions; ONE JSON line.

A writer process opens ``--sessions`` namespaces from one :class:`astate_store.SessionHub` (one etcd
connection, one lease, one retention thread, one UCX worker) and ``put``s ``--steps`` small steps
into each (a 4 KiB "context" tensor, a position tensor and ``meta``), from ``--threads`` threads as
concurrent agents would. An ``astate serve`` replica server process (``ReplicaServer``) holds the
newest step of the namespaces under the run's prefix. Once the server holds the last step of the
first ``--recover-sessions`` namespaces, the writer is SIGKILLed and a reader process (a hub too)
``get``s every one of those sessions from the server; every byte and every ``meta`` is checked.

Keys: sessions, steps, threads, open_seconds (opening every session), put_seconds_p50 /
put_seconds_p99 (one put), puts_seconds (all puts, wall), total_seconds (open + puts),
put_rpcs_mean (etcd requests per put), writer_threads (threads in the writer after its puts),
recover_sessions, server_hold_seconds (last put -> the server holds them all), recover_seconds
(SIGKILL -> every session read back and checked: a reader process started, connected, read),
recovered_ok, recover_start_seconds (SIGKILL -> the reader process started, imported and connected),
recover_read_seconds (the reads alone), recover_rpcs_per_session (etcd requests of
one session's open, get and meta), recover_failovers (source sets that failed), reader_cpu_seconds
(the reader's CPU over the reads), host_cpus.
Results are appended to ``benchmarks/results/sessions.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))

import torch  # noqa: E402

from astate_store import SessionHub  # noqa: E402

CONTEXT = 1024  # float32 elements of each session's context tensor (4 KiB)


def session_state(i: int, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What session ``i`` puts at ``step``: different bytes per session and step."""
    ctx = torch.arange(CONTEXT, dtype=torch.float32) + float(i * 1000 + step)
    pos = torch.tensor([i, step], dtype=torch.int64)
    return {"context": ctx, "position": pos}, {"turn": step, "session": i}


def session_name(prefix: str, i: int, recover: int) -> str:
    """Sessions read back after the kill are ``<prefix>r<i>``, the others ``<prefix>n<i>``: the
    replica server serves the prefix ``<prefix>r``."""
    return f"{prefix}{'r' if i < recover else 'n'}{i:05d}"


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def writer(args: argparse.Namespace) -> None:
    """Open the sessions, put the steps, report one JSON line on stdout, then wait to be killed."""
    hub = SessionHub(etcd=args.etcd, lease_ttl=args.lease_ttl)
    t0 = time.perf_counter()
    stores = [hub.open(session_name(args.prefix, i, args.recover_sessions)) for i in range(args.sessions)]
    open_s = time.perf_counter() - t0
    lat: list[float] = []
    lock = threading.Lock()

    def agent(i: int) -> None:
        # one agent's turns in order (a namespace has one writer); agents run concurrently
        for step in range(1, args.steps + 1):
            tensors, meta = session_state(i, step)
            t = time.perf_counter()
            stores[i].put(step, tensors, meta=meta)
            dt = time.perf_counter() - t
            with lock:
                lat.append(dt)

    t1 = time.perf_counter()
    if args.threads <= 1:
        for i in range(args.sessions):
            agent(i)
    else:
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(agent, range(args.sessions)))
    puts_s = time.perf_counter() - t1
    rpcs = sum(s.stats.etcd_rpcs for s in stores)
    print(
        json.dumps(
            {
                "open_seconds": round(open_s, 3),
                "puts_seconds": round(puts_s, 3),
                "put_seconds_p50": round(_percentile(lat, 0.5), 5),
                "put_seconds_p99": round(_percentile(lat, 0.99), 5),
                "put_rpcs_mean": round(rpcs / max(1, len(lat)), 2),
                "writer_threads": threading.active_count(),
                "lease_shared": {s.catalog.session.lease_id for s in stores} == {hub.lease_id},
                "transport_shared": all(s.transport.shared is hub.transport for s in stores),
            }
        ),
        flush=True,
    )
    time.sleep(3600)


def reader(args: argparse.Namespace) -> None:
    """Get every one of the first ``recover_sessions`` sessions; one JSON line: how many were right,
    etcd requests per session (open, get, meta; not close), failovers, and the reader's own CPU
    seconds and start-up (interpreter, imports, hub) seconds."""
    started = time.process_time()
    hub = SessionHub(etcd=args.etcd, read_timeout=args.read_timeout)
    ready_cpu, t0, ready_at = time.process_time(), time.perf_counter(), time.time()
    rpcs: list[int] = []
    failovers: list[int] = []

    def restore(i: int) -> bool:
        # a resuming agent: its session's newest state, whole, checked against what was put
        s = hub.open(session_name(args.prefix, i, args.recover_sessions))
        try:
            step, got = s.get(timeout=args.read_timeout)
            want, meta = session_state(i, args.steps)
            ok = (
                step == args.steps
                and all(torch.equal(got[k], v) for k, v in want.items())
                and s.meta(step) == meta
            )
            st = s.stats
            rpcs.append(st.etcd_rpcs)
            failovers.append(st.failovers)
            return ok
        finally:
            s.close()

    with ThreadPoolExecutor(max(1, args.threads)) as pool:
        good = list(pool.map(restore, range(args.recover_sessions)))
    hub.close()
    print(
        json.dumps(
            {
                "ok": sum(good),
                "bad": [i for i, g in enumerate(good) if not g][:10],
                "rpcs_per_session": round(sum(rpcs) / max(1, len(rpcs)), 2),
                "failovers": sum(failovers),
                "read_seconds": round(time.perf_counter() - t0, 3),
                "cpu_seconds": round(time.process_time() - ready_cpu, 3),
                "startup_cpu_seconds": round(ready_cpu - started, 3),
                "ready_at": ready_at,  # wall clock: the hub connected, the reads start
            }
        ),
        flush=True,
    )


def _server_holds(client: Any, prefix: str, step: int) -> int:
    """How many of the namespaces read back (``<prefix>r*``) have a replica-server offer of ``step``."""
    from astate_store.catalog.records import pad20
    from astate_store.catalog.replicas import SERVER_GROUP  # the replica servers' group name prefix

    want = f"/versions/{pad20(step)}/replicas/{SERVER_GROUP}"
    resp = client.call("list", lambda: client.raw.get_prefix_response(f"/astate/{prefix}r", keys_only=True))
    held = set()
    for kv in resp.kvs:
        k = kv.key.decode()
        if want in k:
            held.add(k[len("/astate/") :].split("/", 1)[0])
    return len(held)


def _server_env(args: argparse.Namespace) -> dict[str, str]:
    """The server's environment. ``--server-direct off``: no same-host pidfd fast path in the
    server (it holds a pidfd per connected peer, one per namespace), to compare with the default."""
    env = dict(os.environ)
    if args.server_direct == "off":
        env["ASTATE_SHM_DIRECT"] = "0"
    return env


def _spawn(role: str, args: argparse.Namespace, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--role",
        role,
        "--etcd",
        args.etcd,
        "--prefix",
        args.prefix,
        "--sessions",
        str(args.sessions),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--recover-sessions",
        str(args.recover_sessions),
        "--lease-ttl",
        str(args.lease_ttl),
        "--read-timeout",
        str(args.read_timeout),
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _json_line(p: subprocess.Popen[str], what: str) -> dict[str, Any]:
    assert p.stdout is not None
    while True:  # the last line that is a JSON object (a library below may print to stdout)
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} exited without a result (rc {p.wait()})")
        if line.startswith("{"):
            return json.loads(line)
        print(f"{what}: {line.rstrip()}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="main", choices=("main", "writer", "reader"))
    ap.add_argument("--etcd", default=None, help="etcd endpoint (default: start an embedded one)")
    ap.add_argument("--prefix", default=None)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="concurrent agents putting in the writer")
    ap.add_argument(
        "--recover-sessions",
        type=int,
        default=None,
        help="sessions read back from the replica server after the kill (default: all)",
    )
    ap.add_argument("--lease-ttl", type=float, default=10.0)
    ap.add_argument("--read-timeout", type=float, default=30.0)
    ap.add_argument("--hold-timeout", type=float, default=300.0, help="seconds to wait for the server")
    ap.add_argument("--memory-bytes", default="2G", help="the replica server's budget")
    ap.add_argument(
        "--server-direct",
        default="on",
        choices=("on", "off"),
        help="the replica server's same-host fast path (see _server_env)",
    )
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results")
    args = ap.parse_args()
    if args.recover_sessions is None:
        args.recover_sessions = args.sessions
    args.recover_sessions = min(args.recover_sessions, args.sessions)
    if args.role == "writer":
        return writer(args)
    if args.role == "reader":
        return reader(args)
    etcd_server = None
    if args.etcd is None:
        from astate_store.etcd.embedded import EmbeddedEtcd

        etcd_server = EmbeddedEtcd().start()
        args.etcd = etcd_server.endpoint
    args.prefix = args.prefix or f"bench{uuid.uuid4().hex[:6]}-"
    procs: list[subprocess.Popen[str]] = []
    try:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "astate_store.servers.replica",
                "--etcd",
                args.etcd,
                "--namespace-prefix",
                args.prefix + "r",
                "--memory-bytes",
                args.memory_bytes,
                "--lease-ttl",
                str(args.lease_ttl),
            ],
            env=_server_env(args),
        )
        procs.append(server)
        w = _spawn("writer", args, [])
        procs.append(w)
        result = _json_line(w, "writer")
        t_done = time.perf_counter()
        from astate_store.etcd.client import EtcdClient

        client = EtcdClient(args.etcd, "_bench", lease_ttl=10, op_timeout=5, retry_deadline=15)
        held = 0
        while time.perf_counter() - t_done < args.hold_timeout:
            held = _server_holds(client, args.prefix, args.steps)
            if held >= args.recover_sessions:
                break
            print(
                f"server holds {held}/{args.recover_sessions} ({time.perf_counter() - t_done:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(0.5)
        hold_s = time.perf_counter() - t_done
        client.close(revoke=False)
        w.send_signal(signal.SIGKILL)
        t_kill, kill_at = time.perf_counter(), time.time()
        w.wait()
        r = _spawn("reader", args, [])
        procs.append(r)
        got = _json_line(r, "reader")
        recover_s = time.perf_counter() - t_kill
        out = {
            "sessions": args.sessions,
            "steps": args.steps,
            "threads": args.threads,
            "open_seconds": result["open_seconds"],
            "put_seconds_p50": result["put_seconds_p50"],
            "put_seconds_p99": result["put_seconds_p99"],
            "puts_seconds": result["puts_seconds"],
            "total_seconds": round(result["open_seconds"] + result["puts_seconds"], 3),
            "put_rpcs_mean": result["put_rpcs_mean"],
            "writer_threads": result["writer_threads"],
            "lease_shared": result["lease_shared"],
            "transport_shared": result["transport_shared"],
            "recover_sessions": args.recover_sessions,
            "server_held": held,
            "server_hold_seconds": round(hold_s, 3),
            "recover_seconds": round(recover_s, 3),
            "recovered_ok": got["ok"],
            "recover_bad": got["bad"],
            "recover_read_seconds": got["read_seconds"],  # the reads alone (the reader started and connected)
            "recover_start_seconds": round(got["ready_at"] - kill_at, 3),  # SIGKILL -> the reader ready
            "recover_rpcs_per_session": got["rpcs_per_session"],
            "recover_failovers": got["failovers"],
            "reader_cpu_seconds": got["cpu_seconds"],
            "server_direct": args.server_direct,
            "host_cpus": os.cpu_count(),
        }
        line = json.dumps(out)
        print(line, flush=True)
        if not args.no_record:
            os.makedirs(os.path.join(_HERE, "results"), exist_ok=True)
            with open(os.path.join(_HERE, "results", "sessions.jsonl"), "a") as f:
                f.write(line + "\n")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if p is procs[0] else signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if etcd_server is not None:
            etcd_server.stop()


if __name__ == "__main__":
    main()

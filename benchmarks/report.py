"""Every benchmark's figures in one table: ``benchmarks/results/report.md``.

    python benchmarks/report.py          # gather: the newest JSON line of each results file
    python benchmarks/report.py --run    # run every benchmark once first (``make bench``)

``--run`` runs each benchmark of ``RUNS`` once, in turn (the machine is shared: never two at
once), and appends the JSON line it prints to its results file with the date and the load
(``benchmarks/results/<name>.jsonl``; ``sessions.py`` appends its own). A benchmark that fails
or times out is reported as such; the others still run.

The report holds one table: each figure of ``FIGURES``, its value in the newest line of its
results file that matches its selector, its target, met or not, and that line's date. Figures
without a target are listed for reference ("—"). Benchmarks are not tests: nothing here runs in
``make test``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(_HERE, "results")


@dataclass(frozen=True)
class Run:
    """One benchmark invocation of ``make bench``."""

    name: str  # the results file: results/<name>.jsonl
    args: tuple[str, ...]  # after ``python benchmarks/``
    timeout: float  # seconds
    records_itself: bool = False  # the benchmark appends to its results file itself
    tag: dict[str, Any] = field(default_factory=dict)  # keys added to the recorded line


RUNS = (
    Run("plan_scale", ("plan_scale.py", "--config", "kimi-k2"), 900, tag={"config": "kimi-k2"}),
    Run("plan_scale", ("plan_scale.py", "--config", "deepseek-v3"), 900, tag={"config": "deepseek-v3"}),
    Run("plan_scale", ("plan_scale.py", "--config", "dense-70b"), 900, tag={"config": "dense-70b"}),
    Run("sessions", ("sessions.py",), 1500, records_itself=True),
    # the single-threaded steady put (p50 / p99); 100 sessions read back keep it short
    Run(
        "sessions", ("sessions.py", "--threads", "1", "--recover-sessions", "100"), 1500, records_itself=True
    ),
    Run("sync_bench", ("sync_bench.py",), 1800),
    Run("control_plane", ("control_plane.py",), 1800),
    Run("checkpoint_bench", ("checkpoint_bench.py",), 1200),
    Run("peers", ("peers.py",), 1800),
    Run("stream_lanes", ("stream_lanes.py",), 1200),
    Run("fault_suite", ("fault_suite.py",), 3600),
    # a 0.40B trainer, two network-namespace hosts (root) and a vLLM engine: about 10 minutes, 20 GB
    Run("delta_sync", ("delta_sync.py",), 2400, records_itself=True),
)


@dataclass(frozen=True)
class Figure:
    """One row of the report: ``key`` of the newest line of ``results/<file>.jsonl`` for which
    ``match`` holds, compared with ``target`` by ``op`` ("<", "<=", ">=", "==": a flag that must hold
    when the target is 1; None: no target)."""

    label: str
    file: str
    key: str
    op: str | None = None
    target: float | None = None
    match: Callable[[dict[str, Any]], bool] = lambda d: True


def _cfg(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda d: d.get("config") == name and not d.get("consumers_reserve")


def _READ_ALL(d: dict[str, Any]) -> bool:
    """A sessions run that read all 1,000 back (not the sample of the single-thread run)."""
    return d.get("threads") == 8 and d.get("recover_sessions") == 1000


def _threads(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda d: d.get("threads") == n


_SHM = lambda d: d.get("transport", "shm") != "tcp"  # noqa: E731 (the same-host run)

FIGURES = (
    Figure(
        "plan_seconds, Kimi-K2 fp8, 256 GPUs -> 16 x TP16",
        "plan_scale",
        "plan_seconds",
        "<",
        2.0,
        _cfg("kimi-k2"),
    ),
    Figure(
        "plan_cpu_seconds, Kimi-K2 (this process's CPU)",
        "plan_scale",
        "plan_cpu_seconds",
        "<",
        2.0,
        _cfg("kimi-k2"),
    ),
    Figure("balance ratio, Kimi-K2", "plan_scale", "ratio", "<=", 1.1, _cfg("kimi-k2")),
    Figure(
        "plan_seconds, DeepSeek-V3 fp8, 128 GPUs -> 8 x TP8",
        "plan_scale",
        "plan_seconds",
        "<",
        2.0,
        _cfg("deepseek-v3"),
    ),
    Figure("balance ratio, DeepSeek-V3", "plan_scale", "ratio", "<=", 1.1, _cfg("deepseek-v3")),
    Figure(
        "plan_seconds, dense 70B bf16, 64 GPUs -> 32 x TP2",
        "plan_scale",
        "plan_seconds",
        "<",
        2.0,
        _cfg("dense-70b"),
    ),
    Figure("balance ratio, dense 70B", "plan_scale", "ratio", "<=", 1.1, _cfg("dense-70b")),
    Figure(
        "sessions: 1,000 x 3 puts, 8 threads, seconds", "sessions", "total_seconds", "<=", 10.0, _threads(8)
    ),
    Figure("sessions: put p50 (8 threads), s", "sessions", "put_seconds_p50", None, None, _threads(8)),
    Figure(
        "sessions: read 1,000 back from a replica server, s",
        "sessions",
        "recover_seconds",
        "<=",
        10.0,
        _READ_ALL,
    ),
    Figure(
        "sessions: read-back, reader start-up (of the above), s",
        "sessions",
        "recover_start_seconds",
        match=_READ_ALL,
    ),
    Figure(
        "sessions: read-back, etcd requests per session",
        "sessions",
        "recover_rpcs_per_session",
        match=_READ_ALL,
    ),
    Figure("sessions: steady put p50, 1 thread, s", "sessions", "put_seconds_p50", "<=", 0.002, _threads(1)),
    Figure("sessions: steady put p99, 1 thread, s", "sessions", "put_seconds_p99", "<=", 0.010, _threads(1)),
    Figure("sync: ratio_memcpy (pull / torch copy_)", "sync_bench", "ratio_memcpy", ">=", 0.9, _SHM),
    Figure(
        "sync: ratio_memcpy_streaming (pull / streaming copy around each pull, median)",
        "sync_bench",
        "ratio_memcpy_streaming",
        ">=",
        0.9,
        _SHM,
    ),
    Figure(
        "sync: the same against the copy before each case",
        "sync_bench",
        "ratio_memcpy_streaming_adjacent",
        None,
        None,
        _SHM,
    ),
    Figure(
        "sync: the same against the run's fastest copy",
        "sync_bench",
        "ratio_memcpy_streaming_run_best",
        None,
        None,
        _SHM,
    ),
    Figure("sync: sync_gbps (same-host pull)", "sync_bench", "sync_gbps", None, None, _SHM),
    Figure(
        "sync: memcpy_streaming_gbps (one buffer, NT stores)",
        "sync_bench",
        "memcpy_streaming_gbps",
        None,
        None,
        _SHM,
    ),
    Figure("sync: ratio_put_memcpy", "sync_bench", "ratio_put_memcpy", ">=", 0.8, _SHM),
    Figure("sync: ratio_gloo", "sync_bench", "ratio_gloo", ">=", 3.0, _SHM),
    Figure("sync: ratio_many_tensors", "sync_bench", "ratio_many_tensors", ">=", 0.8, _SHM),
    Figure("sync: ratio_column_vs_row", "sync_bench", "ratio_column_vs_row", ">=", 0.7, _SHM),
    Figure("sync: ratio_convert", "sync_bench", "ratio_convert", ">=", 0.7, _SHM),
    Figure("control plane: first get_into, s", "control_plane", "first_get_seconds", "<=", 10.0),
    Figure("control plane: steady get_into, s", "control_plane", "steady_get_seconds", "<=", 0.1),
    Figure(
        "control plane: etcd round trips per steady put", "control_plane", "etcd_round_trips_put", "<=", 2
    ),
    Figure(
        "control plane: etcd round trips per steady get_into",
        "control_plane",
        "etcd_round_trips_get",
        "<=",
        2,
    ),
    Figure("checkpoint: ratio_write", "checkpoint_bench", "ratio_write"),
    Figure("checkpoint: ratio_restore", "checkpoint_bench", "ratio_restore"),
    Figure("peers: ratio_nixl", "peers", "ratio_nixl", ">=", 1.5),
    Figure("peers: ratio_mooncake", "peers", "ratio_mooncake", ">=", 3.0),
    Figure("peers: ratio_gloo", "peers", "ratio_gloo", ">=", 1.5),
    Figure("fault suite: trials", "fault_suite", "totals.trials"),
    Figure("fault suite: wrong bytes", "fault_suite", "totals.wrong_bytes", "<=", 0),
    Figure("fault suite: hangs", "fault_suite", "totals.hangs", "<=", 0),
    Figure("fault suite: lost versions", "fault_suite", "totals.lost_versions", "<=", 0),
    Figure("fault suite: crashes", "fault_suite", "totals.crashes", "<=", 0),
    Figure("stream lanes: ratio_lanes", "stream_lanes", "ratio_lanes"),
    Figure(
        "delta: changed_fraction per step (median; AdamW lr 1e-6, bf16)", "delta_sync", "changed_fraction"
    ),
    Figure(
        "delta: ratio_delta_tcp (whole / delta pull, two hosts)", "delta_sync", "ratio_delta_tcp", ">=", 5.0
    ),
    Figure(
        "delta: ratio_delta_shm (whole / delta pull, one host)", "delta_sync", "ratio_delta_shm", ">=", 1.5
    ),
    Figure("delta: bytes_ratio (bytes moved / whole)", "delta_sync", "bytes_ratio"),
    Figure("delta: ratio_put (put with delta / without)", "delta_sync", "ratio_put", "<=", 1.75),
    Figure("delta: ratio_vllm (whole / delta update, TP=1 engine)", "delta_sync", "ratio_vllm"),
    Figure("delta: exact (every step, every path, every element)", "delta_sync", "exact", "==", 1),
)


def _lines(name: str) -> list[dict[str, Any]]:
    path = os.path.join(RESULTS, f"{name}.jsonl")
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def _met(value: Any, op: str | None, target: float | None) -> str:
    if op is None or target is None:
        return "—"
    if op == "==" and isinstance(value, bool):
        return "met" if value == bool(target) else "**missed**"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "no figure"
    ok = {"<": value < target, "<=": value <= target, ">=": value >= target, "==": value == target}[op]
    return "met" if ok else "**missed**"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "—" if v is None else str(v)


def _get(d: dict[str, Any], key: str) -> Any:
    """``d[key]``; a dotted key reads nested objects (``totals.wrong_bytes``)."""
    for part in key.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)  # type: ignore[assignment]
    return d


def report() -> str:
    """The markdown report of the newest figures."""
    rows = ["| figure | value | target | met | date (load) | results file |", "|---|---|---|---|---|---|"]
    for fig in FIGURES:
        lines = [d for d in _lines(fig.file) if fig.match(d)]
        d = lines[-1] if lines else {}
        v = _get(d, fig.key) if d else None
        if d.get("error") and v is None:
            v = f"error: {str(d['error'])[:60]}"
        when = d.get("date", "undated") if d else "no run"
        if d.get("load"):
            when += f" ({d['load']})"
        target = "—" if fig.op is None else f"{fig.op} {fig.target}"
        rows.append(
            f"| {fig.label} | {_fmt(v)} | {target} | {_met(v, fig.op, fig.target)} | {when} | "
            f"`results/{fig.file}.jsonl` |"
        )
    head = [
        f"# Benchmark figures ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        "The newest line of each results file (`python benchmarks/report.py`; `make bench` runs every "
        "benchmark once first). Load: the 1-minute load average when the benchmark started, on a host "
        f"with {os.cpu_count()} CPUs.",
        "",
    ]
    return "\n".join(head + rows) + "\n"


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_all(only: set[str] | None = None) -> None:
    """Each benchmark of ``RUNS`` once, in turn; its line appended to its results file."""
    os.makedirs(RESULTS, exist_ok=True)
    for r in RUNS:
        if only and r.name not in only:
            continue
        load = f"load {os.getloadavg()[0]:.1f}"
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        print(f"[report] {r.name}: {' '.join(r.args)} ({load})", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                [sys.executable, os.path.join(_HERE, r.args[0]), *r.args[1:]],
                capture_output=True,
                text=True,
                timeout=r.timeout,
                cwd=os.path.join(_HERE, ".."),
            )
            got = _last_json(p.stdout)
            if got is None:
                got = {"error": f"rc {p.returncode}, no JSON line: {p.stderr.strip()[-300:]}"}
        except subprocess.TimeoutExpired:
            got = {"error": f"timed out after {r.timeout:.0f} s"}
        print(f"[report] {r.name}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        if r.records_itself and "error" not in got:
            _stamp_last(r.name, stamp, load)
            continue
        got = {**r.tag, **got, "date": stamp, "load": load}
        with open(os.path.join(RESULTS, f"{r.name}.jsonl"), "a") as f:
            f.write(json.dumps(got) + "\n")


def _stamp_last(name: str, stamp: str, load: str) -> None:
    """Add the date and the load to the line a benchmark just appended itself."""
    path = os.path.join(RESULTS, f"{name}.jsonl")
    with open(path) as f:
        lines = f.read().splitlines()
    if lines and lines[-1].startswith("{"):
        d = json.loads(lines[-1])
        d.setdefault("date", stamp)
        d.setdefault("load", load)
        lines[-1] = json.dumps(d)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="run every benchmark once first")
    ap.add_argument("--only", default="", help="with --run: comma list of results names to run")
    args = ap.parse_args()
    if args.run:
        run_all({x for x in args.only.split(",") if x} or None)
    text = report()
    with open(os.path.join(RESULTS, "report.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()

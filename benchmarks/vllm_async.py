"""An update landing while a vLLM server streams: how long the engine stops, done the blocking way and
prepared in the background, in one run.

The 494M-parameter Qwen2 of ``vllm_sync.py`` (Qwen2.5-0.5B's shape, tied embeddings, random bf16) is served by
vLLM's OpenAI server (``VLLM_SERVER_DEV_MODE=1``, TP=1, CPU). Each trial starts 4 streaming greedy
completions (16-token prompts, 320 tokens each); once each has 16 tokens and 2 s of baseline passed,
the trainer (this process) publishes the other weights (``store.put``: the reference tensors or their
negation, alternately) and the engine takes them:

- ``blocking``: once each stream has 160 tokens, ``update_weights(url, step)``: the pull and vLLM's
  post-processing of the staged (prepacked) linear layers inside the engine's call;
- ``background``: ``begin_update(url, step)`` at once; the engine serves while it pulls and post-processes
  on a shadow; once every worker is ready and each stream has 160 tokens, ``apply_update(url)``: the swap.

The swap comes at the same context length both ways (160 tokens a stream, unless the background took
longer: ``context_at_swap``), so that what ``inflight="recompute"`` recomputes is the same.

Each is run with ``inflight="keep"`` (the requests in flight continue on the new weights with their KV;
the server runs without prefix caching, which that needs) and with ``inflight="recompute"`` (the default:
the prefix cache cleared and the requests in flight recomputed on the new weights after the swap, which
costs the same prefill in both ways).

Measured from the token arrivals of the 4 streams (merged: the engine's output), from the put until the
streams end: the longest gap between two tokens (``blocking_seconds``, ``stall_seconds``; median
over rounds), ``stall_ratio`` (the second over the first; target <= 0.25), the tokens per second while the
background pull runs against the same streams without an update, and the longest gap without an update
(``baseline_gap_seconds``: the machine's own noise). ``verified``: after every update to the
reference weights, what the engine computes with (the engine's ``"served"`` query: prepacked GEMMs read back
through the GEMM) hashes to what it computed with after loading them from disk, and after every update to
the negation it does not. Prints one JSON line and appends it to benchmarks/results/vllm_async.jsonl.

    .venv/bin/python benchmarks/vllm_async.py [--rounds 2] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

STREAMS = 4
PROMPT = 16
TOKENS = 320
BEFORE = 16  # tokens each stream has when the baseline starts (then the put; background: the begin)
SWAP_AT = 160  # tokens each stream has when the swap starts: the same context to recompute both ways


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    import requests

    port = _free_port()
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE="2",
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
        ),
    )
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    args += ["--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager"]
    args += [
        "--max-model-len",
        "512",
        "--max-num-seqs",
        str(2 * STREAMS),
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
    ]
    args += ["--no-enable-prefix-caching", "--weight-transfer-config", json.dumps({"backend": "astate"})]
    proc = subprocess.Popen(
        args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM server did not come up; see {log}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(2)


class Streams:
    """STREAMS streamed completions; every token's arrival time, per stream."""

    def __init__(self, url: str, model: str, seed: int, vocab: int) -> None:
        self.arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._run, args=(url, model, i, seed, vocab), daemon=True)
            for i in range(STREAMS)
        ]
        for t in self.threads:
            t.start()

    def _run(self, url: str, model: str, i: int, seed: int, vocab: int) -> None:
        import requests

        prompt = [(seed * 7919 + i * 104729 + k * 31) % (vocab - 1) + 1 for k in range(PROMPT)]
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        try:
            with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                        now = time.perf_counter()
                        self.arrivals[i].extend([now] * n)
        except Exception as e:  # reported in the JSON line
            self.errors.append(f"{type(e).__name__}: {e}"[:300])

    def wait_tokens(self, n: int) -> None:
        while min(len(a) for a in self.arrivals) < n and not self.errors:
            time.sleep(0.005)

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def merged(self) -> list[float]:
        return sorted(t for a in self.arrivals for t in a)

    def counts(self) -> list[int]:
        return [len(a) for a in self.arrivals]


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest time without a token between ``start`` and ``end`` (from ``start`` to the first one)."""
    inside = [start] + [t for t in times if start < t <= end]
    return max((b - a for a, b in zip(inside, inside[1:])), default=0.0)


def rate(times: list[float], start: float, end: float) -> float:
    return sum(1 for t in times if start < t <= end) / max(end - start, 1e-9)


def trial(
    url: str, model: str, store: Any, tensors: dict[str, Any], step: int, way: str, inflight: str
) -> dict[str, Any]:
    """One update under STREAMS streams, ``way`` "blocking" or "background"."""
    from astate_store.integrations.vllm import HTTPClient, apply_update, begin_update, update_weights

    control = HTTPClient(url)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    streams = Streams(url, model, step, vocab)
    streams.wait_tokens(BEFORE)
    t_base = time.perf_counter()
    time.sleep(3.0)  # the streams alone: the baseline rate and longest gap
    t_base_end = time.perf_counter()
    baseline = rate(streams.merged(), t_base, t_base_end)
    baseline_gap = longest_gap(streams.merged(), t_base, t_base_end)
    store.put(step, tensors)
    time.sleep(0.5)  # the put's copy out of the way
    t0 = time.perf_counter()
    out: dict[str, Any] = {"way": way, "inflight": inflight, "step": step}
    if way == "blocking":
        streams.wait_tokens(SWAP_AT)
        t_swap = time.perf_counter()
        out["context_at_swap"] = PROMPT + statistics.mean(streams.counts())
        update_weights(control, step, inflight=inflight)  # type: ignore[arg-type]
        t_end = time.perf_counter()
        out["update_seconds"] = t_end - t_swap
    else:
        begin_update(control, step)
        t_begun = time.perf_counter()
        while not all(s["pending"] and not s["pending"]["running"] for s in control.status()):
            time.sleep(0.1)  # each question is a call through the engine's loop: not too often
        t_ready = time.perf_counter()
        out["staging_bytes"] = sum(s["pending"]["staging_bytes"] for s in control.status())
        streams.wait_tokens(SWAP_AT)
        t_swap = time.perf_counter()
        out["context_at_swap"] = PROMPT + statistics.mean(streams.counts())
        apply_update(control, inflight=inflight)  # type: ignore[arg-type]
        t_end = time.perf_counter()
        out.update(
            begin_seconds=t_begun - t0,
            background_seconds=t_ready - t_begun,
            apply_seconds=t_end - t_swap,
            tokens_per_s_during_pull=rate(streams.merged(), t_begun, t_ready),
        )
    streams.join()
    times = streams.merged()
    end = min(a[-1] for a in streams.arrivals if a)
    if way == "background":  # where the longest gap falls: around begin, during the pull, around apply
        out["gap_begin_seconds"] = longest_gap(times, t0, t_begun + 0.3)
        out["gap_pull_seconds"] = longest_gap(times, t_begun + 0.3, t_ready)
        out["gap_apply_seconds"] = longest_gap(times, t_swap, end)
    out["gap_seconds"] = longest_gap(times, t0, end)
    out["tokens_per_s_before"] = baseline
    out["baseline_gap_seconds"] = baseline_gap
    out["in_flight"] = end > t_end  # the streams outlived the update
    out["tokens"] = streams.counts()
    out["errors"] = streams.errors
    out["engine_seconds"] = control.status()[0]["seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a tiny model (a quick check of the script)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop our server
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_sync import load_tensors, make_model

    import astate_store
    from astate_store.etcd.embedded import EmbeddedEtcd
    from astate_store.integrations.vllm import HTTPClient, update_weights

    work = Path(tempfile.mkdtemp(prefix="vllm_async-"))
    params = make_model(work / "model", args.small)
    tensors = load_tensors(work / "model")
    negated = {n: -t for n, t in tensors.items()}
    etcd = EmbeddedEtcd().start()
    proc, url = start_server(work / "model", work / "server.log")
    ns = "bench-async-" + uuid.uuid4().hex[:8]
    store = astate_store.connect(ns, etcd=etcd.endpoint)
    control = HTTPClient(url)
    results: list[dict[str, Any]] = []
    verified = {"blocking": True, "background": True}
    try:
        ref = control.served()
        control.init_weight_transfer_engine({"namespace": ns, "etcd": etcd.endpoint, "timeout": 300})
        # the first update of a published set bakes (drives the loaders once): untimed
        step = 1
        store.put(step, negated)
        update_weights(control, step)
        serving_ref = False
        for r in range(args.rounds):
            for inflight in ("keep", "recompute"):
                for way in ("blocking", "background"):
                    step += 1
                    target = tensors if not serving_ref else negated
                    res = trial(url, str(work / "model"), store, target, step, way, inflight)
                    serving_ref = target is tensors
                    ok = (control.served() == ref) == serving_ref
                    verified[way] = verified[way] and ok
                    res["round"], res["verified"] = r, ok
                    results.append(res)
                    print(json.dumps(res), flush=True)
    finally:
        store.close()
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # our own server's process group
            proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        etcd.stop()

    def med(way: str, inflight: str, key: str) -> float | None:
        v = [x[key] for x in results if x["way"] == way and x["inflight"] == inflight and key in x]
        return round(statistics.median(v), 4) if v else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    blocking, stall = med("blocking", "keep", "gap_seconds"), med("background", "keep", "gap_seconds")
    blocking_rc, stall_rc = (
        med("blocking", "recompute", "gap_seconds"),
        med("background", "recompute", "gap_seconds"),
    )
    import torch

    line = {
        "bench": "vllm_async",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_avg_1m": os.getloadavg()[0],
        "cores": os.cpu_count(),
        "params": params,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "tp": 1,
        "streams": STREAMS,
        "rounds": args.rounds,
        "blocking_seconds": blocking,
        "stall_seconds": stall,
        "stall_ratio": ratio(stall, blocking),
        "blocking_seconds_recompute": blocking_rc,
        "stall_seconds_recompute": stall_rc,
        "stall_ratio_recompute": ratio(stall_rc, blocking_rc),
        "baseline_gap_seconds": med("background", "keep", "baseline_gap_seconds"),
        "tokens_per_s_before": med("background", "keep", "tokens_per_s_before"),
        "tokens_per_s_during_pull": med("background", "keep", "tokens_per_s_during_pull"),
        "background_seconds": med("background", "keep", "background_seconds"),
        "apply_seconds": med("background", "keep", "apply_seconds"),
        "update_seconds_blocking": med("blocking", "keep", "update_seconds"),
        "context_at_swap": med("background", "recompute", "context_at_swap"),
        "staging_bytes": med("background", "keep", "staging_bytes"),
        "in_flight": all(x["in_flight"] for x in results),
        "verified": verified,
        "errors": sorted({e for x in results for e in x["errors"]}),
        "cpu_avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "vllm": __import__("vllm").__version__,
    }
    print(json.dumps(line))
    if not args.small:
        out = Path(__file__).parent / "results" / "vllm_async.jsonl"
        out.parent.mkdir(exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()

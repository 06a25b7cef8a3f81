"""Trainer step to engine ready, on one real SGLang engine (CPU), three ways side by side in one run.

The 494M-parameter Qwen2 of ``benchmarks/vllm_sync.py`` (Qwen2.5-0.5B's shape, tied embeddings, random
bf16 weights) is loaded by one SGLang 0.5.23 engine (offline ``sglang.Engine``, TP=1, bf16, from
.venv-sglang in a subprocess: ``tests/support/sglang_engine.py``). Each round the trainer holds the same
tensors (so every path is verified against one reference); the engine is first moved off them
(untimed: SGLang's ``weights_checker`` ``reset_tensors``, noise in every parameter), then they are
delivered:

- ``ours``: ``store.put(step, tensors)`` here, then ``astate_store.integrations.sglang.update`` (one
  call: SGLang's session with the astate loader, every parameter pulled in place);
- ``tensor``: SGLang's ``update_weights_from_tensor`` with the full tensors (in SGLang's session), from
  the process that holds them (the engine's driver; SGLang serializes them to its scheduler, whose
  ``load_weights`` copies them): what slime / verl do on one host;
- ``disk``: the trainer writes safetensors (``save_file``) and the engine runs
  ``update_weights_from_disk`` on them.

After each, SGLang's per-parameter checksums must equal those it had after loading from disk, and must
not before (``verified``). A path that fails is reported with its error (``errors``). The first astate
update of the published set (it bakes) is timed apart (``ours_first_seconds``). Prints one JSON line and
appends it to benchmarks/results/sglang_sync.jsonl.

    .venv/bin/python benchmarks/sglang_sync.py [--rounds 2] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_sync import load_tensors, make_model  # noqa: I001  (the same model, made alike)
from tests.support import sglang_engine as S


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _ratio(x: float | None, ours: float | None) -> float | None:
    return None if x is None or not ours else round(x / ours, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a tiny model (a quick check of the script)")
    args = ap.parse_args()
    if not S.available():
        raise SystemExit("SGLang's environment (.venv-sglang) is not made: run `make sglang-env`")
    import astate_store
    from astate_store.etcd.embedded import EmbeddedEtcd

    work = Path(tempfile.mkdtemp(prefix="sglang_sync-"))
    params = make_model(work / "model", args.small)
    config = json.loads((work / "model" / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]  # SGLang picks the model class by it
    (work / "model" / "config.json").write_text(json.dumps(config))
    tensors = load_tensors(work / "model")
    etcd = EmbeddedEtcd().start()
    engine = store = None
    try:
        engine = S.OfflineEngine(
            work / "model", work / "engine.log", dtype="bfloat16", custom_weight_loader=[S.LOADER]
        )
        ns = "bench-" + uuid.uuid4().hex[:8]
        store = astate_store.connect(ns, etcd=etcd.endpoint)
        run(args, work, params, tensors, engine, store, ns, etcd.endpoint)
    finally:
        if store is not None:
            store.close()
        if engine is not None:
            engine.close()
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


def run(
    args: Any, work: Path, params: int, tensors: dict, engine: Any, store: Any, ns: str, etcd: str
) -> None:
    from safetensors.torch import save_file

    ref = engine.call("checksums")
    engine.call("hold", path=str(work / "model" / "model.safetensors"))
    times: dict[str, list[float]] = {"ours": [], "tensor": [], "disk": []}
    verified: dict[str, bool] = {}  # path -> every round delivered exactly the reference
    errors: dict[str, str] = {}
    step = 0

    def ours() -> None:
        nonlocal step
        step += 1
        store.put(step, tensors)
        assert engine.call("update", namespace=ns, etcd=etcd, step=step, timeout=120.0) == step

    def tensor() -> None:
        ok, message = engine.call("from_held")
        assert ok, message

    def disk() -> None:
        out = work / f"trainer-{len(times['disk'])}"
        out.mkdir(exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(work / "model" / "config.json", out / "config.json")
        ok, message = engine.call("from_disk", path=str(out))
        assert ok, message

    engine.call("reset")
    t = time.perf_counter()
    ours()  # the first update bakes (once per published set); the rounds below are steady state
    first = time.perf_counter() - t
    verified["ours_first"] = engine.call("checksums") == ref
    for r in range(args.rounds):
        for name, fn in (("ours", ours), ("tensor", tensor), ("disk", disk)):
            engine.call("reset")  # untimed: the engine off the reference weights, on every path alike
            off = engine.call("checksums") != ref
            t = time.perf_counter()
            try:
                fn()
            except Exception as e:  # a path that fails is reported; the others still run
                errors[name] = f"{type(e).__name__}: {e}"[:300]
                print(f"round {r} {name}: failed: {errors[name]}", flush=True)
                continue
            times[name].append(time.perf_counter() - t)
            ok = off and engine.call("checksums") == ref
            verified[name] = verified.get(name, True) and ok
            print(f"round {r} {name}: {times[name][-1]:.3f}s verified={ok}", flush=True)
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    line: dict[str, Any] = {
        "bench": "sglang_sync",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_avg_1m": os.getloadavg()[0],
        "cores": os.cpu_count(),
        "params": params,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "tp": 1,
        "dtype": "bfloat16",
        "rounds": args.rounds,
        "engine_start_seconds": round(engine.start_seconds, 1),
        "ours_first_seconds": _round(first),
        "ours_seconds": _round(med["ours"]),
        "tensor_seconds": _round(med["tensor"]),
        "disk_seconds": _round(med["disk"]),
        "ratio_tensor": _ratio(med["tensor"], med["ours"]),
        "ratio_disk": _ratio(med["disk"], med["ours"]),
        "all_rounds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "verified": verified,
        "errors": errors,
        "sglang": "0.5.23",
    }
    print(json.dumps(line))
    if not args.small:
        out = ROOT / "benchmarks" / "results" / "sglang_sync.jsonl"
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()

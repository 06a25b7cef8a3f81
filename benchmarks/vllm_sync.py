"""Trainer step to engine ready, on one real vLLM engine (CPU), three ways side by side in one run.

A ~0.5B-parameter Qwen2 (Qwen2.5-0.5B's shape: 24 layers, hidden 896, tied embeddings) is made from a
config with random bf16 weights and loaded by one vLLM engine (TP=1). Each round the trainer holds new
weights (the same tensors each time, so every path can be verified against one reference), the
engine is first moved off them (untimed: the negated tensors delivered through our backend, since
``reset_weights`` cannot reach a weight that only a prepacked GEMM holds), and the new weights are
delivered:

- ``ours``: ``store.put(step, tensors)`` then the four phases with the ``astate`` backend (in place);
- ``reload``: the trainer writes safetensors (``save_file``), the engine reloads them
  (``reload_weights(weights_path=...)``);
- ``gather``: the full tensors go to the engine's ``load_weights`` through ``collective_rpc`` (the
  path verl, TRL and OpenRLHF take without NCCL).

After each, what the engine computes with (``served_weights``: a prepacked GEMM's weight read back
through the GEMM) must hash to the same digests as after loading from disk, and must not before
(``verified``). A path that raises is reported with its error (``errors``). Prints one JSON line and
appends it to benchmarks/results/vllm_sync.jsonl.

    .venv/bin/python benchmarks/vllm_sync.py [--rounds 2] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch


def make_model(path: Path, small: bool) -> int:
    import transformers

    dims = (
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
        )
        if not small
        else dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    config = transformers.Qwen2Config(
        tie_word_embeddings=True, max_position_embeddings=512, torch_dtype="bfloat16", **dims
    )
    with torch.device("meta"):
        shapes = {
            n: (tuple(t.shape), n) for n, t in transformers.Qwen2ForCausalLM(config).state_dict().items()
        }
    gen = torch.Generator().manual_seed(0)
    tensors = {
        n: (torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16)
        for n, (s, _) in shapes.items()
        if n != "lm_head.weight"
    }
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values())


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def feed_load_weights(worker: Any, blob: bytes) -> None:
    """On the worker: the full tensors (shipped as one torch.save blob) into the model's load_weights."""
    import io

    tensors = torch.load(io.BytesIO(blob), weights_only=True)
    worker.model_runner.get_model().load_weights(iter(tensors.items()))


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _ratio(x: float | None, ours: float | None) -> float | None:
    return None if x is None or not ours else round(x / ours, 2)


def served_digest(worker: Any) -> dict[str, str]:
    """On the worker: a digest of every weight it computes with (integrations/vllm/served.py)."""
    import hashlib

    from astate_store.integrations.vllm.served import served_weights

    model = worker.model_runner.get_model()
    return {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in served_weights(model).items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a tiny model (a quick check of the script)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    import astate_store
    from astate_store.etcd.embedded import EmbeddedEtcd

    work = Path(tempfile.mkdtemp(prefix="vllm_sync-"))
    params = make_model(work / "model", args.small)
    tensors = load_tensors(work / "model")
    etcd = EmbeddedEtcd().start()
    llm = LLM(
        model=str(work / "model"),
        skip_tokenizer_init=True,
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=2,
        dtype="bfloat16",
        weight_transfer_config={"backend": "astate"},
    )
    rpc = llm.llm_engine.collective_rpc
    ref = rpc(served_digest)
    negated = {n: -t for n, t in tensors.items()}
    ns = "bench-" + uuid.uuid4().hex[:8]
    store = astate_store.connect(ns, etcd=etcd.endpoint)
    llm.init_weight_transfer_engine({"init_info": {"namespace": ns, "etcd": etcd.endpoint}})
    times: dict[str, list[float]] = {"ours": [], "reload": [], "gather": []}
    verified: dict[str, bool] = {}  # path -> every round delivered exactly the reference
    errors: dict[str, str] = {}
    step = 0

    def deliver(what: dict[str, torch.Tensor]) -> None:  # put the next step, then the four phases
        nonlocal step
        step += 1
        store.put(step, what)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": step}})
        llm.finish_weight_update(weight_version=str(step))

    def scramble() -> None:  # untimed: the engine off the reference weights, on every path alike
        deliver(negated)

    def ours() -> None:
        deliver(tensors)

    def reload() -> None:
        from safetensors.torch import save_file

        out = work / f"trainer-{step}"
        out.mkdir(exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        rpc("reload_weights", kwargs={"weights_path": str(out)})

    def gather() -> None:  # vLLM's RPC does not carry a dict of tensors as tensors: one serialized blob
        import io

        buf = io.BytesIO()
        torch.save(tensors, buf)
        rpc(feed_load_weights, args=(buf.getvalue(),))

    ours()  # the first update bakes (once per published set); rounds below are steady state
    for r in range(args.rounds):
        for name, fn in (("ours", ours), ("reload", reload), ("gather", gather)):
            scramble()
            off = rpc(served_digest) != ref
            t = time.perf_counter()
            try:
                fn()
            except Exception as e:  # a path that fails is reported; the others still run
                errors[name] = f"{type(e).__name__}: {e}"[:300]
                print(f"round {r} {name}: failed: {errors[name]}", flush=True)
                continue
            times[name].append(time.perf_counter() - t)
            ok = off and rpc(served_digest) == ref
            verified[name] = verified.get(name, True) and ok
            print(f"round {r} {name}: {times[name][-1]:.3f}s verified={ok}", flush=True)
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    line = {
        "bench": "vllm_sync",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_avg_1m": os.getloadavg()[0],
        "cores": os.cpu_count(),
        "params": params,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "tp": 1,
        "rounds": args.rounds,
        "ours_seconds": _round(med["ours"]),
        "reload_seconds": _round(med["reload"]),
        "gather_seconds": _round(med["gather"]),
        "ratio_reload": _ratio(med["reload"], med["ours"]),
        "ratio_gather": _ratio(med["gather"], med["ours"]),
        "verified": verified,
        "errors": errors,
        "cpu_avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "vllm": __import__("vllm").__version__,
    }
    print(json.dumps(line))
    if not args.small:
        out = Path(__file__).parent / "results" / "vllm_sync.jsonl"
        out.parent.mkdir(exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")
    store.close()
    llm.llm_engine.engine_core.shutdown()
    etcd.stop()


if __name__ == "__main__":
    main()

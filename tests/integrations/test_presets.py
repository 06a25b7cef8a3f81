"""Presets: HF names as views into engine-layout fused parameters.

Every expected engine buffer here is built from the HF tensors with torch.cat / chunk following the
engine's documented convention (vLLM's QKVParallelLinear, MergedColumnParallelLinear, FusedMoE,
VocabParallelEmbedding; Megatron-core's interleaved linear_qkv), independently of
``astate_store.integrations.presets``. Then: (a) pure checks that the views alias the buffers,
hold the right HF boxes and cover every byte once; (b) round trips through a real store (real etcd, shm
transport)
into TP=1 and TP=2 consumers; (c) Megatron interleaved publishers <-> HF / vLLM consumers.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import transformers
from transformers import DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from astate_store import LayoutError, Shard
from astate_store.integrations.presets import PRESETS, engine_shapes, views
from astate_store.store import Store

# ---- tiny models (hidden 64) ----------------------------------------------------------------------


def llama_cfg() -> LlamaConfig:  # vocab 100: vLLM pads it to 128, rank 1 of 2 holds 36 real rows
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=False,
    )


def qwen2_cfg() -> Qwen2Config:  # one KV head: replicated on both ranks of TP=2; tied embeddings
    return Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=128,
        tie_word_embeddings=True,
    )


def qwen3_cfg() -> Qwen3Config:  # per-head q_norm / k_norm
    return Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        tie_word_embeddings=False,
    )


def qwen3_moe_cfg() -> Qwen3MoeConfig:  # layer 0 dense (mlp_only_layers), layer 1 with 4 experts
    return Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        tie_word_embeddings=False,
    )


def dsv3_cfg(q_lora: int | None = 32) -> DeepseekV3Config:  # layer 0 dense, layer 1 MoE + shared expert
    return DeepseekV3Config(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=q_lora,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        tie_word_embeddings=False,
    )


def megatron_cfg() -> LlamaConfig:  # 4 query groups of 2 heads: 2 groups per rank at TP=2
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=100,
        tie_word_embeddings=False,
    )


MODELS = {  # the HF model class whose state_dict names the tensors (imported when first used)
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "megatron": "LlamaForCausalLM",
}


def hf_state(preset: str, cfg: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """A real HF model's state_dict (its names and shapes), every tensor refilled with distinct random
    values (norms included, so a misplaced norm shows); tied tensors stay one storage."""
    with torch.device("meta"):
        names = getattr(transformers, MODELS[preset])(cfg).state_dict()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in names.items():
        out[name] = torch.randn(tuple(t.shape), generator=gen)
    if getattr(cfg, "tie_word_embeddings", False):
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def per_expert(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 fused experts (``experts.gate_up_proj`` [E, 2I, H] = [gate | up]) as the
    per-expert checkpoint names."""
    out = {}
    for name, t in hf.items():
        if name.endswith(".experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{base}{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


# ---- the engines' layouts, built with cat / chunk -------------------------------------------------


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[0]) % multiple
    return torch.cat([t, torch.zeros(extra, *t.shape[1:], dtype=t.dtype)])


def kv_slice(t: torch.Tensor, kv_heads: int, r: int, tp: int) -> torch.Tensor:
    """vLLM: k/v split over ranks when kv_heads >= tp, else rank r holds head r // (tp / kv_heads)."""
    if kv_heads >= tp:
        return t.chunk(tp)[r]
    return t.chunk(kv_heads)[r // (tp // kv_heads)]


def vllm_engine(
    hf: dict[str, torch.Tensor], cfg: Any, r: int, tp: int, ep: bool = False
) -> dict[str, torch.Tensor]:
    """The vLLM parameters of rank r of TP=tp, from HF tensors (transformers >= 5 fused expert names)."""
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if (
            ".k_proj." in name
            or ".v_proj." in name
            or ".up_proj." in name
            or ("kv_a_proj_with_mqa" in name and getattr(cfg, "q_lora_rank", None))
        ):
            continue  # fused with their q / gate / q_a partner below
        if ".q_proj." in name and name.replace(".q_proj.", ".k_proj.") in hf:
            k, v = hf[name.replace(".q_proj.", ".k_proj.")], hf[name.replace(".q_proj.", ".v_proj.")]
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                [t.chunk(tp)[r], kv_slice(k, kvh, r, tp), kv_slice(v, kvh, r, tp)]
            )
        elif ".gate_proj." in name:
            up = hf[name.replace(".gate_proj.", ".up_proj.")]
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([t.chunk(tp)[r], up.chunk(tp)[r]])
        elif name.endswith("q_a_proj.weight"):  # fused_qkv_a_proj: replicated, [q_a | kv_a]
            kv_a = hf[name.replace("q_a_proj", "kv_a_proj_with_mqa")]
            out[name.replace("q_a_proj", "fused_qkv_a_proj")] = torch.cat([t, kv_a])
        elif name.endswith(".experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            if ep:
                out[base + "w13_weight"] = t.chunk(tp)[r]
                out[base + "w2_weight"] = hf[base + "down_proj"].chunk(tp)[r]
            else:
                gate, up = t.chunk(2, dim=1)
                out[base + "w13_weight"] = torch.cat(
                    [gate.chunk(tp, dim=1)[r], up.chunk(tp, dim=1)[r]], dim=1
                )
                out[base + "w2_weight"] = hf[base + "down_proj"].chunk(tp, dim=2)[r]
        elif name.endswith(".experts.down_proj"):
            continue
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # RowParallelLinear
            out[name] = t.chunk(tp, dim=1)[r]
        elif name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "q_proj.weight")):  # ColumnParallelLinear
            out[name] = t.chunk(tp)[r]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):  # padded to 64, then split
            out[name] = pad_rows(t, 64).chunk(tp)[r]
        else:  # norms, routers, score-correction biases, ReplicatedLinear
            out[name] = t
    return {n: t.clone() for n, t in out.items()}


def megatron_engine(hf: dict[str, torch.Tensor], cfg: Any, r: int, tp: int) -> dict[str, torch.Tensor]:
    """Megatron-core (Transformer Engine spec) parameters of rank r: linear_qkv interleaved per query
    group as [q heads of the group | k | v], linear_fc1 = [gate_r | up_r], vocab padded to 128 * tp."""
    g, hd, h = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.hidden_size
    per = cfg.num_attention_heads // g
    out = {
        "embedding.word_embeddings.weight": pad_rows(hf["model.embed_tokens.weight"], 128 * tp).chunk(tp)[r],
        "output_layer.weight": pad_rows(hf["lm_head.weight"], 128 * tp).chunk(tp)[r],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    for i in range(cfg.num_hidden_layers):
        a, m, d = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"decoder.layers.{i}"
        q = hf[f"{a}.q_proj.weight"].reshape(g, per * hd, h)
        k = hf[f"{a}.k_proj.weight"].reshape(g, hd, h)
        v = hf[f"{a}.v_proj.weight"].reshape(g, hd, h)
        out[f"{d}.self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h).chunk(tp)[r]
        if f"{a}.q_proj.bias" in hf:  # Qwen2: the biases interleaved the same way
            qb, kb, vb = (hf[f"{a}.{x}_proj.bias"].reshape(g, -1) for x in "qkv")
            out[f"{d}.self_attention.linear_qkv.bias"] = (
                torch.cat([qb, kb, vb], dim=1).reshape(-1).chunk(tp)[r]
            )
        out[f"{d}.self_attention.linear_qkv.layer_norm_weight"] = hf[
            f"model.layers.{i}.input_layernorm.weight"
        ]
        out[f"{d}.self_attention.linear_proj.weight"] = hf[f"{a}.o_proj.weight"].chunk(tp, dim=1)[r]
        out[f"{d}.mlp.linear_fc1.weight"] = torch.cat(
            [hf[f"{m}.gate_proj.weight"].chunk(tp)[r], hf[f"{m}.up_proj.weight"].chunk(tp)[r]]
        )
        out[f"{d}.mlp.linear_fc1.layer_norm_weight"] = hf[f"model.layers.{i}.post_attention_layernorm.weight"]
        out[f"{d}.mlp.linear_fc2.weight"] = hf[f"{m}.down_proj.weight"].chunk(tp, dim=1)[r]
    return {n: t.clone() for n, t in out.items()}


# ---- helpers --------------------------------------------------------------------------------------


def shards_of(view: Any) -> list[Shard]:
    if isinstance(view, torch.Tensor):
        return [Shard(view, (0,) * view.dim(), tuple(view.shape))]
    return list(view) if isinstance(view, list) else [view]


def owner(t: torch.Tensor, params: dict[str, torch.Tensor]) -> str:
    """The engine parameter whose memory holds view ``t`` (it must lie inside one of them)."""
    lo = t.data_ptr()
    hi = lo + sum((z - 1) * st for z, st in zip(t.shape, t.stride())) * t.element_size()  # last element
    for n, p in params.items():
        start, end = p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()
        if start <= lo and hi < end and t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
            return n
    raise AssertionError(f"view at {lo:#x} lies in no engine parameter (a copy?)")


def box(t: torch.Tensor, s: Shard) -> torch.Tensor:
    return t[tuple(slice(o, o + z) for o, z in zip(s.offsets, s.tensor.shape))]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.int32)


def padding_rows(name: str, params: dict[str, torch.Tensor], vocab: int, r: int) -> int:
    """Rows of vocab parameter ``name`` on rank r that hold padding, not vocabulary."""
    per = params[name].shape[0]
    return per - max(0, min(per, vocab - r * per))


def check_views(
    vs: dict[str, Any],
    params: dict[str, torch.Tensor],
    hf: dict[str, torch.Tensor],
    vocab_params: dict[str, int],
) -> None:
    """(a): every view aliases an engine parameter (no copy), holds exactly its HF box's values, and
    the views cover every engine element exactly once (vocabulary padding rows: never)."""
    counts = {n: torch.zeros(p.shape, dtype=torch.int32) for n, p in params.items()}
    for name, view in vs.items():
        for s in shards_of(view):
            n = owner(s.tensor, params)
            p = params[n]
            assert torch.equal(bits(s.tensor), bits(box(hf[name], s))), f"{name} box {s.offsets} -> {n}"
            c = counts[n]
            c.as_strided(
                s.tensor.shape, s.tensor.stride(), s.tensor.storage_offset() - p.storage_offset()
            ).add_(1)
    for n, c in counts.items():
        pad = vocab_params.get(n, 0)
        real = c[: c.shape[0] - pad] if pad else c
        assert bool((real == 1).all()), f"{n}: elements covered {sorted(set(real.flatten().tolist()))} times"
        if pad:
            assert bool((c[c.shape[0] - pad :] == 0).all()), f"{n}: padding rows mapped"


def hf_covered(preset: str, cfg: Any, hf: dict[str, torch.Tensor], tp: int, **kw: Any) -> None:
    """The ranks' boxes together hold every element of every HF tensor the engine keeps."""
    seen = {n: torch.zeros(t.shape, dtype=torch.bool) for n, t in hf.items()}
    for r in range(tp):
        shapes = engine_shapes(preset, cfg, tp_rank=r, tp_size=tp, **kw)
        bufs = {n: torch.zeros(s) for n, s in shapes.items()}
        for name, view in views(preset, bufs, cfg, tp_rank=r, tp_size=tp, **kw).items():
            for s in shards_of(view):
                box(seen[name], s).fill_(True)
    skip = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    for n, m in seen.items():
        if n not in skip:
            assert bool(m.all()), f"{n}: {int((~m).sum())} elements no rank maps"


# ---- (a) pure checks ------------------------------------------------------------------------------

# (preset, config factory, tp sizes)
CASES = [
    ("llama", llama_cfg, (1, 2)),
    ("qwen2", qwen2_cfg, (1, 2, 4)),  # TP=2 and 4 replicate the single KV head
    ("qwen3", qwen3_cfg, (2,)),
    ("qwen3_moe", qwen3_moe_cfg, (1, 2)),
    ("deepseek_v3", dsv3_cfg, (1, 2)),
    ("deepseek_v3", lambda: dsv3_cfg(q_lora=None), (2,)),  # q_proj + replicated kv_a_proj_with_mqa
]


@pytest.mark.parametrize("preset,make_cfg,tps", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_views_alias_the_engine_layout_and_cover_it_once(
    preset: str, make_cfg: Callable[[], Any], tps: tuple[int, ...]
) -> None:
    cfg = make_cfg()
    hf = hf_state(preset, cfg)
    for tp in tps:
        for r in range(tp):
            params = vllm_engine(hf, cfg, r, tp)
            assert engine_shapes(preset, cfg, tp_rank=r, tp_size=tp, hf_experts="fused") == {
                n: tuple(t.shape) for n, t in params.items()
            }
            pads = {
                n: padding_rows(n, params, cfg.vocab_size, r)
                for n in ("model.embed_tokens.weight", "lm_head.weight")
                if n in params
            }
            for mode, source in (("fused", hf), ("per_expert", per_expert(hf))):
                vs = views(preset, params, cfg, tp_rank=r, tp_size=tp, hf_experts=mode)
                check_views(vs, params, source, pads)
        hf_covered(preset, cfg, per_expert(hf), tp)


def test_gqa_replicated_kv_heads_follow_the_rank() -> None:
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=128,
    )
    hf = hf_state("qwen2", cfg)
    for r in range(4):  # TP=4 over 2 KV heads: ranks 0, 1 hold head 0; ranks 2, 3 hold head 1
        params = vllm_engine(hf, cfg, r, 4)
        vs = views("qwen2", params, cfg, tp_rank=r, tp_size=4)
        k = vs["model.layers.0.self_attn.k_proj.weight"]
        assert k.offsets == ((r // 2) * 8, 0) and k.global_shape == (16, 64)
        assert vs["model.layers.0.self_attn.v_proj.bias"].offsets == ((r // 2) * 8,)
        check_views(vs, params, hf, {})


def test_expert_parallel_places_whole_experts_linearly() -> None:
    cfg = qwen3_moe_cfg()
    hf = hf_state("qwen3_moe", cfg)
    for r in range(2):
        params = vllm_engine(hf, cfg, r, 2, ep=True)
        for mode, source in (("fused", hf), ("per_expert", per_expert(hf))):
            vs = views("qwen3_moe", params, cfg, tp_rank=r, tp_size=2, expert_parallel=True, hf_experts=mode)
            check_views(vs, params, source, {})
        assert f"model.layers.1.mlp.experts.{2 * r}.gate_proj.weight" in views(
            "qwen3_moe", params, cfg, tp_rank=r, tp_size=2, expert_parallel=True
        )
    # 3 experts over 2 ranks: rank 0 takes experts 0 and 1, rank 1 expert 2
    odd = qwen3_moe_cfg()
    odd.num_experts = 3
    assert engine_shapes("qwen3_moe", odd, tp_rank=0, tp_size=2, expert_parallel=True)[
        "model.layers.1.mlp.experts.w13_weight"
    ] == (2, 64, 64)
    shapes = engine_shapes("qwen3_moe", odd, tp_rank=1, tp_size=2, expert_parallel=True)
    vs = views(
        "qwen3_moe",
        {n: torch.zeros(s) for n, s in shapes.items()},
        odd,
        tp_rank=1,
        tp_size=2,
        expert_parallel=True,
    )
    assert [n for n in vs if ".experts." in n and "gate_proj" in n] == [
        "model.layers.1.mlp.experts.2.gate_proj.weight"
    ]


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_megatron_views_alias_the_interleaved_layout(model: str) -> None:
    cfg = megatron_cfg()
    if model == "qwen2":  # q/k/v biases in linear_qkv.bias
        cfg = Qwen2Config(
            **{
                k: getattr(cfg, k)
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "vocab_size",
                    "tie_word_embeddings",
                )
            }
        )
    hf = hf_state(model, cfg)
    assert ("model.layers.0.self_attn.q_proj.bias" in hf) == (model == "qwen2")
    for tp in (1, 2):
        for r in range(tp):
            params = megatron_engine(hf, cfg, r, tp)
            assert engine_shapes("megatron", cfg, tp_rank=r, tp_size=tp, params=params) == {
                n: tuple(t.shape) for n, t in params.items()
            }
            vs = views("megatron", params, cfg, tp_rank=r, tp_size=tp)
            pads = {
                n: padding_rows(n, params, cfg.vocab_size, r)
                for n in ("embedding.word_embeddings.weight", "output_layer.weight")
            }
            check_views(vs, params, hf, pads)
            q = vs["model.layers.0.self_attn.q_proj.weight"]
            assert isinstance(q, list) and len(q) == 4 // tp  # one box per query group on this rank
        hf_covered("megatron", cfg, hf, tp)


def test_megatron_local_spec_norm_names() -> None:
    cfg = megatron_cfg()
    hf = hf_state("megatron", cfg)
    params = megatron_engine(hf, cfg, 0, 1)
    for i in range(cfg.num_hidden_layers):
        d = f"decoder.layers.{i}"
        params[f"{d}.input_layernorm.weight"] = params.pop(f"{d}.self_attention.linear_qkv.layer_norm_weight")
        params[f"{d}.pre_mlp_layernorm.weight"] = params.pop(f"{d}.mlp.linear_fc1.layer_norm_weight")
    wrapped = {"module." + n: t for n, t in params.items()}  # a DDP-style wrapper prefix
    vs = views("megatron", wrapped, cfg, prefix="module.")
    check_views(vs, params, hf, {"embedding.word_embeddings.weight": 28, "output_layer.weight": 28})


def test_views_of_a_module_skip_autograd_and_keep_the_memory() -> None:
    """A fused model as an nn.Module (what examples/rl_loop.py's fused rollout holds): Parameters that
    require grad, embeddings with exactly vocab_size rows (vocab_padding=1)."""
    cfg = llama_cfg()
    hf = hf_state("llama", cfg)
    params = vllm_engine(hf, cfg, 0, 1)
    params["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()  # 100 rows, unpadded
    params["lm_head.weight"] = hf["lm_head.weight"].clone()
    model = nested_module(params)
    with pytest.raises(
        LayoutError, match=r"'model.embed_tokens.weight' has shape \(100, 64\), expected \(128, 64\)"
    ):
        views("llama", model, cfg)  # vLLM's padding to 64 rows is the default
    vs = views("llama", model, cfg, vocab_padding=1)
    assert (
        vs["model.embed_tokens.weight"].data_ptr()
        == model.get_parameter("model.embed_tokens.weight").data_ptr()
    )
    check_views(vs, {n: p.detach() for n, p in model.named_parameters()}, hf, {})
    q = vs["model.layers.0.self_attn.q_proj.weight"]
    qkv = model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    # TP=1: q is the whole HF tensor, so a plain tensor view of the first 64 rows of qkv_proj
    assert isinstance(q, torch.Tensor) and not q.requires_grad and q.data_ptr() == qkv.data_ptr()
    q.fill_(3.0)  # an in-place write through the view lands in the parameter
    assert bool((qkv[:64] == 3.0).all()) and not bool((qkv[64:] == 3.0).any())
    assert views("llama", model.named_parameters(), cfg, vocab_padding=1).keys() == vs.keys()


# ---- errors --------------------------------------------------------------------------------------


def test_bad_input_is_a_clear_layout_error() -> None:
    cfg = llama_cfg()
    params = vllm_engine(hf_state("llama", cfg), cfg, 0, 2)
    with pytest.raises(LayoutError, match="unknown preset 'vllm'.*llama"):
        views("vllm", params, cfg)
    missing = dict(params)
    del missing["model.layers.1.mlp.gate_up_proj.weight"]
    with pytest.raises(LayoutError, match=r"'model.layers.1.mlp.gate_up_proj.weight' is missing.*gate_proj"):
        views("llama", missing, cfg, tp_rank=0, tp_size=2)
    wrong = dict(params)
    wrong["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(128, 64)  # the TP=1 shape on a TP=2 rank
    with pytest.raises(
        LayoutError,
        match=r"qkv_proj.weight' has shape \(128, 64\), expected \(64, 64\) on "
        r"tp_rank 0 of 2 \(it holds 'model.layers.0.self_attn.q_proj.weight'\)",
    ):
        views("llama", wrong, cfg, tp_rank=0, tp_size=2)
    with pytest.raises(
        LayoutError,
        match=r"tp_size=3 does not divide the padded vocabulary \(100 rows padded to a "
        r"multiple of 64\) = 128",
    ):
        views("llama", params, cfg, tp_rank=0, tp_size=3)
    wide = llama_cfg()
    wide.vocab_size = 192  # 3 ranks of 64 rows: now the heads are what 3 does not divide
    with pytest.raises(LayoutError, match=r"tp_size=3 does not divide num_attention_heads = 4"):
        engine_shapes("llama", wide, tp_rank=0, tp_size=3)
    with pytest.raises(LayoutError, match=r"0 <= tp_rank < tp_size.*tp_rank=2, tp_size=2"):
        views("llama", params, cfg, tp_rank=2, tp_size=2)
    odd = LlamaConfig(
        hidden_size=96,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
        vocab_size=128,
    )
    with pytest.raises(LayoutError, match=r"tp_size=2 does not divide num_key_value_heads = 3"):
        engine_shapes("llama", odd, tp_size=2)
    odd.num_key_value_heads, odd.vocab_size = 2, 192
    with pytest.raises(
        LayoutError, match=r"num_key_value_heads \(2\) neither divides nor is a multiple of tp_size=3"
    ):
        engine_shapes("llama", odd, tp_size=3)
    with pytest.raises(LayoutError, match=r"Megatron needs whole query groups"):
        engine_shapes(
            "megatron",
            LlamaConfig(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=1,
            ),
            tp_size=2,
        )
    with pytest.raises(LayoutError, match=r"config has no 'num_experts'"):
        engine_shapes(
            "qwen3_moe",
            {
                "hidden_size": 64,
                "num_attention_heads": 4,
                "vocab_size": 128,
                "intermediate_size": 96,
                "num_hidden_layers": 1,
            },
        )
    with pytest.raises(LayoutError, match="hf_experts must be one of"):
        views("qwen3_moe", params, qwen3_moe_cfg(), hf_experts="stacked")
    with pytest.raises(LayoutError, match="vocab_padding must be an int >= 1"):
        views("llama", params, cfg, vocab_padding=0)
    with pytest.raises(LayoutError, match="params must map names to tensors"):
        views("llama", 42, cfg)  # type: ignore[arg-type]
    assert set(PRESETS) >= {"llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "megatron"}


def nested_module(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An nn.Module whose named_parameters() are ``params`` (what an engine's model looks like)."""
    root = torch.nn.Module()
    for name, t in params.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t))
    return root


# ---- (b) and (c): round trips through the store ----------------------------------------------------


@pytest.fixture
def stores(etcd: Any) -> Iterator[Callable[..., Store]]:
    made: list[Store] = []

    def make(ns: str, **kw: Any) -> Store:
        s = Store(ns, endpoint=etcd.endpoint, transport="shm", **kw)
        made.append(s)
        return s

    yield make
    for s in reversed(made):
        s.close()


def fill_and_compare(
    cons: Store,
    preset: str,
    cfg: Any,
    expected: dict[str, torch.Tensor],
    r: int,
    tp: int,
    step: int,
    **kw: Any,
) -> None:
    """get_into the views of zeroed engine buffers, then compare them bitwise to ``expected``."""
    bufs = {n: torch.zeros_like(t) for n, t in expected.items()}
    ptrs = {n: t.data_ptr() for n, t in bufs.items()}
    assert cons.get_into(views(preset, bufs, cfg, tp_rank=r, tp_size=tp, **kw), step=step, timeout=30) == step
    for n, t in bufs.items():
        assert t.data_ptr() == ptrs[n], n
        assert torch.equal(bits(t), bits(expected[n])), f"{preset} tp {r}/{tp}: {n} differs"


ROUND_TRIPS = [  # (preset, config, TP sizes of the consumers, options)
    ("llama", llama_cfg, (1, 2), {}),
    ("qwen2", qwen2_cfg, (1, 2), {}),  # TP=2: the one KV head replicated on both ranks
    ("qwen3_moe", qwen3_moe_cfg, (2,), {}),
    ("qwen3_moe", qwen3_moe_cfg, (2,), {"hf_experts": "fused"}),  # two boxes of gate_up_proj per rank
    ("qwen3_moe", qwen3_moe_cfg, (2,), {"expert_parallel": True}),
    ("deepseek_v3", dsv3_cfg, (1, 2), {}),
]


@pytest.mark.parametrize(
    "preset,make_cfg,tps,kw", ROUND_TRIPS, ids=[f"{c[0]}-{'-'.join(c[3]) or 'tp'}" for c in ROUND_TRIPS]
)
def test_hf_publisher_fills_fused_engine_buffers(
    stores: Callable[..., Store],
    preset: str,
    make_cfg: Callable[[], Any],
    tps: tuple[int, ...],
    kw: dict[str, Any],
) -> None:
    cfg = make_cfg()
    hf = hf_state(preset, cfg)
    published = hf if kw.get("hf_experts") == "fused" else per_expert(hf)
    ns = "preset-" + uuid.uuid4().hex[:10]
    pub = stores(ns)
    assert pub.put(1, published)
    for tp in tps:
        for r in range(tp):  # each engine rank is its own consumer
            expected = vllm_engine(hf, cfg, r, tp, ep=bool(kw.get("expert_parallel")))
            fill_and_compare(stores(ns), preset, cfg, expected, r, tp, 1, **kw)


def test_megatron_publisher_to_hf_and_vllm_consumers(stores: Callable[..., Store]) -> None:
    """(c) A Megatron TP=2 trainer publishes HF names from its interleaved parameters (several boxes
    per name and rank); an HF model and a vLLM-layout TP=2 engine pull them."""
    cfg = megatron_cfg()
    hf = hf_state("megatron", cfg)
    ns = "mcore-" + uuid.uuid4().hex[:10]
    session = uuid.uuid4().hex[:8]
    ranks = [stores(ns, rank=r, world_size=2, session_id=session) for r in range(2)]
    trainer = [megatron_engine(hf, cfg, r, 2) for r in range(2)]
    done = [ranks[r].put(1, views("megatron", trainer[r], cfg, tp_rank=r, tp_size=2)) for r in range(2)]
    assert done == [False, True]
    cons = stores(ns)
    model = {n: torch.zeros_like(t) for n, t in hf.items()}
    assert cons.get_into(model, timeout=30) == 1
    for n, t in model.items():
        assert torch.equal(bits(t), bits(hf[n])), n
    for r in range(2):  # a vLLM-layout TP=2 engine: fused on both sides, HF names in between
        fill_and_compare(stores(ns), "llama", cfg, vllm_engine(hf, cfg, r, 2), r, 2, 1)


def test_hf_publisher_to_megatron_consumer(stores: Callable[..., Store]) -> None:
    """(c) HF names into Megatron TP=2 ranks' interleaved linear_qkv (and TP=1)."""
    cfg = megatron_cfg()
    hf = hf_state("megatron", cfg, seed=1)
    ns = "tomcore-" + uuid.uuid4().hex[:10]
    assert stores(ns).put(1, hf)
    for tp in (1, 2):
        for r in range(tp):
            fill_and_compare(stores(ns), "megatron", cfg, megatron_engine(hf, cfg, r, tp), r, tp, 1)

"""The per-model presets: each maps one model family's HF names onto its engine's fused parameters,
built from the blocks of :mod:`._blocks`. :data:`PRESETS` names them; docs/presets.md describes each.
"""

from __future__ import annotations

from collections.abc import Callable

from astate_store.integrations.presets._blocks import (
    MEGATRON_VOCAB_DIVISIBLE_BY,
    VLLM_VOCAB_PADDING,
    Config,
    Plan,
    column,
    experts,
    megatron_qkv,
    merged,
    qkv,
    replicated,
    row,
    vocab,
)

# --------------------------------------------------------------------------------------------------
# presets from HF names


def _embeddings(
    plan: Plan, cfg: Config, embed: str, norm: str, lm_head: str, hf_prefix: str = "model."
) -> None:
    v, h = cfg.num("vocab_size"), cfg.num("hidden_size")
    multiple = plan.vocab_padding or VLLM_VOCAB_PADDING
    vocab(plan, f"{hf_prefix}embed_tokens.weight", embed, v, h, multiple)
    replicated(plan, f"{hf_prefix}norm.weight", norm, (h,))
    if not cfg.get("tie_word_embeddings", False):  # tied: the engine shares the embedding, no lm_head
        vocab(plan, "lm_head.weight", lm_head, v, h, multiple)


def _dense_mlp(plan: Plan, hf: str, engine: str, inter: int, hidden: int, bias: bool = False) -> None:
    """``mlp.gate_proj`` / ``up_proj`` / ``down_proj`` into ``gate_up_proj`` + ``down_proj``."""
    merged(
        plan,
        f"{engine}.gate_up_proj.weight",
        [(f"{hf}.gate_proj.weight", inter), (f"{hf}.up_proj.weight", inter)],
        (hidden,),
    )
    row(plan, f"{hf}.down_proj.weight", f"{engine}.down_proj.weight", (hidden, inter))
    if bias:
        merged(
            plan,
            f"{engine}.gate_up_proj.bias",
            [(f"{hf}.gate_proj.bias", inter), (f"{hf}.up_proj.bias", inter)],
            (),
        )
        replicated(plan, f"{hf}.down_proj.bias", f"{engine}.down_proj.bias", (hidden,))


def _attention(
    plan: Plan, cfg: Config, p: str, *, qkv_bias: bool, o_bias: bool = False, qk_norm: bool = False
) -> None:
    """Llama-family attention in vLLM: ``q/k/v_proj`` into ``qkv_proj``, ``o_proj`` row-parallel."""
    h, heads, kvh, hd = cfg.num("hidden_size"), cfg.num("num_attention_heads"), cfg.kv_heads(), cfg.head_dim()
    a = f"{p}.self_attn"
    qkv(
        plan,
        f"{a}.qkv_proj.weight",
        f"{a}.q_proj.weight",
        f"{a}.k_proj.weight",
        f"{a}.v_proj.weight",
        heads,
        kvh,
        hd,
        (h,),
    )
    if qkv_bias:
        qkv(
            plan,
            f"{a}.qkv_proj.bias",
            f"{a}.q_proj.bias",
            f"{a}.k_proj.bias",
            f"{a}.v_proj.bias",
            heads,
            kvh,
            hd,
            (),
        )
    row(plan, f"{a}.o_proj.weight", f"{a}.o_proj.weight", (h, heads * hd))
    if o_bias:
        replicated(plan, f"{a}.o_proj.bias", f"{a}.o_proj.bias", (h,))
    if qk_norm:
        replicated(plan, f"{a}.q_norm.weight", f"{a}.q_norm.weight", (hd,))
        replicated(plan, f"{a}.k_norm.weight", f"{a}.k_norm.weight", (hd,))


def _norms(plan: Plan, p: str, hidden: int) -> None:
    replicated(plan, f"{p}.input_layernorm.weight", f"{p}.input_layernorm.weight", (hidden,))
    replicated(
        plan, f"{p}.post_attention_layernorm.weight", f"{p}.post_attention_layernorm.weight", (hidden,)
    )


def _llama_like(
    plan: Plan, cfg: Config, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool
) -> None:
    h, inter = cfg.num("hidden_size"), cfg.num("intermediate_size")
    _embeddings(plan, cfg, "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    for i in range(cfg.num("num_hidden_layers")):
        p = f"model.layers.{i}"
        _attention(plan, cfg, p, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        _dense_mlp(plan, f"{p}.mlp", f"{p}.mlp", inter, h, bias=mlp_bias)
        _norms(plan, p, h)


def _llama(plan: Plan, cfg: Config) -> None:
    bias = bool(cfg.get("attention_bias", False))
    _llama_like(
        plan, cfg, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=False
    )


def _qwen2(plan: Plan, cfg: Config) -> None:
    _llama_like(plan, cfg, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)


def _qwen3(plan: Plan, cfg: Config) -> None:
    bias = bool(cfg.get("attention_bias", False))
    _llama_like(plan, cfg, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)


def _expert_params(plan: Plan, experts: str) -> tuple[str, str]:
    """The FusedMoE ``w13`` / ``w2`` names the engine uses: vLLM >= 0.32 holds them in a ``routed_experts``
    child (``mlp.experts.routed_experts.w13_weight``), older engines on the layer itself."""
    for base in (experts, f"{experts}.routed_experts"):
        if f"{base}.w13_weight" in plan.names:
            return f"{base}.w13_weight", f"{base}.w2_weight"
    return f"{experts}.w13_weight", f"{experts}.w2_weight"


def _qwen3_moe(plan: Plan, cfg: Config) -> None:
    h = cfg.num("hidden_size")
    num_experts, step = cfg.num("num_experts"), max(cfg.num("decoder_sparse_step", 1), 1)
    dense_only = set(cfg.get("mlp_only_layers", []) or [])
    bias = bool(cfg.get("attention_bias", False))
    _embeddings(plan, cfg, "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    for i in range(cfg.num("num_hidden_layers")):
        p = f"model.layers.{i}"
        _attention(plan, cfg, p, qkv_bias=bias, o_bias=bias, qk_norm=True)
        if i not in dense_only and num_experts > 0 and (i + 1) % step == 0:  # Qwen3MoeDecoderLayer's rule
            replicated(plan, f"{p}.mlp.gate.weight", f"{p}.mlp.gate.weight", (num_experts, h))
            e = _expert_params(plan, f"{p}.mlp.experts")
            experts(plan, f"{p}.mlp.experts", *e, num_experts, cfg.num("moe_intermediate_size"), h)
        else:
            _dense_mlp(plan, f"{p}.mlp", f"{p}.mlp", cfg.num("intermediate_size"), h)
        _norms(plan, p, h)


def _deepseek_v3(plan: Plan, cfg: Config) -> None:
    h, heads = cfg.num("hidden_size"), cfg.num("num_attention_heads")
    q_lora = cfg.get("q_lora_rank", None)
    kv_lora, nope, rope, vd = (
        cfg.num("kv_lora_rank"),
        cfg.num("qk_nope_head_dim"),
        cfg.num("qk_rope_head_dim"),
        cfg.num("v_head_dim"),
    )
    n_routed = cfg.num("n_routed_experts", 0)
    first_dense, freq = cfg.num("first_k_dense_replace", 0), max(cfg.num("moe_layer_freq", 1), 1)
    shared = cfg.num("n_shared_experts", 0)
    moe_inter = cfg.num("moe_intermediate_size", 0)
    _embeddings(plan, cfg, "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    for i in range(cfg.num("num_hidden_layers")):  # MTP layers (index >= num_hidden_layers) are not mapped
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        if q_lora is not None:
            merged(
                plan,
                f"{a}.fused_qkv_a_proj.weight",
                [(f"{a}.q_a_proj.weight", q_lora), (f"{a}.kv_a_proj_with_mqa.weight", kv_lora + rope)],
                (h,),
                tp=False,
            )
            replicated(plan, f"{a}.q_a_layernorm.weight", f"{a}.q_a_layernorm.weight", (q_lora,))
            column(plan, f"{a}.q_b_proj.weight", f"{a}.q_b_proj.weight", (heads * (nope + rope), q_lora))
        else:
            column(plan, f"{a}.q_proj.weight", f"{a}.q_proj.weight", (heads * (nope + rope), h))
            replicated(
                plan, f"{a}.kv_a_proj_with_mqa.weight", f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)
            )
        replicated(plan, f"{a}.kv_a_layernorm.weight", f"{a}.kv_a_layernorm.weight", (kv_lora,))
        column(plan, f"{a}.kv_b_proj.weight", f"{a}.kv_b_proj.weight", (heads * (nope + vd), kv_lora))
        row(plan, f"{a}.o_proj.weight", f"{a}.o_proj.weight", (h, heads * vd))
        if n_routed and i >= first_dense and i % freq == 0:  # DeepseekV2DecoderLayer's rule
            replicated(plan, f"{p}.mlp.gate.weight", f"{p}.mlp.gate.weight", (n_routed, h))
            # V3 routes with a score-correction bias ("noaux_tc"); hub configs say so, transformers' own
            # DeepseekV3Config has no topk_method field
            default = "noaux_tc" if cfg.get("model_type", "") == "deepseek_v3" else ""
            if cfg.get("topk_method", default) == "noaux_tc":
                replicated(
                    plan,
                    f"{p}.mlp.gate.e_score_correction_bias",
                    f"{p}.mlp.gate.e_score_correction_bias",
                    (n_routed,),
                )
            if shared:
                _dense_mlp(plan, f"{p}.mlp.shared_experts", f"{p}.mlp.shared_experts", moe_inter * shared, h)
            experts(
                plan, f"{p}.mlp.experts", *_expert_params(plan, f"{p}.mlp.experts"), n_routed, moe_inter, h
            )
        else:
            _dense_mlp(plan, f"{p}.mlp", f"{p}.mlp", cfg.num("intermediate_size"), h)
        _norms(plan, p, h)


def _megatron(plan: Plan, cfg: Config) -> None:
    """Megatron-core GPTModel (Llama / Qwen2 family) with the Transformer Engine layer spec (norms
    fused into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``) or the local spec
    (``input_layernorm`` / ``pre_mlp_layernorm``), picked from the parameters given."""
    h, heads, groups, hd = (
        cfg.num("hidden_size"),
        cfg.num("num_attention_heads"),
        cfg.kv_heads(),
        cfg.head_dim(),
    )
    inter = cfg.num("intermediate_size")
    bias = bool(cfg.get("attention_bias", cfg.get("model_type", "") == "qwen2"))
    multiple = (
        plan.vocab_padding or cfg.num("make_vocab_size_divisible_by", MEGATRON_VOCAB_DIVISIBLE_BY)
    ) * plan.par.size
    v = cfg.num("vocab_size")
    vocab(plan, "model.embed_tokens.weight", "embedding.word_embeddings.weight", v, h, multiple)
    replicated(plan, "model.norm.weight", "decoder.final_layernorm.weight", (h,))
    if not cfg.get("tie_word_embeddings", False):
        vocab(plan, "lm_head.weight", "output_layer.weight", v, h, multiple)
    for i in range(cfg.num("num_hidden_layers")):
        hf, d = f"model.layers.{i}", f"decoder.layers.{i}"
        sa = f"{d}.self_attention"
        megatron_qkv(
            plan,
            f"{sa}.linear_qkv.weight",
            f"{hf}.self_attn.q_proj.weight",
            f"{hf}.self_attn.k_proj.weight",
            f"{hf}.self_attn.v_proj.weight",
            heads,
            groups,
            hd,
            (h,),
        )
        if bias:
            megatron_qkv(
                plan,
                f"{sa}.linear_qkv.bias",
                f"{hf}.self_attn.q_proj.bias",
                f"{hf}.self_attn.k_proj.bias",
                f"{hf}.self_attn.v_proj.bias",
                heads,
                groups,
                hd,
                (),
            )
        row(plan, f"{hf}.self_attn.o_proj.weight", f"{sa}.linear_proj.weight", (h, heads * hd))
        merged(
            plan,
            f"{d}.mlp.linear_fc1.weight",
            [(f"{hf}.mlp.gate_proj.weight", inter), (f"{hf}.mlp.up_proj.weight", inter)],
            (h,),
        )
        row(plan, f"{hf}.mlp.down_proj.weight", f"{d}.mlp.linear_fc2.weight", (h, inter))
        replicated(
            plan,
            f"{hf}.input_layernorm.weight",
            plan.pick(f"{sa}.linear_qkv.layer_norm_weight", f"{d}.input_layernorm.weight"),
            (h,),
        )
        replicated(
            plan,
            f"{hf}.post_attention_layernorm.weight",
            plan.pick(f"{d}.mlp.linear_fc1.layer_norm_weight", f"{d}.pre_mlp_layernorm.weight"),
            (h,),
        )


# preset name -> builder; docs/presets.md describes each
PRESETS: dict[str, Callable[[Plan, Config], None]] = {
    "llama": _llama,  # vLLM LlamaForCausalLM (also Mistral); SGLang uses the same names
    "qwen2": _qwen2,  # vLLM Qwen2ForCausalLM: qkv biases
    "qwen3": _qwen3,  # vLLM Qwen3ForCausalLM: q_norm / k_norm
    "qwen3_moe": _qwen3_moe,  # vLLM Qwen3MoeForCausalLM: FusedMoE experts
    "deepseek_v3": _deepseek_v3,  # vLLM DeepseekV3ForCausalLM (and V2): MLA, shared + routed experts
    "megatron": _megatron,  # Megatron-core GPTModel: interleaved linear_qkv, [gate | up] linear_fc1
}


# --------------------------------------------------------------------------------------------------
# the API

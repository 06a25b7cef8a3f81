"""Presets: Hugging Face tensor names as views into an engine's fused, tensor-parallel parameters.

An inference engine (vLLM, SGLang) or a Megatron trainer does not hold ``q_proj``, ``k_proj`` and
``v_proj``: it holds one ``qkv_proj`` per tensor-parallel rank, one ``gate_up_proj``, experts
stacked into ``w13`` / ``w2``, an interleaved Megatron ``linear_qkv``. :func:`views` maps every HF
name (what trainers publish) to the boxes of the HF tensor that live in this rank's parameters, as
:class:`~astate_store.model.layout.Shard` views of those parameters, so that

    store.get_into(views("qwen2", dict(model.named_parameters()), config, tp_rank=r, tp_size=tp))

writes the bytes straight into the fused parameters (no conversion copy), and

    store.put(step, views("megatron", trainer_params, config, tp_rank=r, tp_size=tp))

publishes HF names from fused memory. The same map serves both directions.

Pure: no etcd, no transport. Each layout follows the engine's own convention; docs/presets.md
says where in the engine's source each convention is defined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from astate_store.errors import LayoutError
from astate_store.model.layout import Shard

__all__ = ["View", "PRESETS", "views", "engine_shapes", "ParamsLike"]

log = logging.getLogger("astate_store.integrations.presets")

View = Union[torch.Tensor, Shard, list[Shard]]
ParamsLike = Union[Mapping[str, torch.Tensor], torch.nn.Module, Iterable[tuple[str, torch.Tensor]]]

# vLLM pads embedding and LM-head rows to a multiple of 64 before splitting them over TP ranks
# (vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE); Megatron to a multiple of
# make_vocab_size_divisible_by (128) times the TP size (megatron/training/tokenizer/tokenizer.py,
# _vocab_size_with_padding).
VLLM_VOCAB_PADDING = 64
MEGATRON_VOCAB_DIVISIBLE_BY = 128


# --------------------------------------------------------------------------------------------------
# config and parallel settings


class _Config:
    """Read HF config fields from a ``PretrainedConfig``, any object with attributes, or a dict."""

    def __init__(self, preset: str, config: Any):
        self.preset, self.raw = preset, config

    def get(self, name: str, default: Any = ...) -> Any:
        raw = self.raw
        value = raw.get(name, None) if isinstance(raw, Mapping) else getattr(raw, name, None)
        if value is None:
            if default is ...:
                raise LayoutError(f"preset {self.preset!r}: config has no {name!r}")
            return default
        return value

    def num(self, name: str, default: Any = ...) -> int:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise LayoutError(f"preset {self.preset!r}: config {name}={value!r} is not a non-negative int")
        return value

    def head_dim(self) -> int:
        heads = self.num("num_attention_heads")
        return self.num("head_dim", self.num("hidden_size") // max(heads, 1))

    def kv_heads(self) -> int:
        return self.num("num_key_value_heads", self.num("num_attention_heads"))


@dataclass(frozen=True)
class _Parallel:
    rank: int
    size: int
    expert_parallel: bool  # routed experts split over the TP ranks whole, not TP-split within

    def split(self, n: int, what: str, preset: str) -> int:
        """``n / size``, which the engine requires to be exact."""
        if n % self.size:
            raise LayoutError(f"preset {preset!r}: tp_size={self.size} does not divide {what} = {n}")
        return n // self.size


# --------------------------------------------------------------------------------------------------
# the plan: which box of which HF tensor sits where in which engine parameter


@dataclass(frozen=True)
class _Piece:
    """Box ``[hf_offsets, hf_offsets + sizes)`` of HF tensor ``hf`` (global shape ``hf_shape``) is the
    engine parameter ``engine``, indexed at ``select`` on dim 0 when set, then narrowed to
    ``narrow = (dim, start, length)`` when set."""

    hf: str
    hf_shape: tuple[int, ...]
    hf_offsets: tuple[int, ...]
    engine: str
    select: int | None = None
    narrow: tuple[int, int, int] | None = None


@dataclass
class _Plan:
    preset: str
    par: _Parallel
    names: Collection[str]  # the engine parameters the caller has (presets may pick spellings)
    hf_experts: str = "per_expert"  # HF names of routed experts: "per_expert" or "fused" (transformers >= 5)
    vocab_padding: int | None = (
        None  # rows of embeddings / LM head padded to a multiple of this (None: engine's)
    )
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pieces: list[_Piece] = field(default_factory=list)

    def engine(self, name: str, shape: Sequence[int]) -> None:
        shape = tuple(int(s) for s in shape)
        old = self.shapes.setdefault(name, shape)
        if old != shape:  # a preset bug, not user input
            raise AssertionError(f"{name}: planned as {old} and {shape}")

    def add(
        self,
        hf: str,
        hf_shape: Sequence[int],
        hf_offsets: Sequence[int],
        engine: str,
        *,
        select: int | None = None,
        narrow: tuple[int, int, int] | None = None,
    ) -> None:
        self.pieces.append(_Piece(hf, tuple(hf_shape), tuple(hf_offsets), engine, select, narrow))

    def split(self, n: int, what: str) -> int:
        return self.par.split(n, what, self.preset)

    def pick(self, *candidates: str) -> str:
        """The first spelling the caller's parameters use (else the first, for the error message)."""
        return next((c for c in candidates if c in self.names), candidates[0])


# --------------------------------------------------------------------------------------------------
# layouts, each as the engine defines it (docs/presets.md names the source)


def replicated(plan: _Plan, hf: str, engine: str, shape: Sequence[int]) -> None:
    """Every rank holds the whole tensor (norms, routers, ReplicatedLinear)."""
    plan.engine(engine, shape)
    plan.add(hf, shape, (0,) * len(shape), engine)


def column(plan: _Plan, hf: str, engine: str, shape: Sequence[int]) -> None:
    """ColumnParallelLinear: rank r holds rows ``[r * n, (r + 1) * n)`` (weights and biases)."""
    merged(plan, engine, [(hf, shape[0])], tuple(shape[1:]))


def row(plan: _Plan, hf: str, engine: str, shape: Sequence[int]) -> None:
    """RowParallelLinear weight: rank r holds input columns ``[r * n, (r + 1) * n)``."""
    out, inp = shape
    n = plan.split(inp, f"{hf} input dim")
    plan.engine(engine, (out, n))
    plan.add(hf, shape, (0, plan.par.rank * n), engine)


def merged(
    plan: _Plan, engine: str, parts: Sequence[tuple[str, int]], trailing: tuple[int, ...], *, tp: bool = True
) -> None:
    """MergedColumnParallelLinear: each part split over the TP ranks, rank r's slices stacked in
    order: ``[gate_r | up_r]``; with ``tp=False`` (``disable_tp``) the whole parts stacked."""
    at = 0
    rank = plan.par.rank if tp else 0
    for hf, rows in parts:
        n = plan.split(rows, f"{hf} rows") if tp else rows
        plan.add(hf, (rows, *trailing), (rank * n,) + (0,) * len(trailing), engine, narrow=(0, at, n))
        at += n
    plan.engine(engine, (at, *trailing))


def qkv(
    plan: _Plan,
    engine: str,
    q: str,
    k: str,
    v: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    trailing: tuple[int, ...],
) -> None:
    """vLLM QKVParallelLinear: rank r holds ``[q heads of r | k heads of r | v heads of r]``. With
    fewer KV heads than ranks each KV head is replicated on ``tp / kv_heads`` ranks: rank r's k and v
    slots hold head ``r * kv_heads // tp``."""
    par = plan.par
    q_local = plan.split(heads, "num_attention_heads")
    if kv_heads >= par.size:
        kv_local = plan.split(kv_heads, "num_key_value_heads")
        kv_first = par.rank * kv_local
    else:
        if kv_heads == 0 or par.size % kv_heads:
            raise LayoutError(
                f"preset {plan.preset!r}: num_key_value_heads ({kv_heads}) neither divides "
                f"nor is a multiple of tp_size={par.size}"
            )
        kv_local, kv_first = 1, par.rank * kv_heads // par.size
    zeros = (0,) * len(trailing)
    qn, kvn = q_local * head_dim, kv_local * head_dim
    plan.add(q, (heads * head_dim, *trailing), (par.rank * qn, *zeros), engine, narrow=(0, 0, qn))
    plan.add(k, (kv_heads * head_dim, *trailing), (kv_first * head_dim, *zeros), engine, narrow=(0, qn, kvn))
    plan.add(
        v, (kv_heads * head_dim, *trailing), (kv_first * head_dim, *zeros), engine, narrow=(0, qn + kvn, kvn)
    )
    plan.engine(engine, (qn + 2 * kvn, *trailing))


def megatron_qkv(
    plan: _Plan,
    engine: str,
    q: str,
    k: str,
    v: str,
    heads: int,
    groups: int,
    head_dim: int,
    trailing: tuple[int, ...],
) -> None:
    """Megatron-core ``linear_qkv``: per query group ``[q heads of the group | k | v]``, groups in
    order, rank r holding groups ``[r * g, (r + 1) * g)``. One box per group and name."""
    if groups == 0 or heads % groups:
        raise LayoutError(
            f"preset {plan.preset!r}: num_key_value_heads ({groups}) does not divide "
            f"num_attention_heads ({heads})"
        )
    local = plan.split(groups, "num_key_value_heads (Megatron needs whole query groups per rank)")
    per = heads // groups
    zeros = (0,) * len(trailing)
    block = (per + 2) * head_dim
    for j in range(local):
        g = plan.par.rank * local + j
        at = j * block
        plan.add(
            q,
            (heads * head_dim, *trailing),
            (g * per * head_dim, *zeros),
            engine,
            narrow=(0, at, per * head_dim),
        )
        plan.add(
            k,
            (groups * head_dim, *trailing),
            (g * head_dim, *zeros),
            engine,
            narrow=(0, at + per * head_dim, head_dim),
        )
        plan.add(
            v,
            (groups * head_dim, *trailing),
            (g * head_dim, *zeros),
            engine,
            narrow=(0, at + (per + 1) * head_dim, head_dim),
        )
    plan.engine(engine, (local * block, *trailing))


def vocab(plan: _Plan, hf: str, engine: str, vocab_size: int, hidden: int, multiple: int) -> None:
    """VocabParallelEmbedding / ParallelLMHead: rows padded to ``multiple``, then split evenly;
    rank r's first rows are the real vocabulary rows it holds, the padding rows are not mapped."""
    padded = -(-vocab_size // multiple) * multiple
    per = plan.split(padded, f"the padded vocabulary ({vocab_size} rows padded to a multiple of {multiple})")
    start = plan.par.rank * per
    real = max(0, min(per, vocab_size - start))
    plan.engine(engine, (per, hidden))
    if real:
        plan.add(hf, (vocab_size, hidden), (start, 0), engine, narrow=(0, 0, real))


def _expert_split(plan: _Plan, num_experts: int, inter: int) -> tuple[int, int, int, int]:
    """(local expert count, first global expert, local intermediate size, TP rank within an expert)."""
    par = plan.par
    if par.expert_parallel:  # whole experts, linearly placed: the first E % tp ranks take one more
        base, extra = divmod(num_experts, par.size)
        return base + (par.rank < extra), par.rank * base + min(par.rank, extra), inter, 0
    return num_experts, 0, plan.split(inter, "moe intermediate size"), par.rank


def experts(plan: _Plan, hf: str, w13: str, w2: str, num_experts: int, inter: int, hidden: int) -> None:
    """FusedMoE: ``w13`` [E_local, 2 I/tp, H] = per expert ``[gate_r | up_r]``, ``w2`` [E_local, H, I/tp]
    = rank r's input columns of ``down``. With expert parallelism the ranks hold whole experts.

    ``hf`` is the HF module prefix (``model.layers.3.mlp.experts``); the HF names are the per-expert
    checkpoint names (``{hf}.{e}.gate_proj.weight``), or with ``hf_experts="fused"`` the fused 3-D
    parameters of transformers >= 5 (``{hf}.gate_up_proj`` [E, 2 I, H] = ``[gate | up]`` on dim 1,
    ``{hf}.down_proj`` [E, H, I])."""
    count, first, n, tp_rank = _expert_split(plan, num_experts, inter)
    plan.engine(w13, (count, 2 * n, hidden))
    plan.engine(w2, (count, hidden, n))
    if plan.hf_experts == "fused":
        if count == 0:
            return
        gate_up, down = (num_experts, 2 * inter, hidden), (num_experts, hidden, inter)
        if n == inter:  # whole experts: this rank's w13 block is one box of gate_up_proj
            plan.add(f"{hf}.gate_up_proj", gate_up, (first, 0, 0), w13)
        else:
            plan.add(f"{hf}.gate_up_proj", gate_up, (first, tp_rank * n, 0), w13, narrow=(1, 0, n))
            plan.add(f"{hf}.gate_up_proj", gate_up, (first, inter + tp_rank * n, 0), w13, narrow=(1, n, n))
        plan.add(f"{hf}.down_proj", down, (first, 0, tp_rank * n), w2)
        return
    for e in range(count):
        name = f"{hf}.{first + e}"
        plan.add(
            f"{name}.gate_proj.weight", (inter, hidden), (tp_rank * n, 0), w13, select=e, narrow=(0, 0, n)
        )
        plan.add(f"{name}.up_proj.weight", (inter, hidden), (tp_rank * n, 0), w13, select=e, narrow=(0, n, n))
        plan.add(f"{name}.down_proj.weight", (hidden, inter), (0, tp_rank * n), w2, select=e)


# --------------------------------------------------------------------------------------------------
# presets from HF names


def _embeddings(
    plan: _Plan, cfg: _Config, embed: str, norm: str, lm_head: str, hf_prefix: str = "model."
) -> None:
    v, h = cfg.num("vocab_size"), cfg.num("hidden_size")
    multiple = plan.vocab_padding or VLLM_VOCAB_PADDING
    vocab(plan, f"{hf_prefix}embed_tokens.weight", embed, v, h, multiple)
    replicated(plan, f"{hf_prefix}norm.weight", norm, (h,))
    if not cfg.get("tie_word_embeddings", False):  # tied: the engine shares the embedding, no lm_head
        vocab(plan, "lm_head.weight", lm_head, v, h, multiple)


def _dense_mlp(plan: _Plan, hf: str, engine: str, inter: int, hidden: int, bias: bool = False) -> None:
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
    plan: _Plan, cfg: _Config, p: str, *, qkv_bias: bool, o_bias: bool = False, qk_norm: bool = False
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


def _norms(plan: _Plan, p: str, hidden: int) -> None:
    replicated(plan, f"{p}.input_layernorm.weight", f"{p}.input_layernorm.weight", (hidden,))
    replicated(
        plan, f"{p}.post_attention_layernorm.weight", f"{p}.post_attention_layernorm.weight", (hidden,)
    )


def _llama_like(
    plan: _Plan, cfg: _Config, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool
) -> None:
    h, inter = cfg.num("hidden_size"), cfg.num("intermediate_size")
    _embeddings(plan, cfg, "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    for i in range(cfg.num("num_hidden_layers")):
        p = f"model.layers.{i}"
        _attention(plan, cfg, p, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        _dense_mlp(plan, f"{p}.mlp", f"{p}.mlp", inter, h, bias=mlp_bias)
        _norms(plan, p, h)


def _llama(plan: _Plan, cfg: _Config) -> None:
    bias = bool(cfg.get("attention_bias", False))
    _llama_like(
        plan, cfg, qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=False
    )


def _qwen2(plan: _Plan, cfg: _Config) -> None:
    _llama_like(plan, cfg, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)


def _qwen3(plan: _Plan, cfg: _Config) -> None:
    bias = bool(cfg.get("attention_bias", False))
    _llama_like(plan, cfg, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)


def _expert_params(plan: _Plan, experts: str) -> tuple[str, str]:
    """The FusedMoE ``w13`` / ``w2`` names the engine uses: vLLM >= 0.32 holds them in a ``routed_experts``
    child (``mlp.experts.routed_experts.w13_weight``), older engines on the layer itself."""
    for base in (experts, f"{experts}.routed_experts"):
        if f"{base}.w13_weight" in plan.names:
            return f"{base}.w13_weight", f"{base}.w2_weight"
    return f"{experts}.w13_weight", f"{experts}.w2_weight"


def _qwen3_moe(plan: _Plan, cfg: _Config) -> None:
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


def _deepseek_v3(plan: _Plan, cfg: _Config) -> None:
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


def _megatron(plan: _Plan, cfg: _Config) -> None:
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
PRESETS: dict[str, Callable[[_Plan, _Config], None]] = {
    "llama": _llama,  # vLLM LlamaForCausalLM (also Mistral); SGLang uses the same names
    "qwen2": _qwen2,  # vLLM Qwen2ForCausalLM: qkv biases
    "qwen3": _qwen3,  # vLLM Qwen3ForCausalLM: q_norm / k_norm
    "qwen3_moe": _qwen3_moe,  # vLLM Qwen3MoeForCausalLM: FusedMoE experts
    "deepseek_v3": _deepseek_v3,  # vLLM DeepseekV3ForCausalLM (and V2): MLA, shared + routed experts
    "megatron": _megatron,  # Megatron-core GPTModel: interleaved linear_qkv, [gate | up] linear_fc1
}


# --------------------------------------------------------------------------------------------------
# the API


_HF_EXPERTS = ("per_expert", "fused")


def _plan(
    preset: str,
    config: Any,
    names: Collection[str],
    tp_rank: int,
    tp_size: int,
    expert_parallel: bool,
    hf_experts: str,
    vocab_padding: int | None,
) -> _Plan:
    build = PRESETS.get(preset)
    if build is None:
        raise LayoutError(f"unknown preset {preset!r}; presets: {', '.join(sorted(PRESETS))}")
    for what, value in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"preset {preset!r}: {what} must be an int, got {value!r}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise LayoutError(
            f"preset {preset!r}: need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}"
        )
    if hf_experts not in _HF_EXPERTS:
        raise LayoutError(f"preset {preset!r}: hf_experts must be one of {_HF_EXPERTS}, got {hf_experts!r}")
    if vocab_padding is not None and (
        isinstance(vocab_padding, bool) or not isinstance(vocab_padding, int) or vocab_padding < 1
    ):
        raise LayoutError(
            f"preset {preset!r}: vocab_padding must be an int >= 1 or None, got {vocab_padding!r}"
        )
    plan = _Plan(preset, _Parallel(tp_rank, tp_size, bool(expert_parallel)), names, hf_experts, vocab_padding)
    build(plan, _Config(preset, config))
    return plan


def engine_shapes(
    preset: str,
    config: Any,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_parallel: bool = False,
    hf_experts: str = "per_expert",
    vocab_padding: int | None = None,
    params: Collection[str] = (),
) -> dict[str, tuple[int, ...]]:
    """The local shape of every engine parameter the preset maps, on this rank.

    ``params`` (names only) picks between spellings where a preset accepts several (Megatron's
    Transformer Engine or local norm names). Raises ``LayoutError`` as :func:`views` does.
    """
    return dict(
        _plan(preset, config, params, tp_rank, tp_size, expert_parallel, hf_experts, vocab_padding).shapes
    )


def _as_mapping(params: ParamsLike) -> Mapping[str, torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        return dict(params.named_parameters(remove_duplicate=False))
    if isinstance(params, Mapping):
        return params
    try:
        return dict(params)
    except (TypeError, ValueError):
        raise LayoutError(
            f"params must map names to tensors (a dict, a state_dict, named_parameters() or an "
            f"nn.Module), got {type(params).__name__}"
        ) from None


def _view(piece: _Piece, param: torch.Tensor) -> torch.Tensor:
    t = param
    if piece.select is not None:
        t = t.select(0, piece.select)
    if piece.narrow is not None:
        t = t.narrow(*piece.narrow)
    return t


def views(
    preset: str,
    params: ParamsLike,
    config: Any,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_parallel: bool = False,
    hf_experts: str = "per_expert",
    vocab_padding: int | None = None,
    prefix: str = "",
) -> dict[str, View]:
    """HF tensor names mapped to views into this rank's engine parameters.

    Args:
        preset: one of :data:`PRESETS` (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``,
            ``megatron``).
        params: the engine's parameters by engine name: ``dict(model.named_parameters())``, a
            ``state_dict()``, ``named_parameters()`` itself, or the ``nn.Module``. Only the names the
            preset maps are read; other entries are ignored.
        config: the model's HF config (``PretrainedConfig``, any object with its attributes, or a dict).
        tp_rank, tp_size: this rank's tensor-parallel position (1 rank: the whole fused tensors).
        expert_parallel: routed experts split whole over the TP ranks (vLLM
            ``--enable-expert-parallel`` with data parallel 1) instead of TP-split within each expert.
        hf_experts: the HF names of routed experts: ``"per_expert"`` (checkpoint names,
            ``...mlp.experts.{e}.gate_proj.weight``: safetensors on the Hub, transformers < 5, Megatron
            converters) or ``"fused"`` (transformers >= 5 models' own parameters,
            ``...mlp.experts.gate_up_proj`` [E, 2 I, H] and ``...mlp.experts.down_proj`` [E, H, I]).
        vocab_padding: embedding and LM-head rows are padded to a multiple of this before the TP split
            (``None``: the engine's own rule: 64 for the vLLM / SGLang presets, Megatron's
            ``make_vocab_size_divisible_by`` (config field, default 128) times ``tp_size``); pass 1 for
            a model whose embedding has exactly ``vocab_size`` rows.
        prefix: prepended to every engine name when looking it up (``"module."`` for a DDP wrapper).

    Returns:
        ``{hf_name: view}``: a tensor when the view is the whole HF tensor, a :class:`Shard` for one box
        of it, a ``list[Shard]`` for several boxes (Megatron's interleaved QKV with several query
        groups per rank; fused HF experts split over TP ranks). Views share the parameters' memory
        (``data_ptr`` inside the parameter, no copy); pass the dict to ``get_into`` (fill the engine)
        or ``put`` (publish HF names). HF tensors this rank holds nothing of (padding-only
        vocabulary ranks) are absent.

    Raises:
        LayoutError: unknown preset, bad tp_rank / tp_size, a config field missing, tp_size not
            dividing heads / KV heads / intermediate sizes / padded vocab, an engine parameter missing
            or of the wrong shape (naming it, the HF tensor it holds, and both shapes).
    """
    mapping = _as_mapping(params)
    names = {n[len(prefix) :] for n in mapping if n.startswith(prefix)} if prefix else set(mapping)
    plan = _plan(preset, config, names, tp_rank, tp_size, expert_parallel, hf_experts, vocab_padding)
    local = _engine_tensors(plan, mapping, prefix)
    out = _group(plan, local)
    log.debug(
        "preset %s: %d HF tensors as views into %d engine parameters (tp %d/%d)",
        preset,
        len(out),
        len(local),
        tp_rank,
        tp_size,
    )
    return out


def _engine_tensors(plan: _Plan, mapping: Mapping[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    """The planned engine parameters, checked (present, local tensors, planned shape) and detached."""
    holds: dict[str, str] = {}
    for piece in plan.pieces:
        holds.setdefault(piece.engine, piece.hf)
    where = f"on tp_rank {plan.par.rank} of {plan.par.size}"
    local: dict[str, torch.Tensor] = {}
    for engine, shape in plan.shapes.items():
        name, t = prefix + engine, mapping.get(prefix + engine)
        what = f"preset {plan.preset!r}: engine parameter {name!r}"
        if t is None:
            raise LayoutError(
                f"{what} is missing (it holds {holds.get(engine, '?')!r}; expected local shape "
                f"{shape} {where})"
            )
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"{what} is a {type(t).__name__}, not a tensor")
        if any(c.__name__ == "DTensor" for c in type(t).__mro__):
            raise LayoutError(f"{what} is a DTensor: presets take each rank's local tensors (.to_local())")
        if tuple(t.shape) != shape:
            raise LayoutError(
                f"{what} has shape {tuple(t.shape)}, expected {shape} {where} (it holds "
                f"{holds.get(engine, '?')!r})"
            )
        local[engine] = t.detach()  # same memory; no autograd on the views (they are written in place)
    return local


def _group(plan: _Plan, local: Mapping[str, torch.Tensor]) -> dict[str, View]:
    """The pieces as views, grouped by HF name: a tensor for a whole HF tensor, a Shard for one box,
    a list of Shards for several."""
    boxes: dict[str, list[Shard]] = {}
    for piece in plan.pieces:
        view = _view(piece, local[piece.engine])
        boxes.setdefault(piece.hf, []).append(Shard(view, piece.hf_offsets, piece.hf_shape))
    out: dict[str, View] = {}
    for hf, shards in boxes.items():
        s = shards[0]
        if len(shards) > 1:
            out[hf] = shards
        elif not any(s.offsets) and tuple(s.tensor.shape) == s.global_shape:
            out[hf] = s.tensor
        else:
            out[hf] = s
    return out

"""The plan of a preset: which box of which HF tensor lives where in which engine parameter.

:class:`Plan` collects the pieces; the building blocks (:func:`replicated`, :func:`column`, :func:`row`,
:func:`merged`, :func:`qkv`, :func:`megatron_qkv`, :func:`vocab`, :func:`experts`) add one fused layout
each. The per-model presets (:mod:`._models`) are made of them; :mod:`astate_store.integrations.presets`
turns a plan into views.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from astate_store.errors import LayoutError

# vLLM pads embedding and LM-head rows to a multiple of 64 before splitting them over TP ranks
# (vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE); Megatron to a multiple of
# make_vocab_size_divisible_by (128) times the TP size (megatron/training/tokenizer/tokenizer.py,
# _vocab_size_with_padding).
VLLM_VOCAB_PADDING = 64
MEGATRON_VOCAB_DIVISIBLE_BY = 128


# --------------------------------------------------------------------------------------------------
# config and parallel settings


class Config:
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
class Parallel:
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
class Piece:
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
class Plan:
    preset: str
    par: Parallel
    names: Collection[str]  # the engine parameters the caller has (presets may pick spellings)
    hf_experts: str = "per_expert"  # HF names of routed experts: "per_expert" or "fused" (transformers >= 5)
    vocab_padding: int | None = (
        None  # rows of embeddings / LM head padded to a multiple of this (None: engine's)
    )
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pieces: list[Piece] = field(default_factory=list)

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
        self.pieces.append(Piece(hf, tuple(hf_shape), tuple(hf_offsets), engine, select, narrow))

    def split(self, n: int, what: str) -> int:
        return self.par.split(n, what, self.preset)

    def pick(self, *candidates: str) -> str:
        """The first spelling the caller's parameters use (else the first, for the error message)."""
        return next((c for c in candidates if c in self.names), candidates[0])


# --------------------------------------------------------------------------------------------------
# layouts, each as the engine defines it (docs/presets.md names the source)


def replicated(plan: Plan, hf: str, engine: str, shape: Sequence[int]) -> None:
    """Every rank holds the whole tensor (norms, routers, ReplicatedLinear)."""
    plan.engine(engine, shape)
    plan.add(hf, shape, (0,) * len(shape), engine)


def column(plan: Plan, hf: str, engine: str, shape: Sequence[int]) -> None:
    """ColumnParallelLinear: rank r holds rows ``[r * n, (r + 1) * n)`` (weights and biases)."""
    merged(plan, engine, [(hf, shape[0])], tuple(shape[1:]))


def row(plan: Plan, hf: str, engine: str, shape: Sequence[int]) -> None:
    """RowParallelLinear weight: rank r holds input columns ``[r * n, (r + 1) * n)``."""
    out, inp = shape
    n = plan.split(inp, f"{hf} input dim")
    plan.engine(engine, (out, n))
    plan.add(hf, shape, (0, plan.par.rank * n), engine)


def merged(
    plan: Plan, engine: str, parts: Sequence[tuple[str, int]], trailing: tuple[int, ...], *, tp: bool = True
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
    plan: Plan,
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
    plan: Plan,
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


def vocab(plan: Plan, hf: str, engine: str, vocab_size: int, hidden: int, multiple: int) -> None:
    """VocabParallelEmbedding / ParallelLMHead: rows padded to ``multiple``, then split evenly;
    rank r's first rows are the real vocabulary rows it holds, the padding rows are not mapped."""
    padded = -(-vocab_size // multiple) * multiple
    per = plan.split(padded, f"the padded vocabulary ({vocab_size} rows padded to a multiple of {multiple})")
    start = plan.par.rank * per
    real = max(0, min(per, vocab_size - start))
    plan.engine(engine, (per, hidden))
    if real:
        plan.add(hf, (vocab_size, hidden), (start, 0), engine, narrow=(0, 0, real))


def _expert_split(plan: Plan, num_experts: int, inter: int) -> tuple[int, int, int, int]:
    """(local expert count, first global expert, local intermediate size, TP rank within an expert)."""
    par = plan.par
    if par.expert_parallel:  # whole experts, linearly placed: the first E % tp ranks take one more
        base, extra = divmod(num_experts, par.size)
        return base + (par.rank < extra), par.rank * base + min(par.rank, extra), inter, 0
    return num_experts, 0, plan.split(inter, "moe intermediate size"), par.rank


def experts(plan: Plan, hf: str, w13: str, w2: str, num_experts: int, inter: int, hidden: int) -> None:
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

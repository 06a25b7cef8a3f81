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
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Union

import torch

from astate_store.errors import LayoutError

# The plan's building blocks (_blocks) and the per-model presets (_models) live in submodules.
from astate_store.integrations.presets._blocks import Config, Parallel, Piece, Plan
from astate_store.integrations.presets._models import PRESETS
from astate_store.model.layout import Shard

__all__ = ["View", "PRESETS", "views", "engine_shapes", "ParamsLike"]

log = logging.getLogger("astate_store.integrations.presets")

View = Union[torch.Tensor, Shard, list[Shard]]
ParamsLike = Union[Mapping[str, torch.Tensor], torch.nn.Module, Iterable[tuple[str, torch.Tensor]]]

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
) -> Plan:
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
    plan = Plan(preset, Parallel(tp_rank, tp_size, bool(expert_parallel)), names, hf_experts, vocab_padding)
    build(plan, Config(preset, config))
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


def _view(piece: Piece, param: torch.Tensor) -> torch.Tensor:
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


def _engine_tensors(plan: Plan, mapping: Mapping[str, Any], prefix: str) -> dict[str, torch.Tensor]:
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


def _group(plan: Plan, local: Mapping[str, torch.Tensor]) -> dict[str, View]:
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

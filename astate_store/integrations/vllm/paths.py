"""Which path each module of a loaded vLLM model takes: in place, or staged reload.

In place is safe only where the engine computes with the parameters exactly as the loaders wrote them.
A module is *staged* when vLLM transforms its weights after loading (``process_weights_after_loading``:
the CPU MoE repack, quantization, padding, transposes, a prepacked GEMM that drops or bypasses the
weight). Evidence used, most specific first:

1. the module's quant method is not one known to compute on the weights as loaded
   (``UnquantizedLinearMethod``, ``UnquantizedEmbeddingMethod``);
2. a parameter differs in shape, dtype or strides from what vLLM recorded before post-processing
   (``record_metadata_for_reloading``), or has gone, or a new one appeared;
3. on CPU, the layer's GEMM was dispatched to a prepacked kernel (oneDNN, sgl, zentorch) that keeps its
   own copy of the weight.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["IN_PLACE_METHODS", "decide", "pre_processing_metadata", "prepacked_gemm", "tied_followers"]

# quant methods whose process_weights_after_loading leaves the weights as loaded (apart from the CPU
# GEMM dispatch, checked separately)
IN_PLACE_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
_PREPACKED_GEMMS = ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary")


def pre_processing_metadata(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters as vLLM recorded them at construction (meta tensors), or {}."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    return dict(info.restore_metadata[0]) if info is not None else {}


def prepacked_gemm(module: torch.nn.Module) -> bool:
    """On CPU: the module's GEMM was dispatched to a kernel that keeps its own copy of the weight."""
    fn = getattr(module, "cpu_linear", None)
    code = getattr(fn, "__code__", None)
    return code is not None and any(n in code.co_names for n in _PREPACKED_GEMMS)


def _reason(module: torch.nn.Module, meta: Mapping[str, torch.Tensor]) -> str | None:
    params = {n: p for n, p in module._parameters.items() if p is not None}
    method = getattr(module, "quant_method", None)
    if method is not None and type(method).__name__ not in IN_PLACE_METHODS:
        return f"{type(method).__name__} post-processes its weights"
    if prepacked_gemm(module):
        return "its GEMM runs on a prepacked copy of the weight"
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    # vLLM records no metadata for some tensors (``bias`` is made after create_weights): only the rest count
    if meta and set(meta) != set(params) - SKIP_TENSORS:
        return f"post-processing changed its parameters ({sorted(meta)} -> {sorted(params)})"
    for name, m in meta.items():
        p = params[name]
        if tuple(p.shape) != tuple(m.shape) or p.dtype != m.dtype or p.stride() != m.stride():
            return (
                f"post-processing changed {name!r} from {tuple(m.shape)} {m.dtype} to "
                f"{tuple(p.shape)} {p.dtype}"
            )
    return None


def decide(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> why it is staged, for every module with parameters that must not be written in place."""
    staged = {}
    for name, module in model.named_modules():
        if not any(p is not None for p in module._parameters.values()):
            continue
        why = _reason(module, pre_processing_metadata(module))
        if why is not None:
            staged[name] = why
    return staged


def tied_followers(model: torch.nn.Module, staged: Mapping[str, str]) -> dict[str, str]:
    """Staged module -> the module that owns its parameters, for staged modules whose every parameter
    is another module's (tied: ``lm_head`` sharing ``embed_tokens.weight``). vLLM's loaders write the
    owner only, so a follower is not pulled: after the owner's commit its post-processing runs again
    on the shared, updated parameter (its prepacked GEMM rebuilt from it)."""
    owner: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owner.setdefault(id(p), name)
    out = {}
    for name in staged:
        params = [p for p in model.get_submodule(name)._parameters.values() if p is not None]
        owners = {owner[id(p)] for p in params}
        if params and name not in owners and len(owners) == 1:
            out[name] = owners.pop()
    return out

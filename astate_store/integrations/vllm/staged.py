"""Staged reload for modules whose weights vLLM transforms after loading (CPU MoE repack, quantization).

The HF slices a staged module needs are pulled into bounded staging: tensors in the module's
*pre-processing* format (as vLLM recorded it at construction; fresh ones, or with delta pulls the ones
kept from the last update, which hold the version served: engine.py), through the views the bake learned
from the module's own loaders. Only after the whole pull succeeded does each module run vLLM's own
post-processing on them, as on a first load, and the results are copied into the live parameters'
storage (addresses kept, as vLLM's layerwise reload does).

Why not vLLM's ``reload_weights`` / layerwise reload as is: on a weight update the unquantized MoE
method takes its "is_weight_update" branch (``moe_kernel`` already set), which copies the shuffled
weights back but skips the experts kernel's own ``process_weights_after_loading``: on CPU that is
``cpu_prepack_moe_weight``, so the reloaded experts stay in HF order while the kernel expects the
prepacked order (wrong weights, no error). Here the module is post-processed with its first-load
state (``moe_kernel`` cleared, ``_already_called_process_weights_after_loading`` removed), which
runs the repack, and the engine's checksums then equal a fresh engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from astate_store import Shard
from astate_store.errors import LayoutError
from astate_store.integrations.vllm.bake import Piece
from astate_store.integrations.vllm.paths import IN_PLACE_METHODS

__all__ = ["StagedModule", "post_process", "refresh"]

log = logging.getLogger("astate_store.integrations.vllm")


@dataclass
class StagedModule:
    """One module on the staged path: its pre-processing metadata and the pieces the bake found."""

    name: str
    module: torch.nn.Module
    metadata: Mapping[str, torch.Tensor]  # parameter name -> meta tensor (pre-processing format)
    pieces: list[Piece]
    reason: str
    staging: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def staging_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.metadata.values())

    def _local(self, piece: Piece) -> str:
        return piece.param[len(self.name) + 1 :] if self.name else piece.param

    def buffers(self, shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, Shard]]:
        """Allocate the staging (zeros: elements no tensor writes stay as a fresh load leaves them
        after a zero-fill) and return (HF name, Shard view into it) for every piece."""
        self.staging = {n: torch.zeros(tuple(m.shape), dtype=m.dtype) for n, m in self.metadata.items()}
        return [
            (p.hf, Shard(p.view(self.staging[self._local(p)]), p.offsets, shapes[p.hf])) for p in self.pieces
        ]

    def drop(self) -> None:
        self.staging = {}

    def commit(self, model_config: Any, keep: bool = False) -> None:
        """Run vLLM's post-processing on the staged tensors as on a first load, then copy the results
        into the live parameters (same shape and dtype) or, where the format differs, keep the new ones.

        ``keep``: the staging stays as it is (it holds the version now served: the base of the next
        delta pull), so post-processing gets an alias of it (it cannot rebind the staging's storage)
        where its method leaves the weights as loaded, else a copy (a repack may work in place), and a
        new parameter that still shares the staging's memory gets its own."""
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        module = self.module
        kernel = dict(module._parameters)
        aliases = type(getattr(module, "quant_method", None)).__name__ in IN_PLACE_METHODS
        for pname, meta in self.metadata.items():
            t = self.staging[pname]
            if keep:
                t = t.detach() if aliases else t.clone()
            t.__class__ = meta.__class__
            t.__dict__ = meta.__dict__.copy()
            module._parameters[pname] = restore_layer_refs(t, module)
        try:
            post_process(module, model_config)
        except BaseException:
            module._parameters.clear()
            module._parameters.update(kernel)
            raise
        for pname, new in list(module._parameters.items()):
            old = kernel.get(pname)
            if old is not None and new is not None and old.shape == new.shape and old.dtype == new.dtype:
                old.data.copy_(new.data)  # keep the engine's storage (addresses captured by kernels, graphs)
                module._parameters[pname] = old
            else:
                if keep and new is not None and any(_shares(new, t) for t in self.staging.values()):
                    new.data = new.data.clone()  # the next pull writes the staging: not what is served
                log.info(
                    "staged %s: %s now %s (was %s)",
                    self.name,
                    pname,
                    None if new is None else tuple(new.shape),
                    None if old is None else tuple(old.shape),
                )
        if not keep:
            self.drop()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' storages are the same memory."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() > 0


def refresh(module: torch.nn.Module, model_config: Any) -> None:
    """Post-process a module again on its live parameters (a tied follower, whose owner was just
    updated): what a first load does after the loaders wrote them, e.g. its prepacked GEMM rebuilt."""
    post_process(module, model_config)


def post_process(module: torch.nn.Module, model_config: Any) -> None:
    """vLLM's post-processing of one module, from the state a first load has."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    method = getattr(module, "quant_method", None)
    if hasattr(method, "moe_kernel"):
        method.moe_kernel = None  # first-load branch: rebuild the kernel and run its own repack
    with torch.no_grad():
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading(model_config.dtype)
        else:
            raise LayoutError(f"module {type(module).__name__}: staged, but has no post-processing to run")

"""The bake: learn from vLLM's own weight loaders which box of which published HF tensor each of this
worker's parameters holds, as ``sharded_rdt`` does, so that no per-model table is the source of truth.

How (once per set of published tensors):

1. Every parameter the loaders may write is swapped for a float64 placeholder filled with -1: the live
   parameter's memory for modules that are written in place, a fresh tensor of the *pre-processing*
   shape (as vLLM recorded it before ``process_weights_after_loading``) for staged modules.
2. and 3. The model's own ``load_weights`` is driven with numbered placeholders and each parameter
   decoded into a box of one HF tensor, as :mod:`astate_store.integrations.bake_common` describes
   (a loader that transforms raises :class:`NotACopy`).
4. Everything is put back (the live ``.data`` and the staged modules' kernel parameters).

The engine-neutral part (placeholders, decoding) is :mod:`astate_store.integrations.bake_common`;
here: vLLM's staged modules. Pure torch on this process's model; no etcd, no transport.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from astate_store.integrations.bake_common import Baked, NotACopy, Piece, Swap, bake_with, decode

__all__ = ["Piece", "Baked", "NotACopy", "bake", "decode"]


class _Swap(Swap):
    """The engine-neutral swap, plus vLLM's staged modules: baked against fresh tensors of the format
    vLLM recorded before ``process_weights_after_loading``, never against their live memory."""

    def _stage(self, mname: str, module: torch.nn.Module, metadata: Mapping[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        self.kernel[mname] = dict(module._parameters)
        for pname, p in module._parameters.items():  # no pre-processing format recorded: stays live (bias)
            if p is not None and pname not in metadata:
                self.swap_live(f"{mname}.{pname}" if mname else pname, p)
        fresh = {}
        for pname, meta in metadata.items():
            t = torch.full(tuple(meta.shape), -1.0, dtype=torch.float64)
            t.__class__ = meta.__class__
            t.__dict__ = meta.__dict__.copy()
            t = restore_layer_refs(t, module)
            module._parameters[pname] = t
            fresh[pname] = t
        self.fresh[mname] = fresh


def bake(
    model: torch.nn.Module,
    published: Mapping[str, tuple[int, ...]],
    staged: Mapping[str, Mapping[str, torch.Tensor]],
) -> Baked:
    """Drive the model's loaders once with placeholders of ``published`` (HF name -> global shape).

    ``staged``: module name -> its pre-processing parameter metadata (meta tensors vLLM recorded);
    those modules are baked against fresh tensors of that format, never against their live memory.

    Raises:
        LayoutError: the loaders refuse a published tensor (naming it).
        NotACopy: an in-place parameter's loader transforms (naming the parameter).
    """
    return bake_with(_Swap(model, staged), published, "vLLM")

"""What a vLLM worker computes with, read back in the loaders' format: the check that an update landed.

vLLM's own ``compute_weight_checksums`` digests the parameters, but on CPU a linear layer whose GEMM is
prepacked (oneDNN, sgl, zentorch: AVX-512 and newer CPUs) serves from the kernel's private copy and
leaves ``weight`` empty (shape ``(0,)``): its checksum says nothing about what the engine computes. Here
such a weight is read through the layer's own GEMM: ``cpu_linear(I, ...)`` with the identity ``I`` is
``W^T``, exactly (each output element is one product ``1 * w`` accumulated in fp32 and rounded back to
the weight's dtype, which holds ``w``), so a staged update's result can be compared bit for bit with the
published tensors. (Only the sign of a zero can differ: ``-0.0`` reads as ``0.0``.)

Used by the tests, ``examples/rl_vllm.py`` and the engine's ``"served"`` query; not on the update path.
"""

from __future__ import annotations

import torch

from astate_store.integrations.vllm.paths import pre_processing_metadata, prepacked_gemm

__all__ = ["served_digests", "served_weights"]


def _through_gemm(module: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A 2-D weight ``[N, K]`` read back through the module's prepacked GEMM."""
    n, k = shape
    eye = torch.eye(k, dtype=dtype)
    with torch.no_grad():
        out = module.cpu_linear(eye, module.weight, None)  # [K, N] = I @ W^T
    return out.t().contiguous().to(dtype).reshape(n, k)


def served_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` as the engine computes with it, by its vLLM name, in the format the
    loaders write (a prepacked GEMM's weight recovered through the GEMM). A parameter that is neither
    held nor recoverable (a repacked MoE expert, a quantized weight) is left out."""
    out: dict[str, torch.Tensor] = {}
    for mname, module in model.named_modules():
        meta = pre_processing_metadata(module)
        for pname, p in module._parameters.items():
            if p is None:
                continue
            name = f"{mname}.{pname}" if mname else pname
            m = meta.get(pname)
            if pname == "weight" and m is not None and m.dim() == 2 and prepacked_gemm(module):
                # what the GEMM computes with: for an embedding that keeps its parameter (its lookup
                # table), the copy its logits GEMM uses (a tied lm_head's) is the one that can go stale
                out[name] = _through_gemm(module, tuple(m.shape), m.dtype)
            elif p.numel() > 0 and (m is None or tuple(p.shape) == tuple(m.shape)):
                out[name] = p.detach()
    return out


def served_digests(model: torch.nn.Module) -> dict[str, str]:
    """SHA-256 of each of :func:`served_weights` (the engine's ``"served"`` query)."""
    import hashlib

    return {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in served_weights(model).items()
    }

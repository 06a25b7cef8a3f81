"""A stand-in for ``sgl_kernel``'s CPU ops, for running SGLang 0.5.23 on a CPU without them.

The ``sglang-kernel`` wheel on the index holds CUDA code only (sm90 / sm100) and no CPU build is
published, but SGLang's CPU mode (``SGLANG_USE_CPU_ENGINE=1``) imports these names from
``sgl_kernel`` at module level (``srt/mem_cache/allocation.py``, ``kernels/ops/kvcache/cache_move.py``,
``kernels/ops/speculative/``). This module provides exactly the names those imports ask for and
nothing else:

- ``assign_req_to_token_pool_cpu``: in plain torch (slice copies, the semantics of the Triton kernel
  ``assign_req_to_token_pool`` next to its call in ``allocation.py``). SGLang calls it when it
  allocates KV slots for speculative decoding; the tested runs do not (measured: an engine with every
  name here raising generates), so only its own unit test exercises it;
- every other name raises ``NotImplementedError`` when called: the KV copy between layers (hierarchical
  cache) and the speculative-decoding ops. With ``attention_backend="torch_native"``, no speculative
  decoding and no AMX on the CPU, SGLang calls none of them; a run that did would fail loudly.

Used by the SGLang tests and ``benchmarks/sglang_sync.py`` only: they put this directory first on
the engine's ``PYTHONPATH`` (``tests/support/sglang.py``). Not part of astate-store.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Row ``req_pool_indices[i]`` of ``req_to_token``, columns ``[start_offset[i], end_offset[i])``,
    takes the next ``end - start`` entries of ``out_cache_loc`` (requests in order)."""
    del pool_len  # the row length, which a slice knows
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def _not_provided(name: str) -> Callable[..., None]:
    def op(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not in this stand-in (tests/support/sglang_cpu/sgl_kernel); "
            "SGLang called a CPU kernel that the CPU run under test was not expected to need"
        )

    op.__name__ = op.__qualname__ = name
    return op


copy_all_layer_kv_cache_cpu = _not_provided("copy_all_layer_kv_cache_cpu")
assign_extend_cache_locs_cpu = _not_provided("assign_extend_cache_locs_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_provided("assign_draft_cache_locs_contiguous_cpu")
build_tree_kernel_efficient_cpu = _not_provided("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_provided("verify_tree_greedy_cpu")
fill_accept_out_cache_loc_cpu = _not_provided("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_provided("fill_bonus_tokens_cpu")

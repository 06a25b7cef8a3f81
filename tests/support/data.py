"""The one data generator of the tests and benchmarks: the exact tensor ``name`` holds at ``step``.

Both sides of every check call it: the publisher to fill what it puts, the consumer (or the test)
to know what must arrive. Values are exact in every dtype (fp32 values are integers below 2**24,
fp16/bf16 ones below 2**8) and every element changes with the step, so a byte from the wrong step
or the wrong place never passes for a right one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["value"]


def value(name: str, shape: Sequence[int], dtype: Any, step: int) -> Any:
    """The global tensor ``name`` of ``shape`` and ``dtype`` (a torch dtype or its name) at ``step``."""
    import torch  # lazily: the fault suite's driver imports this module without torch

    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    numel = 1
    for s in shape:
        numel *= int(s)
    base = torch.arange(numel, dtype=torch.int64) + (sum(map(ord, name)) % 89)
    if dt == torch.bool:
        v = (base + step) % 3 == 0
    elif dt in (torch.bfloat16, torch.float16):
        v = (base % 8) + 8 * (step % 16)
    elif dt.is_floating_point:
        v = (base % 4093) + 4096 * (step % 4000)
    else:
        v = base + step * 1_000_003
    return v.to(dt).reshape(tuple(int(s) for s in shape))

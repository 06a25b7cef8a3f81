"""Reference executor: apply a read plan with plain byte copies, one Python step per read.

For tests and loopback paths only (the data path hands ``READ_DTYPE`` arrays to the transport).
It is the only planner module that calls torch (for dtype conversion).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from astate_store.model.dtypes import DTYPE_NAMES


def execute_reads(
    reads: np.ndarray, sources: Mapping[tuple[int, int], Any], dests: Mapping[int, Any]
) -> None:
    """Apply reads with plain copies: ``sources[(rank, region)]`` and ``dests[region]`` are flat
    ``torch.uint8`` tensors (or writable numpy uint8 arrays). Reference code: one Python step per
    read."""
    import torch

    from astate_store.model.dtypes import torch_dtype

    for r in reads.tolist():
        so, do, ln, rk, sreg, dreg, _t, _i, sdt, ddt, conv = r
        s = sources[(rk, sreg)]
        d = dests[dreg]
        if not conv:
            d[do : do + ln] = s[so : so + ln]
            continue
        st = torch_dtype(DTYPE_NAMES[sdt])
        dt = torch_dtype(DTYPE_NAMES[ddt])
        sv = torch.as_tensor(s[so : so + ln]).clone().view(st)
        dv = sv.to(dt).view(torch.uint8)
        dl = len(dv)
        if isinstance(d, np.ndarray):
            d[do : do + dl] = dv.numpy()
        else:
            d[do : do + dl] = dv

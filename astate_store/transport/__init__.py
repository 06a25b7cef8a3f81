"""Data path: register memory, publish a descriptor, run whole read plans.

``Transport`` (base.py) is the interface; ``UcxTransport`` (ucx.py) the UCX backend
over the ``astate_store._ucx`` extension. See ``base`` for the plan format.
"""

from .base import (
    OP_COLUMNS,
    OP_LENGTH,
    OP_LOCAL,
    OP_OFFSET,
    OP_PEER,
    OP_REGION,
    PeerDescriptor,
    RegionInfo,
    Transport,
    make_ops,
)
from .ucx import MODES, UcxTransport

__all__ = [
    "OP_COLUMNS",
    "OP_LENGTH",
    "OP_LOCAL",
    "OP_OFFSET",
    "OP_PEER",
    "OP_REGION",
    "MODES",
    "PeerDescriptor",
    "RegionInfo",
    "Transport",
    "UcxTransport",
    "make_ops",
]

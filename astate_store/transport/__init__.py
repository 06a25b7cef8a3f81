"""Data path: register memory, publish a descriptor, run whole read plans.

``Transport`` (base.py) is the interface; ``UcxTransport`` (ucx.py) the UCX backend
over the ``astate_store._ucx`` extension. See ``base`` for the plan format.

Modules of the UCX backend, by role: ``ucx`` (the coordinator), ``config`` (mode ->
UCX settings), ``binding`` (loading the extension, typing its errors), ``regions``
(local registrations), ``peers`` (endpoints, rkeys, the snapshot ``get`` reads),
``rows`` (plan checks and translation), ``same_host`` (the same-host paths: batched
``process_vm_readv``, and ``memcpy`` from mapped regions), ``memfd`` (memfd-backed staging
and the checks before a consumer maps a peer's), ``ucx_get`` (the batched UCX read).
"""

from astate_store.transport.base import (
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
from astate_store.transport.ucx import MODES, PeerInfo, UcxTransport

__all__ = [
    "OP_COLUMNS",
    "OP_LENGTH",
    "OP_LOCAL",
    "OP_OFFSET",
    "OP_PEER",
    "OP_REGION",
    "MODES",
    "PeerDescriptor",
    "PeerInfo",
    "RegionInfo",
    "Transport",
    "UcxTransport",
    "make_ops",
]

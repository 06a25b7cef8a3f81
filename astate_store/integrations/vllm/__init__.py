"""astate-store as a vLLM weight-transfer backend (``weight_transfer_config={"backend": "astate"}``).

:func:`register` is the ``vllm.general_plugins`` entry point of this package: vLLM calls it in every
one of its processes (workers included), so installing astate-store is all it takes. It registers,
lazily (nothing heavy is imported until a backend is chosen):

- the worker engine :class:`~astate_store.integrations.vllm.engine.AstateWeightTransferEngine`;
- the trainer engine :class:`~astate_store.integrations.vllm.trainer.AstateTrainerEngine`
  (``WeightTransferTrainerFactory.trainer_init(AstateTrainerInitInfo(...), client=..., source=...)``).

The caller side of an update (:mod:`.clients`): :func:`update_weights` (blocking), :func:`begin_update`
and :func:`apply_update` (prepared while the engine serves, swapped in during a short pause), each
clearing the caches that hold values computed with the old weights.

See docs/vllm.md.
"""

from __future__ import annotations

from astate_store.integrations.vllm.clients import (
    HTTPClient,
    OfflineClient,
    apply_update,
    begin_update,
    cancel_update,
    update_status,
    update_weights,
)

__all__ = [
    "BACKEND",
    "HTTPClient",
    "OfflineClient",
    "apply_update",
    "begin_update",
    "cancel_update",
    "register",
    "update_status",
    "update_weights",
]

BACKEND = "astate"


def register() -> None:
    """Register the ``astate`` backend with vLLM's weight-transfer factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, f"{__name__}.engine", "AstateWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, f"{__name__}.trainer", "AstateTrainerEngine")

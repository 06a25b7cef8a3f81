"""The trainer side of the ``astate`` backend, for code written against vLLM's trainer factory:

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from astate_store.integrations.vllm.trainer import AstateTrainerInitInfo

    sender = WeightTransferTrainerFactory.trainer_init(
        AstateTrainerInitInfo(namespace="policy", rank=rank, world_size=world), client=client,
        source=ModuleSource(model))
    for step in ...:
        train_step(model)
        sender.send_weights()          # every rank: publish its piece; rank 0 updates the engine

1. ``trainer_init`` (every rank): connect to the namespace as publisher ``rank`` of ``world_size``; the
   sender (rank 0) calls the engine's ``init_weight_transfer_engine`` with the namespace.
2. ``send_weights`` (every rank): ``store.put(step, tensors)``: a :class:`ModuleSource` publishes its
   module's ``state_dict()`` as it is (FSDP2 / TP DTensors: every rank its own boxes, nothing gathered);
   any other ``WeightSource`` is iterated (its collectives run on every rank) and rank 0 publishes the
   full tensors. Then the sender updates the engine with :func:`.clients.update_weights`: scheduling
   paused, the four phases (the engine pulls its slices of that version or newer), the prefix cache
   cleared (requests in flight are recomputed with the new weights), scheduling resumed.
3. ``send_weights(background=True)`` publishes and only begins the update (:func:`.clients.begin_update`:
   the engine pulls while it serves); ``apply_weights()`` then swaps it in during a short pause.

The client is the engine's: vLLM's ``HTTPVLLMWeightSyncClient`` (a server in dev mode: its ``/pause``,
``/resume`` and ``/reset_prefix_cache`` routes are used too), :class:`.clients.OfflineClient` (an ``LLM`` in
this process), or any object with the methods of :class:`.clients.EngineControl`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

import astate_store
from astate_store.errors import LayoutError
from astate_store.integrations.vllm.clients import (
    Inflight,
    apply_update,
    begin_update,
    client_for,
    update_weights,
)

__all__ = ["AstateTrainerInitInfo", "AstateTrainerEngine"]


@dataclass
class AstateTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "astate"

    namespace: str = "policy"
    etcd: str | list[str] | None = None  # None: $ASTATE_ETCD, else the embedded etcd
    engine_etcd: str | list[str] | None = None  # the endpoints the engine uses, if it sees etcd elsewhere
    world_size: int = 1  # publisher ranks (every rank that calls send_weights)
    start_step: int | None = None  # the first step sent (None: the newest committed + 1, or 1)
    timeout: float = 60.0  # seconds the engine waits for a version to commit
    # delta versions (docs/delta.md): the trainer's puts record what changed, the engine pulls only that
    delta: bool = True
    # the engine keeps its staging between updates (staged modules', a prepared update's), where delta
    # pulls apply; None: the engine's default (kept when delta is on)
    keep_staging: bool | None = None
    # the engine's choice between the changes and a whole pull: "bytes" or "time" (engine.py)
    delta_choice: str = "bytes"


class AstateTrainerEngine(TrainerWeightTransferEngine[AstateTrainerInitInfo]):
    """Publishes through the store; drives vLLM's four phases from rank 0."""

    init_info_cls = AstateTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info: AstateTrainerInitInfo | None = None
        self.store: astate_store.Store | None = None
        self.step = 1
        self.control = client_for(client) if is_sender else None  # pause, caches, status around an update

    @classmethod
    def trainer_init(
        cls, init_info: AstateTrainerInitInfo, *, client: Any, source: Any = None
    ) -> AstateTrainerEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        store = astate_store.connect(
            init_info.namespace,
            etcd=init_info.etcd,
            rank=init_info.rank,
            world_size=init_info.world_size,
            delta=init_info.delta,
        )
        engine.store = store
        latest = store.latest()
        engine.step = init_info.start_step if init_info.start_step is not None else (latest or 0) + 1
        if engine.is_sender:
            etcd = init_info.engine_etcd or init_info.etcd or store.catalog.endpoint
            client.init_weight_transfer_engine(
                {
                    "namespace": init_info.namespace,
                    "etcd": etcd,
                    "timeout": init_info.timeout,
                    "delta": init_info.delta,
                    "keep_staging": init_info.keep_staging,
                    "delta_choice": init_info.delta_choice,
                }
            )
        return engine

    def _tensors(self) -> Mapping[str, Any] | None:
        module = getattr(self.source, "_module", None)
        if module is not None:
            return module.state_dict()  # DTensors stay sharded: each rank publishes its own boxes
        if self.source is None:
            raise LayoutError(
                "astate trainer: send_weights() needs a source (trainer_init(source=...)) or tensors"
            )
        assert self.info is not None
        if self.info.world_size != 1:
            raise LayoutError(
                "astate trainer: a WeightSource other than ModuleSource yields full tensors; "
                "publish them from one rank (world_size=1) or pass a ModuleSource"
            )
        full = {name: t for name, t in self.source}  # every rank runs the source's collectives
        return full if self.info.rank == 0 else None

    def send_weights(
        self, tensors: Mapping[str, Any] | None = None, *, step: int | None = None, background: bool = False
    ) -> int:
        """Publish ``tensors`` (default: the source's) as ``step`` (default: the next) and, on the sender,
        update the engine to it (its caches cleared); ``background=True``: only begin the update, the
        engine pulling while it serves (:meth:`apply_weights` swaps it in). Returns the step."""
        assert self.store is not None
        step = self.step if step is None else step
        tensors = self._tensors() if tensors is None else tensors
        if tensors is not None:
            self.store.put(step, tensors)
        if self.control is not None:
            if background:
                begin_update(self.control, step)
            else:
                update_weights(self.control, step)
        self.step = step + 1
        return step

    def apply_weights(self, *, timeout: float | None = None, inflight: Inflight = "recompute") -> int:
        """On the sender: swap in the update begun by ``send_weights(background=True)`` (a short pause,
        the caches cleared); returns the step the engine now serves."""
        if self.control is None:
            raise LayoutError("astate trainer: apply_weights() is the sender's (rank 0's) call")
        return apply_update(self.control, timeout=timeout, inflight=inflight)

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def _register() -> None:
    # A trainer process is not a vLLM process: vLLM's plugin loader never runs there, so the
    # factory would not know "astate" unless importing this module (where AstateTrainerInitInfo
    # lives) registers it. Idempotent, and lazy: the factory imports this module by name on use.
    from astate_store.integrations.vllm import register

    register()


_register()

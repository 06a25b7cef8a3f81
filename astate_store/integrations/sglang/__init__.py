"""astate-store as SGLang's weight source: each TP rank pulls its slices of a published version
straight into its parameters (docs/sglang.md).

The one setting: ``custom_weight_loader=[LOADER]`` on the engine (``--custom-weight-loader
astate_store.integrations.sglang.loader.load`` for ``sglang.launch_server``). The one call per
update: :func:`update` (an offline ``sglang.Engine``) or :func:`update_http` (a server's URL).

:func:`register` is this package's ``sglang.srt.plugins`` entry point: SGLang runs it in every one of
its processes, so installing astate-store is all it takes. It hooks SGLang's
``WeightUpdater.update_weights_from_tensor`` (:func:`.loader.guarded`) so that a refused astate
update fails the update call with its reason instead of killing SGLang's scheduler (other load
formats pass through), and SGLang's other weight writers (:data:`WRITERS`, :func:`.loader.forgetting`)
so that the astate pull after any of them moves every byte, not a delta.
"""

from __future__ import annotations

from astate_store.integrations.sglang.client import update, update_http
from astate_store.integrations.sglang.request import LOADER, Request, UpdateError

__all__ = ["LOADER", "Request", "UpdateError", "register", "update", "update_http"]

_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
HOOKED = f"{_UPDATER}.update_weights_from_tensor"  # SGLang's per-runner update that calls custom loaders
# SGLang's other writers of a runner's weights (0.5.23): after each, the next astate pull is whole
WRITERS = (
    f"{_UPDATER}.update_weights_from_disk",
    f"{_UPDATER}.load_weights_from_distributed",
    f"{_UPDATER}.update_weights_from_ipc",
    "sglang.srt.utils.weight_checker.WeightChecker._reset_tensors",
    "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
    ".resume_memory_occupation",
)


def register() -> None:
    """Register the hooks with SGLang's plugin registry (applied by SGLang after every plugin ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from astate_store.integrations.sglang.loader import forgetting, guarded

    HookRegistry.register(HOOKED, guarded, HookType.AROUND)
    for target in WRITERS:
        HookRegistry.register(target, forgetting, HookType.AROUND)

"""The ``astate`` weight-transfer engine on vLLM's workers.

Selected with ``weight_transfer_config={"backend": "astate"}`` (``--weight-transfer-config`` for
``vllm serve``) once astate-store is installed: the ``vllm.general_plugins`` entry point registers it
in every vLLM process. Driven by vLLM's four phases:

1. ``init_weight_transfer_engine({"namespace": NS, "etcd": ..., "timeout": ...})``: connect to the
   namespace; decide per module whether it is written in place or staged (:mod:`.paths`).
2. ``start_weight_update()``: nothing to prepare.
3. ``update_weights({"step": N})`` (the newest committed version >= N; ``{}``: the newest committed)
   or ``{"checkpoint": URI, "step": N}`` (cold start from an astate checkpoint, no trainer needed):
   a. list what the version publishes (names, global shapes, dtypes);
   b. bake once per published set: learn each parameter's boxes from vLLM's loaders (:mod:`.bake`);
   c. build the buffers: in-place views of the live parameters, staging views for staged modules;
      validate names, shapes and dtypes on every worker and agree (a collective) before any byte moves;
   d. one ``get_into`` (or ``restore``) pulls this worker's TP/EP slice of that version;
   e. the workers agree on the step; a worker behind pulls again at the newest;
   f. staged modules are post-processed by vLLM and copied in (:mod:`.staged`).
4. ``finish_weight_update()``: nothing left to do (vLLM records the weight version).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import astate_store
from astate_store.errors import AStateError, LayoutError, WaitTimeout

from .bake import Baked, bake
from .paths import decide, pre_processing_metadata
from .staged import StagedModule

__all__ = ["AstateInitInfo", "AstateUpdateInfo", "AstateWeightTransferEngine", "UpdateError"]

log = logging.getLogger("astate_store.integrations.vllm")


class UpdateError(LayoutError):
    """A weight update refused before any byte moved (on this or another worker); the engine keeps
    its weights."""


@dataclass
class AstateInitInfo(WeightTransferInitInfo):
    namespace: str
    etcd: str | list[str] | None = None  # None: $ASTATE_ETCD* of the vLLM processes (credentials too)
    timeout: float = 60.0  # seconds to wait for a version to commit


@dataclass
class AstateUpdateInfo(WeightTransferUpdateInfo):
    step: int | None = None  # the oldest acceptable step (None: the newest committed)
    checkpoint: str | None = None  # cold start: fill from the newest astate checkpoint under this URI
    timeout: float | None = None  # overrides init's timeout for this update


@dataclass
class _Plan:
    """What one published set maps to on this worker."""

    fingerprint: tuple
    baked: Baked
    staged: list[StagedModule]


class AstateWeightTransferEngine(WeightTransferEngine[AstateInitInfo, AstateUpdateInfo]):
    """Pulls published HF tensors straight into this worker's vLLM parameters (see the module doc)."""

    init_info_cls = AstateInitInfo
    update_info_cls = AstateUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.store: astate_store.Store | None = None
        self.timeout = 60.0
        self.paths: dict[str, str] = {}
        self._plan: _Plan | None = None
        self.last_step: int | None = None
        self.last_seconds: dict[str, float] = {}

    # ---- the four phases --------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: AstateInitInfo) -> None:
        if not isinstance(init_info.namespace, str) or not init_info.namespace:
            raise LayoutError(f"astate init_info: 'namespace' must be a non-empty string, got {init_info.namespace!r}")
        if self.store is not None:
            self.store.close()
        self.timeout = float(init_info.timeout)
        # a consumer: rank / world size are publisher settings, not this worker's vLLM rank
        self.store = astate_store.connect(init_info.namespace, etcd=init_info.etcd, rank=0, world_size=1)
        self.paths = decide(self.model)
        self._plan = None
        log.info("astate: namespace %s; staged modules: %s", init_info.namespace, self.paths or "none")

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        self._plan = None

    def receive_weights(self, update_info: AstateUpdateInfo) -> None:
        if self.store is None:
            raise LayoutError("astate: call init_weight_transfer_engine({'namespace': ...}) before update_weights")
        t0 = time.perf_counter()
        timeout = self.timeout if update_info.timeout is None else float(update_info.timeout)
        step, keys = self._published(update_info, timeout)
        plan = self._plan_for(keys)
        t1 = time.perf_counter()
        buffers = self._agreed(lambda: self._buffers(plan, keys))
        try:
            got = self._pull(buffers, update_info, step, timeout)
            t2 = time.perf_counter()
            for s in plan.staged:
                s.commit(self.model_config)
        finally:
            for s in plan.staged:
                s.drop()
        self.last_step = got
        self.last_seconds = {"plan": t1 - t0, "pull": t2 - t1, "staged": time.perf_counter() - t2}
        log.info("astate: step %d in place (%d staged modules) in %.3fs", got, len(plan.staged),
                 time.perf_counter() - t0)

    # ---- steps ------------------------------------------------------------------------------------

    def _published(self, info: AstateUpdateInfo, timeout: float) -> tuple[int, dict[str, tuple[tuple, str]]]:
        """The step to pull and what it publishes: name -> (global shape, dtype name)."""
        assert self.store is not None
        if info.step is not None and (isinstance(info.step, bool) or not isinstance(info.step, int) or info.step < 0):
            raise LayoutError(f"astate update_info: 'step' must be a non-negative int, got {info.step!r}")
        if info.checkpoint is not None:
            from astate_store.checkpoint import checkpoint_info, read_manifest

            step = checkpoint_info(info.checkpoint, info.step).step
            cols = read_manifest(info.checkpoint, step).select(["name", "global_shape", "dtype"]).to_pydict()
            keys = {n: (tuple(s), d) for n, s, d in zip(cols["name"], cols["global_shape"], cols["dtype"])}
            return step, keys
        try:
            step = self.store.wait(info.step, timeout=timeout)
        except WaitTimeout as exc:
            want = "any version" if info.step is None else f"a version >= step {info.step}"
            raise WaitTimeout(f"astate namespace {self.store.namespace!r}: {want} was not committed within "
                              f"{timeout:g}s (newest: {self.store.latest()})") from exc
        keys = {n: (tuple(k.global_shape), k.dtype) for n, k in self.store.keys(step).items()}
        return step, keys

    def _plan_for(self, keys: Mapping[str, tuple[tuple, str]]) -> _Plan:
        fingerprint = tuple(sorted((n, s) for n, (s, _) in keys.items()))
        if self._plan is not None and self._plan.fingerprint == fingerprint:
            return self._plan
        metadata = {name: pre_processing_metadata(self.model.get_submodule(name)) for name in self.paths}
        missing = [n for n, m in metadata.items() if not m]
        if missing:
            raise LayoutError(f"astate: modules {missing} are transformed after loading ({self.paths[missing[0]]}) "
                              "but vLLM recorded no pre-processing format for them")
        baked = self._agreed(lambda: bake(self.model, {n: s for n, (s, _) in keys.items()}, metadata))
        if baked.unwritten:
            raise LayoutError(f"astate: no published tensor writes parameter {baked.unwritten[0]!r} "
                              f"({len(baked.unwritten)} in all: {baked.unwritten[:5]}); the published names do "
                              f"not match what {type(self.model).__name__}'s loaders read")
        staged = [StagedModule(n, self.model.get_submodule(n), metadata[n], baked.staged[n], self.paths[n])
                  for n in self.paths]
        self._plan = _Plan(fingerprint, baked, staged)
        return self._plan

    def _buffers(self, plan: _Plan, keys: Mapping[str, tuple[tuple, str]]) -> dict[str, Any]:
        """HF name -> Shard views (in place and staging), each checked against what is published."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        shapes = {n: s for n, (s, _) in keys.items()}
        views: dict[str, list[astate_store.Shard]] = {}
        for p in plan.baked.pieces:
            views.setdefault(p.hf, []).append(astate_store.Shard(p.view(params[p.param].data), p.offsets,
                                                                 shapes[p.hf]))
        for s in plan.staged:
            for hf, shard in s.buffers(shapes):
                views.setdefault(hf, []).append(shard)
        for hf, shards in views.items():
            dtype = keys[hf][1]
            for shard in shards:
                if not (shard.tensor.dtype.is_floating_point and dtype.startswith(("float", "bfloat"))) and \
                        str(shard.tensor.dtype).replace("torch.", "") != dtype:
                    raise LayoutError(f"astate: published {hf!r} is {dtype}, the engine holds {shard.tensor.dtype}")
        return {hf: (shards[0] if len(shards) == 1 else shards) for hf, shards in views.items()}

    def _pull(self, buffers: Mapping[str, Any], info: AstateUpdateInfo, step: int, timeout: float) -> int:
        assert self.store is not None
        if info.checkpoint is not None:
            return self.store.restore(buffers, uri=info.checkpoint, step=step)
        got = self.store.get_into(buffers, step=step, timeout=timeout)
        newest = _all_max(got)
        while got < newest:  # another worker pulled a newer version: follow it
            got = self.store.get_into(buffers, step=newest, timeout=timeout)
            newest = _all_max(got)
        return got

    def _agreed(self, fn: Any) -> Any:
        """``fn()`` on every worker; if it failed on any, raise on all (so none moves a byte), each
        with the first failing worker's message."""
        err: BaseException | None = None
        try:
            out = fn()
        except (AStateError, ValueError, KeyError, RuntimeError) as exc:
            err = exc
        group = _world()
        if group is None:
            if err is not None:
                raise err
            return out
        msgs: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(msgs, None if err is None else f"{type(err).__name__}: {err}",
                                            group=group.cpu_group)
        if err is not None:
            raise err
        failed = [(rank, m) for rank, m in enumerate(msgs) if m is not None]
        if failed:
            rank, msg = failed[0]
            raise UpdateError(f"astate: worker {rank} refused the update, so no worker changed its weights: {msg}")
        return out


def _world() -> Any:
    from vllm.distributed.parallel_state import get_world_group

    try:
        group = get_world_group()
    except AssertionError:
        return None
    return group if group.world_size > 1 else None


def _all_max(value: int) -> int:
    """The maximum of ``value`` over this engine's workers (itself alone without a group)."""
    group = _world()
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return int(t.item())


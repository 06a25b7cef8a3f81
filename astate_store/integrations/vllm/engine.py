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
   d. one ``get_into`` (or ``restore``) pulls this worker's TP/EP slice of that version (agreed too:
      if it fails on one worker, every worker raises);
   e. the workers agree on the step; a worker behind pulls again at the newest;
   f. staged modules are post-processed by vLLM and copied in (:mod:`.staged`).
4. ``finish_weight_update()``: nothing left to do (vLLM records the weight version).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import astate_store
from astate_store.errors import AStateError, LayoutError, WaitTimeout
from astate_store.integrations.vllm.bake import Baked, bake
from astate_store.integrations.vllm.paths import decide, pre_processing_metadata, tied_followers
from astate_store.integrations.vllm.staged import StagedModule, refresh

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
        self.paths: dict[str, str] = {}  # staged module -> why
        self.followers: dict[str, str] = {}  # staged module tied to another's parameters -> that module
        self._plan: _Plan | None = None
        self.last_step: int | None = None
        self.last_seconds: dict[str, float] = {}

    # ---- the four phases --------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: AstateInitInfo) -> None:
        try:
            self._agreed(lambda: self._init(init_info))
        except _Refused:
            pass  # another worker raises the error; init has no session to end

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        try:  # refused later, together with the other workers (see _agreed)
            return super().parse_init_info(init_dict)
        except ValueError as exc:
            return _BadInfo(LayoutError(f"astate init_info {init_dict!r}: {exc}"))

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        try:
            return super().parse_update_info(update_dict)
        except ValueError as exc:
            return _BadInfo(LayoutError(f"astate update_info {update_dict!r}: {exc}"))

    def _init(self, init_info: AstateInitInfo) -> None:
        if isinstance(init_info, _BadInfo):
            raise init_info.error
        if not isinstance(init_info.namespace, str) or not init_info.namespace:
            raise LayoutError(
                f"astate init_info: 'namespace' must be a non-empty string, got {init_info.namespace!r}"
            )
        if self.store is not None:
            self.store.close()
            self.store = None
        self.timeout = float(init_info.timeout)
        # a consumer: rank / world size are publisher settings, not this worker's vLLM rank
        self.store = astate_store.connect(init_info.namespace, etcd=init_info.etcd, rank=0, world_size=1)
        self.paths = decide(self.model)
        self.followers = tied_followers(self.model, self.paths)
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
        t0 = time.perf_counter()
        timeout = self.timeout if update_info.timeout is None else float(update_info.timeout)
        # every step that can fail on one worker and not another is agreed on (a collective), so all
        # workers refuse together and none waits for another that left
        try:
            step, plan, buffers = self._agreed(lambda: self._prepare(update_info, timeout))
        except BaseException:
            for s in self._plan.staged if self._plan is not None else ():
                s.drop()  # refused elsewhere after this worker allocated its staging
            raise
        t1 = time.perf_counter()
        try:
            got = self._agreed(lambda: self._pull(buffers, update_info, step, timeout))
            newest = _all_max(got)
            while got < newest:  # another worker pulled a newer version: follow it
                got = self._agreed(lambda: self.store.get_into(buffers, step=newest, timeout=timeout))
                newest = _all_max(got)
            t2 = time.perf_counter()
            for s in plan.staged:
                s.commit(self.model_config)
            for name in self.followers:  # tied to a module just committed (or written in place)
                refresh(self.model.get_submodule(name), self.model_config)
        finally:
            for s in plan.staged:
                s.drop()
        self.last_step = got
        self.last_seconds = {"prepare": t1 - t0, "pull": t2 - t1, "staged": time.perf_counter() - t2}
        log.info(
            "astate: step %d (%d staged modules) in %.3fs", got, len(plan.staged), time.perf_counter() - t0
        )

    def _prepare(self, info: AstateUpdateInfo, timeout: float) -> tuple[int, _Plan, dict[str, Any]]:
        if isinstance(info, _BadInfo):
            raise info.error
        if self.store is None:
            raise LayoutError(
                "astate: call init_weight_transfer_engine({'namespace': ...}) before update_weights"
            )
        step, keys = self._published(info, timeout)
        plan = self._plan_for(keys)
        return step, plan, self._buffers(plan, keys)

    # ---- steps ------------------------------------------------------------------------------------

    def _published(self, info: AstateUpdateInfo, timeout: float) -> tuple[int, dict[str, tuple[tuple, str]]]:
        """The step to pull and what it publishes: name -> (global shape, dtype name)."""
        assert self.store is not None
        if info.step is not None and (
            isinstance(info.step, bool) or not isinstance(info.step, int) or info.step < 0
        ):
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
            raise WaitTimeout(
                f"astate namespace {self.store.namespace!r}: {want} was not committed within "
                f"{timeout:g}s (newest: {self.store.latest()})"
            ) from exc
        keys = {n: (tuple(k.global_shape), k.dtype) for n, k in self.store.keys(step).items()}
        return step, keys

    def _plan_for(self, keys: Mapping[str, tuple[tuple, str]]) -> _Plan:
        fingerprint = tuple(sorted((n, s) for n, (s, _) in keys.items()))
        if self._plan is not None and self._plan.fingerprint == fingerprint:
            return self._plan
        metadata = {
            name: pre_processing_metadata(self.model.get_submodule(name))
            for name in self.paths
            if name not in self.followers
        }
        missing = [n for n, m in metadata.items() if not m]
        if missing:
            raise LayoutError(
                f"astate: modules {missing} are transformed after loading ({self.paths[missing[0]]}) "
                "but vLLM recorded no pre-processing format for them"
            )
        baked = bake(self.model, {n: s for n, (s, _) in keys.items()}, metadata)
        if baked.unwritten:
            raise LayoutError(
                f"astate: no published tensor writes parameter {baked.unwritten[0]!r} "
                f"({len(baked.unwritten)} in all: {baked.unwritten[:5]}); the published names do "
                f"not match what {type(self.model).__name__}'s loaders read"
            )
        staged = [
            StagedModule(n, self.model.get_submodule(n), metadata[n], baked.staged[n], self.paths[n])
            for n in metadata
        ]
        self._plan = _Plan(fingerprint, baked, staged)
        return self._plan

    def _buffers(self, plan: _Plan, keys: Mapping[str, tuple[tuple, str]]) -> dict[str, Any]:
        """HF name -> Shard views (in place and staging), each checked against what is published."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        shapes = {n: s for n, (s, _) in keys.items()}
        views: dict[str, list[astate_store.Shard]] = {}
        for p in plan.baked.pieces:
            views.setdefault(p.hf, []).append(
                astate_store.Shard(p.view(params[p.param].data), p.offsets, shapes[p.hf])
            )
        for s in plan.staged:
            for hf, shard in s.buffers(shapes):
                views.setdefault(hf, []).append(shard)
        for hf, shards in views.items():
            dtype = keys[hf][1]
            for shard in shards:
                if (
                    not (shard.tensor.dtype.is_floating_point and dtype.startswith(("float", "bfloat")))
                    and str(shard.tensor.dtype).replace("torch.", "") != dtype
                ):
                    raise LayoutError(
                        f"astate: published {hf!r} is {dtype}, the engine holds {shard.tensor.dtype}"
                    )
        return {hf: (shards[0] if len(shards) == 1 else shards) for hf, shards in views.items()}

    def _pull(self, buffers: Mapping[str, Any], info: AstateUpdateInfo, step: int, timeout: float) -> int:
        assert self.store is not None
        if info.checkpoint is not None:
            return self.store.restore(buffers, uri=info.checkpoint, step=step)
        return self.store.get_into(buffers, step=step, timeout=timeout)

    def _agreed(self, fn: Any) -> Any:
        """``fn()`` on every worker; if it failed on any, every worker refuses (none moves a byte).

        The refusal is raised by the *last* worker only, with the first failing worker's message; the
        others raise :class:`_Refused` (caught in :meth:`update_weights`: they end the session quietly).
        vLLM's multiproc executor stops reading replies at the first worker error, so an error from an
        earlier worker would leave the later workers' replies queued, answering the next call instead.
        """
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
        torch.distributed.all_gather_object(
            msgs, None if err is None else f"{type(err).__name__}: {err}", group=group.cpu_group
        )
        failed = [(rank, m) for rank, m in enumerate(msgs) if m is not None]
        if not failed:
            return out
        if group.rank_in_group != group.world_size - 1:
            raise _Refused()
        if err is not None and failed[0][0] == group.rank_in_group:
            raise err
        rank, msg = failed[0]
        raise UpdateError(
            f"astate: worker {rank} refused the update, so no worker changed its weights: {msg}"
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            super().update_weights(update_info)
        except _Refused:
            _end_worker_session(self)


@dataclass
class _BadInfo:
    """An init or update dict that does not parse: refused together with the other workers."""

    error: LayoutError


class _Refused(Exception):
    """This worker refuses along with another one, which raises the error (see ``_agreed``)."""


def _end_worker_session(engine: AstateWeightTransferEngine) -> None:
    """End the vLLM worker's update session as its ``update_weights`` does on an error (this worker
    returns normally so that the executor's replies stay aligned; see ``_agreed``)."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if getattr(owner, "weight_transfer_engine", None) is engine and hasattr(
            owner, "_weight_update_active"
        ):
            owner._weight_update_active = False
            engine.reset_weight_update_target()
            return
        frame = frame.f_back
    log.warning(
        "astate: refused update: the vLLM worker that called it was not found; its session stays open"
    )


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

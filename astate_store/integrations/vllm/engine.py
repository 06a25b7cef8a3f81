"""The ``astate`` weight-transfer engine on vLLM's workers.

Selected with ``weight_transfer_config={"backend": "astate"}`` (``--weight-transfer-config`` for
``vllm serve``) once astate-store is installed: the ``vllm.general_plugins`` entry point registers it
in every vLLM process. Driven by vLLM's four phases:

1. ``init_weight_transfer_engine({"namespace": NS, "etcd": ..., "timeout": ..., "delta": True})``:
   connect to the namespace (a consumer of delta versions unless ``delta`` is false); decide per module
   whether it is written in place or staged (:mod:`.paths`).
2. ``start_weight_update()``: nothing to prepare.
3. ``update_weights({"step": N})`` (the newest committed version >= N; ``{}``: the newest committed)
   or ``{"checkpoint": URI, "step": N}`` (cold start from an astate checkpoint, no trainer needed):
   a. list what the version publishes (names, global shapes, dtypes);
   b. bake once per published set: learn each parameter's boxes from vLLM's loaders (:mod:`.bake`);
   c. build the buffers: in-place views of the live parameters, staging views for staged modules;
      validate names, shapes and dtypes on every worker and agree (a collective) before any byte moves.
      With delta versions the buffers are kept from one update to the next (the staged modules' staging
      too, unless ``keep_staging`` is false), so that the pull moves only what changed since the
      version they hold;
   d. one ``get_into`` (or ``restore``) pulls this worker's TP/EP slice of that version (agreed too:
      if it fails on one worker, every worker raises);
   e. the workers agree on the step; a worker behind pulls again at the newest;
   f. staged modules are post-processed by vLLM and copied in (:mod:`.staged`).
4. ``finish_weight_update()``: nothing left to do (vLLM records the weight version).

Delta pulls (docs/delta.md): the engine owns its buffers, so it promises the store that they hold the
version it last delivered, and breaks the promise (``Store.forget``: the next update moves every byte)
whenever something else may have written them: vLLM's ``reset_weights`` and ``reload_weights`` (a load
from disk; the worker's methods are wrapped to say so, :func:`watch_worker_writes`), a cold start from a
checkpoint, an update that failed or was refused, and ``collective_rpc("weight_transfer_engine",
args=("forget",))`` for any other write.

``update_info["phase"]`` (default ``"now"``, the steps above) splits an update around serving
(:mod:`.prepared`): ``"begin"`` resolves and checks the version as in 3a-3c, starts the pull and the
post-processing that can run ahead on a thread, and returns while the engine keeps serving the old
weights; ``"apply"`` (during a pause) waits for it, agrees across workers and swaps the new weights in;
``"cancel"`` drops it. Calling the engine (``collective_rpc("weight_transfer_engine")``: vLLM resolves a
method name on the worker and calls the result) returns its state (:meth:`__call__`); the caller-side
helpers (:mod:`.clients`) use it to learn the step served and whether a preparation is ready.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

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
from astate_store.integrations.vllm.prepared import Prepared
from astate_store.integrations.vllm.served import served_digests
from astate_store.integrations.vllm.staged import StagedModule, refresh

__all__ = [
    "AstateInitInfo",
    "AstateUpdateInfo",
    "AstateWeightTransferEngine",
    "NotReady",
    "UpdateError",
    "watch_worker_writes",
]

PHASES = ("now", "begin", "apply", "cancel")

log = logging.getLogger("astate_store.integrations.vllm")


class UpdateError(LayoutError):
    """A weight update refused before any byte moved (on this or another worker); the engine keeps
    its weights."""


class NotReady(UpdateError):
    """``apply`` found the update prepared with ``begin`` still running on a worker; it keeps running and
    the engine keeps its weights (apply again later)."""


@dataclass
class AstateInitInfo(WeightTransferInitInfo):
    namespace: str
    etcd: str | list[str] | None = None  # None: $ASTATE_ETCD* of the vLLM processes (credentials too)
    timeout: float = 60.0  # seconds to wait for a version to commit
    delta: bool = True  # pull delta versions: only what changed since the version the buffers hold
    # keep the staging between updates (staged modules' in blocking updates, a prepared update's all of
    # it; see prepared.py), so that the next pull into it is a delta; None: whenever ``delta`` is on
    keep_staging: bool | None = None
    # with delta: "bytes" (through the changes whenever they are fewer bytes) or "time" (only when this
    # worker measured that faster than a whole pull: on one host a whole pull is a memory copy)
    delta_choice: str = "bytes"


@dataclass
class AstateUpdateInfo(WeightTransferUpdateInfo):
    step: int | None = None  # the oldest acceptable step (None: the newest committed)
    checkpoint: str | None = None  # cold start: fill from the newest astate checkpoint under this URI
    timeout: float | None = None  # overrides init's timeout for this update (apply: how long to wait)
    phase: str = "now"  # "now" | "begin" (prepare while serving) | "apply" (swap it in) | "cancel"


@dataclass
class _Plan:
    """What one published set maps to on this worker."""

    fingerprint: tuple
    baked: Baked
    staged: list[StagedModule]


@dataclass
class _Held:
    """The buffers of the last blocking update, kept for the next one (delta versions): the store counts
    them as holding the version it delivered while they are the very same objects."""

    key: tuple  # (plan fingerprint, id of the model): what they were built for
    buffers: dict[str, Any]  # HF name -> Shard views (in place and staging)
    live: list[tuple[torch.Tensor, int, tuple[int, ...]]]  # parameter viewed in place, its address, shape

    def valid(self, key: tuple) -> bool:
        """Built for this plan and model, and every live parameter still where the views point."""
        return key == self.key and all(p.data_ptr() == a and tuple(p.shape) == s for p, a, s in self.live)


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
        self._pending: Prepared | None = None  # an update prepared with phase "begin"
        self._fingerprint: tuple = ()  # of the published set the pending update pulls
        self.delta = True
        self.keep_staging = False
        self._kept: tuple[tuple, Any] | None = None  # (plan fingerprint, staging) holding the version served
        self._held: _Held | None = None  # the blocking updates' buffers, kept for delta pulls
        self.touched = False  # a blocking pull failed after bytes may have moved into live parameters
        watch_worker_writes()

    def __call__(self, what: str = "status") -> dict[str, Any]:
        """For ``collective_rpc("weight_transfer_engine", args=(what,))`` (vLLM resolves the name on the
        worker and calls it: no function serialized; ``/collective_rpc`` over HTTP). ``"status"``: the step
        served, ``touched`` (a failed blocking pull left parameters partly written), ``pending`` (the
        update being prepared: ``step``, ``ready``, ``running``, ``error``, ``staging_bytes``),
        ``prefix_caching``, ``multimodal``, the last update's seconds, ``pulls`` (``delta``: pulls served
        as deltas, ``all``, ``bytes`` read, of this engine's store) and ``kept_bytes`` (staging kept
        between updates). ``"served"``: parameter -> SHA-256 of what this worker computes with
        (:mod:`.served`). ``"forget"``: the weights were written another way; the next update moves
        every byte (:meth:`forget`)."""
        if what == "served":
            return served_digests(self._default_model)
        if what == "forget":
            self.forget()
            return {"forgotten": True}
        if what != "status":
            raise ValueError(f"astate engine: unknown query {what!r} (known: 'status', 'served', 'forget')")
        stats = None if self.store is None else self.store.stats
        return {
            "step": self.last_step,
            "touched": self.touched,
            "prefix_caching": bool(self.vllm_config.cache_config.enable_prefix_caching),
            "multimodal": bool(getattr(self._default_model_config, "is_multimodal_model", False)),
            "pending": None if self._pending is None else self._pending.status(),
            "seconds": dict(self.last_seconds),
            "pulls": None
            if stats is None
            else {"delta": stats.delta_pulls, "all": stats.pulls, "bytes": stats.pull_bytes},
            "kept_bytes": self._kept_bytes(),
        }

    def forget(self) -> None:
        """The engine's weights were written another way: the next update moves every byte (its buffers
        no longer hold the version the store delivered into them)."""
        if self.store is not None:
            self.store.forget()

    def _kept_bytes(self) -> int:
        staging = [] if self._held is None or self._plan is None else self._plan.staged
        n = sum(t.numel() * t.element_size() for s in staging for t in s.staging.values())
        if self._kept is not None:
            staging_, modules, _views = self._kept[1]
            n += sum(t.numel() * t.element_size() for t in staging_.values())
            n += sum(t.numel() * t.element_size() for ts in modules.values() for t in ts.values())
        return n

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
        self._drop_pending()
        if self.store is not None:
            self.store.close()
            self.store = None
        self.timeout = float(init_info.timeout)
        self.delta = bool(init_info.delta)
        keep = init_info.keep_staging
        self.keep_staging, self._kept, self._held = self.delta if keep is None else bool(keep), None, None
        # a consumer: rank / world size are publisher settings, not this worker's vLLM rank
        self.store = astate_store.connect(
            init_info.namespace,
            etcd=init_info.etcd,
            rank=0,
            world_size=1,
            delta=self.delta,
            delta_choice=init_info.delta_choice,
        )
        self.paths = decide(self.model)
        self.followers = tied_followers(self.model, self.paths)
        self._plan = None
        log.info("astate: namespace %s; staged modules: %s", init_info.namespace, self.paths or "none")

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        self._drop_pending()
        if self.store is not None:
            self.store.close()
            self.store = None
        self._plan = None

    def receive_weights(self, update_info: AstateUpdateInfo) -> None:
        phase = getattr(update_info, "phase", "now")  # an info that did not parse is refused by "now"
        if phase == "begin":
            self._begin(update_info)
        elif phase == "apply":
            self._apply(update_info)
        elif phase == "cancel":
            self._drop_pending()
        else:
            self._now(update_info)

    def _timeout(self, info: Any) -> float:
        t = getattr(info, "timeout", None)
        return self.timeout if t is None else float(t)

    def _now(self, update_info: AstateUpdateInfo) -> None:
        t0 = time.perf_counter()
        timeout = self._timeout(update_info)
        # every step that can fail on one worker and not another is agreed on (a collective), so all
        # workers refuse together and none waits for another that left
        try:
            step, plan, buffers = self._agreed(lambda: self._prepare(update_info, timeout))
        except BaseException:
            self.forget()  # refused (elsewhere after this worker allocated its staging): whole next time
            self._drop_held()
            raise
        t1 = time.perf_counter()
        self._kept = None  # the live weights change without it: it no longer holds the version served
        self.touched = bool(plan.baked.pieces)  # from here a failed pull may leave live parameters torn
        keep = self._held is not None and self._held.buffers is buffers
        try:
            got = self._agreed(lambda: self._pull(buffers, update_info, step, timeout))
            got = self._follow(got, lambda newest: self.store.get_into(buffers, step=newest, timeout=timeout))
            t2 = time.perf_counter()
            for s in plan.staged:
                s.commit(self.model_config, keep=keep)
            for name in self.followers:  # tied to a module just committed (or written in place)
                refresh(self.model.get_submodule(name), self.model_config)
        except BaseException:
            self.forget()
            self._drop_held()
            raise
        finally:
            if not keep:
                for s in plan.staged:
                    s.drop()
        self.touched = False
        self.last_step = got
        self.last_seconds = {"prepare": t1 - t0, "pull": t2 - t1, "staged": time.perf_counter() - t2}
        log.info(
            "astate: step %d (%d staged modules) in %.3fs", got, len(plan.staged), time.perf_counter() - t0
        )

    def _prepare(self, info: AstateUpdateInfo, timeout: float) -> tuple[int, _Plan, dict[str, Any]]:
        step, plan, keys = self._resolve(info, timeout)
        key = (plan.fingerprint, id(self.model))
        if self._held is not None and self._held.valid(key):
            return step, plan, self._held.buffers  # the very buffers of the last update: a delta pull
        self._drop_held()
        buffers = self._buffers(plan, keys)
        if self.delta and (self.keep_staging or not plan.staged):
            params = dict(self.model.named_parameters(remove_duplicate=False))
            live = {p.param: params[p.param] for p in plan.baked.pieces}
            self._held = _Held(key, buffers, [(t, t.data_ptr(), tuple(t.shape)) for t in live.values()])
        return step, plan, buffers

    def _drop_held(self) -> None:
        """Drop the blocking updates' kept buffers and staging (the next one allocates anew)."""
        self._held = None
        for s in self._plan.staged if self._plan is not None else ():
            s.drop()

    def _resolve(
        self, info: AstateUpdateInfo, timeout: float
    ) -> tuple[int, _Plan, dict[str, tuple[tuple, str]]]:
        """The step, its plan (baked once per published set) and what it publishes; refuses bad input."""
        if isinstance(info, _BadInfo):
            raise info.error
        if info.phase not in PHASES:
            raise LayoutError(f"astate update_info: 'phase' must be one of {PHASES}, got {info.phase!r}")
        if self.store is None:
            raise LayoutError(
                "astate: call init_weight_transfer_engine({'namespace': ...}) before update_weights"
            )
        if self._pending is not None:
            raise UpdateError(
                f"astate: an update prepared with phase 'begin' (step {self._pending.step}) is pending: "
                "apply or cancel it first"
            )
        step, keys = self._published(info, timeout)
        return step, self._plan_for(keys), keys

    def _follow(self, got: int, pull: Any) -> int:
        """Every worker ends on the newest step any of them pulled: those behind pull it again (all
        workers take part in each round, as the agreement is a collective)."""
        while True:
            steps = _gather(got)
            newest = max(steps)
            if min(steps) == newest:
                return got
            got = self._agreed(lambda: pull(newest) if got < newest else got)

    # ---- prepared while serving (phases "begin", "apply", "cancel"; see prepared.py) ----------------

    def _begin(self, info: AstateUpdateInfo) -> None:
        timeout = self._timeout(info)

        def resolve() -> tuple[int, _Plan, dict[str, tuple[tuple, str]]]:
            step, plan, keys = self._resolve(info, timeout)
            if info.checkpoint is not None:
                raise LayoutError("astate: a cold start from a checkpoint is a blocking update (phase 'now')")
            _check_views(self.model, plan, keys)
            return step, plan, keys

        t0 = time.perf_counter()
        try:
            step, plan, keys = self._agreed(resolve)
        except BaseException:
            self.forget()
            raise
        assert self.store is not None
        self._drop_held()  # the preparation pulls into buffers of its own; the blocking path's go
        kept, self._kept = self._kept, None  # the preparation owns it now (dropped if it fails)
        self._pending = Prepared(
            step=_all_max(step),
            model=self.model,
            model_config=self.model_config,
            staged=plan.staged,
            pieces=plan.baked.pieces,
            followers=self.followers,
            shapes={n: s for n, (s, _) in keys.items()},
            store=self.store,
            timeout=timeout,
            keep=self.keep_staging,
            reuse=kept[1] if kept is not None and kept[0] == plan.fingerprint else None,
        )
        self._pending.start()
        self._fingerprint = plan.fingerprint
        self.last_seconds = {"begin": time.perf_counter() - t0}

    def _apply(self, info: AstateUpdateInfo) -> None:
        t0 = time.perf_counter()
        pending = self._pending
        states = _gather(_state(pending, self._timeout(info)))
        failed = [(r, m) for r, (kind, m) in enumerate(states) if kind == "failed"]
        if failed:
            self._drop_pending()
            _refuse(failed, None)
        waiting = [(r, m) for r, (kind, m) in enumerate(states) if kind == "running"]
        if waiting:
            _refuse(waiting, None, NotReady, "the engine keeps its weights and the preparation goes on")
        assert pending is not None and pending.got is not None
        t1 = time.perf_counter()
        try:
            got = self._follow(pending.got, lambda newest: (pending.again(newest), pending.got)[1])
            t2 = time.perf_counter()
            kept = self._agreed(pending.swap)
        except BaseException:
            self._drop_pending()
            raise
        self._pending = None
        self._kept = None if kept is None else (self._fingerprint, kept)
        self.last_step = got
        self.last_seconds = {
            **{f"background_{k}": v for k, v in pending.seconds.items()},
            "wait": t1 - t0,
            "follow": t2 - t1,
            "swap": time.perf_counter() - t2,
        }
        log.info("astate: step %d applied in %.3fs", got, time.perf_counter() - t0)

    def _drop_pending(self) -> None:
        if self._pending is not None:
            self._pending.drop()
            self._pending = None
            self.forget()  # a failed or cancelled preparation: the next update moves every byte

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
            for shard in shards:
                _check_dtype(hf, keys[hf][1], shard.tensor.dtype)
        return {hf: (shards[0] if len(shards) == 1 else shards) for hf, shards in views.items()}

    def _pull(self, buffers: Mapping[str, Any], info: AstateUpdateInfo, step: int, timeout: float) -> int:
        assert self.store is not None
        if info.checkpoint is not None:
            self.store.forget()  # a restore writes them behind the store's back
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
        out = None
        try:
            out = fn()
        except (AStateError, ValueError, KeyError, RuntimeError) as exc:
            err = exc
        msgs = _gather(None if err is None else f"{type(err).__name__}: {err}")
        failed = [(rank, m) for rank, m in enumerate(msgs) if m is not None]
        if failed:
            _refuse(failed, err)
        return out

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


_WRITERS = ("reset_weights", "reload_weights")  # vLLM worker methods that write every weight


def watch_worker_writes() -> None:
    """Wrap vLLM's worker methods that write every weight (``reset_weights``, ``reload_weights``: a load
    from disk) so that they first tell the worker's astate engine to forget (its next update moves every
    byte: its buffers no longer hold what it delivered). Once per process; they behave as before."""
    from vllm.v1.worker.gpu_worker import Worker

    for name in _WRITERS:
        fn = getattr(Worker, name, None)
        if fn is not None and not getattr(fn, "_astate_forgets", False):
            setattr(Worker, name, _forgetting(fn))


def _forgetting(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(worker: Any, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(worker, "weight_transfer_engine", None)
        if isinstance(engine, AstateWeightTransferEngine):
            engine.forget()
        return fn(worker, *args, **kwargs)

    wrapper._astate_forgets = True  # type: ignore[attr-defined]
    return wrapper


def _check_views(model: torch.nn.Module, plan: _Plan, keys: Mapping[str, tuple[tuple, str]]) -> None:
    """The checks of ``_buffers`` without allocating: staged modules viewed on their metadata."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for p in plan.baked.pieces:
        _check_dtype(p.hf, keys[p.hf][1], params[p.param].dtype)
    for s in plan.staged:
        for p in s.pieces:
            local = p.param[len(s.name) + 1 :] if s.name else p.param
            _check_dtype(p.hf, keys[p.hf][1], s.metadata[local].dtype)


def _state(pending: Prepared | None, timeout: float) -> tuple[str, Any]:
    """This worker's side of an apply: ("ready", step pulled), ("running", why) or ("failed", why)."""
    if pending is None:
        return ("failed", "no update was prepared: call update_weights with phase 'begin' first")
    if not pending.wait(timeout):
        return ("running", f"the update for step {pending.step} is still being prepared")
    if pending.error is not None:
        return ("failed", f"preparing step {pending.step}: {type(pending.error).__name__}: {pending.error}")
    return ("ready", pending.got)


def _check_dtype(hf: str, published: str, held: torch.dtype) -> None:
    """A floating tensor converts on pull; any other must match exactly."""
    if (
        not (held.is_floating_point and published.startswith(("float", "bfloat")))
        and str(held).replace("torch.", "") != published
    ):
        raise LayoutError(f"astate: published {hf!r} is {published}, the engine holds {held}")


def _gather(value: Any) -> list[Any]:
    """``value`` of every worker of this engine, by rank (a collective; itself alone without a group)."""
    group = _world()
    if group is None:
        return [value]
    out: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(out, value, group=group.cpu_group)
    return out


def _refuse(
    failed: list[tuple[int, str]],
    err: BaseException | None,
    cls: type[UpdateError] = UpdateError,
    outcome: str = "so no worker changed its weights",
) -> NoReturn:
    """Raise the agreed refusal: on the last worker (see ``_agreed``), this worker's own error if it was
    the first to fail, else ``cls`` naming the first failing worker; :class:`_Refused` on the others."""
    group = _world()
    rank, last = (0, 0) if group is None else (group.rank_in_group, group.world_size - 1)
    if rank != last:
        raise _Refused()
    if err is not None and failed[0][0] == rank:
        raise err
    who, msg = failed[0]
    raise cls(f"astate: worker {who} refused the update, {outcome}: {msg}")


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

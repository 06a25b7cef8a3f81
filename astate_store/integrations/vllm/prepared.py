"""An update prepared while the engine serves (phase ``begin``), swapped in during a short pause (``apply``).

The live parameters are never written before ``apply``: everything the pull writes lands in staging, so a
failed or cancelled preparation leaves the engine exactly as it was.

1. ``begin`` (:meth:`AstateWeightTransferEngine._begin`, in the worker's update call): the version, its
   plan and the views are resolved and checked on every worker as for a blocking update (agreed: all
   workers refuse together); then :meth:`Prepared.start` hands the rest to one thread and returns:
   a. :meth:`_allocate`: staging for every parameter the pull writes: a parameter written in place gets a
      copy of the live one (elements no published tensor writes, such as vocabulary padding rows, keep
      their values); a staged module gets tensors of its pre-processing format (zeros, as a first load);
   b. one ``store.get_into`` of this worker's slice into the staging views (the same call, and the same
      buffers from one pull to the next of a staged set, as a blocking update makes);
   c. :meth:`_ahead`: vLLM's post-processing of each staged module whose quant method only sets attributes
      of its own module (:data:`~.paths.IN_PLACE_METHODS`: on CPU the GEMM prepack) runs on a *shadow*:
      a second module object with the live one's attributes and its own parameter dict, holding the
      staging, so the live module is not touched; tied followers (``lm_head``) run after their owner,
      on the owner's new parameter.
   Nothing in the thread is collective: the workers agree at ``apply``.
2. ``apply`` (the caller has paused the engine): every worker reports ready / failed / still running
   (gathered); a failure anywhere drops every worker's preparation and refuses (old weights kept); a
   worker that pulled an older step than another pulls again at the newest; then :meth:`swap`:
   a. *late* modules (post-processing that changes shared state, e.g. the CPU MoE repack resets its
      quant method's kernel) are post-processed now, from their staging, as the blocking path does;
   b. parameters written in place are copied from their staging into the live storage;
   c. each shadow's result moves into its live module: parameters copied into the live storage where
      shape and dtype match (addresses kept), attributes (the prepacked GEMM's closure) replaced.
   One ``apply`` call is one message to every worker, between two forward passes: no forward pass sees
   two versions.
3. ``cancel``: wait for the thread, drop everything.

Memory beyond the live weights, from ``begin`` to the end of ``apply``: the staging of every parameter
the pull writes, in the loaders' format (about one copy of this worker's slice of the model). After a
staged module's post-processing ran ahead, its staging is released and its new kernel copy (a prepacked
weight, the same size) is held instead, so the total stays about one copy plus one module; ``apply``
releases the old kernel copies and the staging.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from astate_store import Shard
from astate_store.integrations.vllm.bake import Piece
from astate_store.integrations.vllm.paths import IN_PLACE_METHODS
from astate_store.integrations.vllm.staged import StagedModule, post_process

__all__ = ["Kept", "Prepared", "ahead_safe"]

log = logging.getLogger("astate_store.integrations.vllm")

# the preparation's thread runs this much nicer than the worker (Linux: per thread; the threads it starts for
# its copies and prepacks inherit it), so that the serving forward passes get the cores first
NICE = 10
_MODULE_STATE = ("_parameters", "_buffers", "_modules")  # dicts a shadow owns or shares deliberately
_MISSING = object()

# what ``keep`` holds from one apply to the next preparation: in-place staging (live parameter name ->
# tensor), staged modules' staging (module -> parameter -> tensor) and the views the pull wrote through
Kept = tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, list[Shard]]]


def ahead_safe(module: torch.nn.Module) -> bool:
    """Whether the module's post-processing sets attributes of that module only (so it can run on a
    shadow while the live module serves): the unquantized linear / embedding methods, whose CPU
    post-processing dispatches (and prepacks) the layer's GEMM."""
    method = getattr(module, "quant_method", None)
    return method is not None and type(method).__name__ in IN_PLACE_METHODS


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _dressed(t: torch.Tensor, like: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """``t`` as a parameter of ``like``'s class and attributes (a recorded weight loader bound to
    ``module``: vLLM's metadata holds it unbound)."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    t.__class__ = like.__class__
    t.__dict__ = like.__dict__.copy()
    return restore_layer_refs(t, module)


@dataclass
class Prepared:
    """One update being prepared on one worker (see the module doc)."""

    step: int  # the step resolved at begin (agreed: the workers' newest); the pull delivers it or newer
    model: torch.nn.Module
    model_config: Any
    staged: list[StagedModule]  # the plan's staged modules
    pieces: list[Piece]  # the plan's in-place pieces (live parameter names)
    followers: Mapping[str, str]  # staged module tied to another's parameters -> that module
    shapes: Mapping[str, tuple[int, ...]]  # published HF name -> global shape
    store: Any
    timeout: float
    keep: bool = False  # keep the staging after apply (same tensors next time: a delta pull applies to them)
    reuse: Kept | None = None  # kept by the last apply: it holds the version served
    staging: dict[str, torch.Tensor] = field(default_factory=dict)  # live parameter name -> its staging
    modules: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # staged module -> its staging
    views: dict[str, list[Shard]] = field(default_factory=dict)  # HF name -> views into the staging
    shadows: dict[str, torch.nn.Module] = field(default_factory=dict)  # module processed ahead -> shadow
    got: int | None = None  # the step the pull delivered
    error: BaseException | None = None  # why the preparation failed (set by the thread)
    staging_bytes: int = 0  # allocated for the pull
    seconds: dict[str, float] = field(default_factory=dict)  # allocate, pull, ahead
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    # ---- the background part -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="astate-prepare", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if threading.current_thread() is self._thread:
            _nicer(NICE)
        try:
            t0 = time.perf_counter()
            buffers = self._allocate()
            t1 = time.perf_counter()
            self.got = self.store.get_into(buffers, step=self.step, timeout=self.timeout)
            del buffers  # the views: a module's staging is released once its shadow no longer needs it
            t2 = time.perf_counter()
            self._ahead()
            self.seconds = {"allocate": t1 - t0, "pull": t2 - t1, "ahead": time.perf_counter() - t2}
            log.info("astate: step %d prepared in the background (%s)", self.got, self.seconds)
        except BaseException as exc:  # reported at apply, agreed with the other workers
            self.error = exc
            log.warning("astate: preparing step %d failed: %s: %s", self.step, type(exc).__name__, exc)
        finally:
            self._done.set()

    def _allocate(self) -> dict[str, list[Shard]]:
        """Staging for everything the pull writes, and the views into it (HF name -> shards): the kept
        ones if any (they hold the version served; the very same views, so the pull is a delta)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        if self.reuse is not None:
            self.staging, self.modules, self.views = self.reuse
        else:
            self.staging = {}
            for p in self.pieces:
                if p.param not in self.staging:
                    self.staging[p.param] = params[p.param].detach().clone()
            self.modules = {
                s.name: {n: torch.zeros(tuple(m.shape), dtype=m.dtype) for n, m in s.metadata.items()}
                for s in self.staged
            }
        self.staging_bytes = sum(t.numel() * t.element_size() for t in self.staging.values()) + sum(
            t.numel() * t.element_size() for ts in self.modules.values() for t in ts.values()
        )
        if self.reuse is not None:
            return self.views
        views: dict[str, list[Shard]] = {}
        for p in self.pieces:
            views.setdefault(p.hf, []).append(
                Shard(p.view(self.staging[p.param]), p.offsets, self.shapes[p.hf])
            )
        for s in self.staged:
            for p in s.pieces:
                local = p.param[len(s.name) + 1 :] if s.name else p.param
                views.setdefault(p.hf, []).append(
                    Shard(p.view(self.modules[s.name][local]), p.offsets, self.shapes[p.hf])
                )
        self.views = views if self.keep else {}
        return views

    def _ahead(self) -> None:
        """Post-process every ahead-safe staged module on a shadow (owners first, then followers)."""
        self.shadows = {}
        params = dict(self.model.named_parameters(remove_duplicate=False))
        # id(live parameter) -> what replaces it: its staging (written in place), then a shadow's result;
        # post-processing gets aliases (``detach``), so that it cannot rebind the staging's own storage
        replaced = {
            id(params[n]): _dressed(t.detach(), params[n], self.model) for n, t in self.staging.items()
        }
        late = {s.name for s in self.staged if not ahead_safe(s.module)}
        for s in self.staged:
            if s.name not in late:
                self._shadow(s.name, s.module, s.metadata, replaced)
        for name, owner in self.followers.items():
            module = self.model.get_submodule(name)
            if ahead_safe(module) and owner not in late:
                self._shadow(name, module, {}, replaced)

    def _shadow(
        self,
        name: str,
        live: torch.nn.Module,
        metadata: Mapping[str, torch.Tensor],
        replaced: dict[int, torch.Tensor],
    ) -> None:
        """vLLM's post-processing of ``live`` run on a shadow: the same attributes, its own parameter
        and buffer dicts holding the staging; ``live`` is not touched."""
        shadow = object.__new__(type(live))
        shadow.__dict__.update(live.__dict__)
        shadow.__dict__["_parameters"] = dict(live._parameters)
        shadow.__dict__["_buffers"] = dict(live._buffers)
        for pname, p in live._parameters.items():
            if p is not None and id(p) in replaced:
                shadow._parameters[pname] = replaced[id(p)]
        # the pre-processing format; released once processed, unless kept
        staging = self.modules.get(name, {}) if self.keep else self.modules.pop(name, {})
        for pname, t in staging.items():
            shadow._parameters[pname] = _dressed(t.detach(), metadata[pname], live)
        post_process(shadow, self.model_config)
        for pname, p in live._parameters.items():
            new = shadow._parameters.get(pname)
            if p is not None and new is not None:
                replaced[id(p)] = new
        self.shadows[name] = shadow

    # ---- the caller's side ---------------------------------------------------------------------------

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self.error is None

    def again(self, step: int) -> None:
        """Prepare once more, in this thread, at ``step`` or newer (another worker pulled a newer one)."""
        self.step, self.got, self.error = step, None, None
        self._done.clear()
        self._run()
        if self.error is not None:
            raise self.error

    def swap(self) -> Kept | None:
        """Move the prepared weights into the live model (the engine is paused; see the module doc);
        returns the staging if kept (it now holds the version served)."""
        ahead = set(self.shadows)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        copied: set[int] = set()
        for name, t in self.staging.items():  # written in place (a shadow's own ones move with it)
            owner = name.rsplit(".", 1)[0] if "." in name else ""
            if owner not in ahead and id(params[name]) not in copied:
                params[name].data.copy_(t)
                copied.add(id(params[name]))
        for s in self.staged:
            if s.name not in ahead:  # late: vLLM's post-processing from the staging, on the live module
                # (on a copy when the staging is kept: a repack may work in place, and the kept staging
                # must still hold the version served in the loaders' format)
                mine = self.modules[s.name].items()
                s.staging = {n: t.clone() if self.keep else t.detach() for n, t in mine}
                s.commit(self.model_config)
        for name, shadow in self.shadows.items():
            _transplant(self.model.get_submodule(name), shadow, copied)
        for name in self.followers:
            if name not in ahead:  # its owner was late: its kernel rebuilt from the updated parameter
                post_process(self.model.get_submodule(name), self.model_config)
        kept = (self.staging, self.modules, self.views) if self.keep else None
        self.drop()
        return kept

    def drop(self) -> None:
        """Release the staging and shadows (waits for the thread, which may still be pulling into them)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.staging, self.modules, self.shadows, self.views = {}, {}, {}, {}
        for s in self.staged:
            s.drop()

    def status(self) -> dict[str, Any]:
        done = self._done.is_set()
        return {
            "step": self.step,
            "ready": done and self.error is None,
            "running": not done,
            "got": self.got,
            "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            "staging_bytes": self.staging_bytes,
            "reused": self.reuse is not None,
            "seconds": dict(self.seconds),
        }


def _nicer(by: int) -> None:
    """Lower this thread's priority (best effort: not every platform has per-thread priorities)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError):
        pass


def _transplant(live: torch.nn.Module, shadow: torch.nn.Module, copied: set[int]) -> None:
    """The shadow's post-processed state into the live module: parameters and buffers copied into the live
    storage where shape and dtype match (addresses kept: kernels and graphs may hold them), else replaced;
    other attributes (the prepacked GEMM's closure, flags) set as the shadow has them."""
    for table in ("_parameters", "_buffers"):
        mine, new_table = getattr(live, table), getattr(shadow, table)
        for pname, new in new_table.items():
            old = mine.get(pname)
            if new is None or old is new:
                continue
            if old is not None and old.shape == new.shape and old.dtype == new.dtype:
                if id(old) not in copied:
                    old.data.copy_(new.data)
                    copied.add(id(old))
            else:
                mine[pname] = new
    for key, value in shadow.__dict__.items():
        if key not in _MODULE_STATE and live.__dict__.get(key, _MISSING) is not value:
            live.__dict__[key] = value
    for key in [k for k in live.__dict__ if k not in shadow.__dict__ and k not in _MODULE_STATE]:
        del live.__dict__[key]

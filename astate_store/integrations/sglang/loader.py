"""The astate custom weight loader: SGLang's TP ranks pull their slices of a version into their
parameters, in place.

SGLang runs :func:`load` on every TP rank (its scheduler processes) when an update names it:
``update_weights_from_tensor(named_tensors=[the request], load_format=LOADER)`` inside an update
session, with ``custom_weight_loader=[LOADER]`` among the engine's settings (:mod:`.client` makes the
whole call). Per update, on each rank:

1. parse the request (:mod:`.request`); connect to its namespace (once per namespace, etcd and
   ``delta``: a consumer of delta versions by default, docs/delta.md);
2. what the version publishes: the newest committed version ``>= step`` (waiting up to ``timeout``)
   or an astate checkpoint's manifest (cold start);
3. bake, once per published set: drive the model's own ``load_weights`` with placeholders and learn
   which box of which published tensor each parameter holds (:mod:`astate_store.integrations.bake_common`);
   refuse a parameter no published tensor writes, a published tensor no parameter takes, a loader
   that transforms, and a layer SGLang computes on through an AMX-packed copy of its weight;
4. build the views (``Shard`` s of the live parameters; inside the session they are in the loaders'
   format: ``begin_weight_update`` put back what SGLang packs) and check dtypes;
5. one ``get_into`` (or ``restore``) per rank, a delta pull where the publisher records changes and
   the views still hold the version the last pull delivered (the same view objects while the
   parameters stay put; SGLang's other weight writers make the next pull whole, :func:`forgetting`);
   the ranks agree on the step, a rank behind pulls again at the newest; what the loaders fill with
   zeros from no tensor (vocabulary padding rows) is zeroed again, as a load does;
6. the model's ``post_load_weights`` (what its ``load_weights`` runs after loading: derived weights);
   SGLang's ``end_weight_update`` then post-processes as after any load, and the update call flushes
   the prefix cache.

Steps 1-4 and the pull are agreed over the TP group: if one rank refuses, every rank refuses with
that rank's message, before any byte moves (step 4) or after a pull that failed somewhere (step 5).
SGLang's scheduler dies on an exception from a custom loader, so the ``sglang.srt.plugins`` hook
(:func:`guarded`, registered by :func:`astate_store.integrations.sglang.register`) turns the error
into a failed update call: ``(False, "astate: <error>")``; a success reports ``astate: step N``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import astate_store
from astate_store.errors import LayoutError, WaitTimeout
from astate_store.integrations.bake_common import Baked, Swap, bake_with
from astate_store.integrations.sglang.request import LOADER, Request, UpdateError

__all__ = ["load", "guarded", "forgetting", "state"]

log = logging.getLogger("astate_store.integrations.sglang")

# Published names SGLang's loaders skip by design (rotary caches some checkpoints carry); any other
# published tensor that no parameter takes is refused. ``lm_head.weight`` joins them when tied.
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass
class _Plan:
    """What one published set maps to on this rank."""

    fingerprint: tuple  # (id of the model, sorted (name, global shape))
    baked: Baked
    views: dict[str, Any] = field(default_factory=dict)  # HF name -> Shard(s) of the live parameters
    addresses: tuple = ()  # the parameters' (data_ptr, shape, stride) the views were built on


class _Rank:
    """This scheduler process's astate side: its store connection and its plan."""

    def __init__(self) -> None:
        self.store: astate_store.Store | None = None
        self.source: tuple[str, str, bool, str] | None = None  # (namespace, etcd, delta, choice) of the store
        self.plan: _Plan | None = None
        self.last_step: int | None = None
        self.last_seconds: dict[str, float] = {}

    def update(self, model: torch.nn.Module, named_tensors: Any) -> int:
        t0 = time.perf_counter()
        request, step, keys = _agreed(self._published, named_tensors)
        buffers = _agreed(self._buffers, model, keys)
        t1 = time.perf_counter()
        got = _agreed(self._pull, buffers, request, step)
        newest = _all_max(got)
        while got < newest:  # another rank pulled a newer version: follow it
            got = _agreed(self.store.get_into, buffers, step=newest, timeout=request.timeout)
            newest = _all_max(got)
        t2 = time.perf_counter()
        _agreed(self._finish, model)
        self.last_step = got
        self.last_seconds = {"prepare": t1 - t0, "pull": t2 - t1, "post": time.perf_counter() - t2}
        log.info("astate: step %d in %.3fs", got, time.perf_counter() - t0)
        return got

    def _finish(self, model: torch.nn.Module) -> None:
        """What a load does once the loaders wrote: zeros where they fill zeros from no published tensor
        (vocabulary padding rows: the engine then equals a fresh one whatever those elements held),
        then the model's ``post_load_weights``."""
        assert self.plan is not None
        params = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, runs in self.plan.baked.zeroed.items():
                flat = params[name].data.view(-1)
                for start, end in runs:
                    flat[start:end].zero_()
        _post_load(model)

    def _connect(self, request: Request) -> astate_store.Store:
        source = (request.namespace, repr(request.etcd), request.delta, request.delta_choice)
        if self.store is None or self.source != source:
            if self.store is not None:  # the plan stays: it depends on the published names and shapes only
                self.store.close()
                self.store = None
            # a consumer: rank / world size are publisher settings, not this engine's TP rank
            self.store = astate_store.connect(
                request.namespace,
                etcd=request.etcd,
                rank=0,
                world_size=1,
                delta=request.delta,
                delta_choice=request.delta_choice,
            )
            self.source = source
        return self.store

    def forget(self) -> None:
        """The parameters were written another way (SGLang's own loads, its weights checker's reset,
        weights brought back to memory): the next pull moves every byte (delta versions count on the
        views holding the version the last pull delivered)."""
        if self.store is not None:
            self.store.forget()

    def _published(self, named_tensors: Any) -> tuple[Request, int, dict[str, tuple[tuple, str]]]:
        """The request, the step to pull and what it publishes: name -> (global shape, dtype name)."""
        request = Request.parse(named_tensors)
        store = self._connect(request)
        if request.checkpoint is not None:
            from astate_store.checkpoint import checkpoint_info, read_manifest

            step = checkpoint_info(request.checkpoint, request.step).step
            cols = (
                read_manifest(request.checkpoint, step).select(["name", "global_shape", "dtype"]).to_pydict()
            )
            keys = {n: (tuple(s), d) for n, s, d in zip(cols["name"], cols["global_shape"], cols["dtype"])}
            return request, step, keys
        try:
            step = store.wait(request.step, timeout=request.timeout)
        except WaitTimeout as exc:
            want = "any version" if request.step is None else f"a version >= step {request.step}"
            raise WaitTimeout(
                f"astate namespace {request.namespace!r}: {want} was not committed within "
                f"{request.timeout:g}s (newest: {store.latest()})"
            ) from exc
        return request, step, {n: (tuple(k.global_shape), k.dtype) for n, k in store.keys(step).items()}

    def _plan_for(self, model: torch.nn.Module, keys: Mapping[str, tuple[tuple, str]]) -> _Plan:
        fingerprint = (id(model), tuple(sorted((n, s) for n, (s, _) in keys.items())))
        if self.plan is not None and self.plan.fingerprint == fingerprint:
            return self.plan
        self.plan = None
        _refuse_packed(model)
        try:
            baked = bake_with(Swap(model, {}), {n: s for n, (s, _) in keys.items()}, "SGLang")
        finally:
            _post_load(model)  # derived weights computed from the placeholders: again, from the live ones
        _refuse_unmatched(model, baked)
        self.plan = _Plan(fingerprint, baked)
        return self.plan

    def _buffers(self, model: torch.nn.Module, keys: Mapping[str, tuple[tuple, str]]) -> dict[str, Any]:
        """HF name -> Shard view(s) into the live parameters, checked against what is published; the
        same view objects while the parameters stay where they are (``get_into`` then skips checks)."""
        plan = self._plan_for(model, keys)
        params = dict(model.named_parameters(remove_duplicate=False))
        addresses = tuple((n, p.data_ptr(), tuple(p.shape), p.stride()) for n, p in sorted(params.items()))
        if plan.views and plan.addresses == addresses:
            return plan.views
        views: dict[str, list[astate_store.Shard]] = {}
        for piece in plan.baked.pieces:
            shape = keys[piece.hf][0]
            shard = astate_store.Shard(piece.view(params[piece.param].data), piece.offsets, shape)
            views.setdefault(piece.hf, []).append(shard)
        for hf, shards in views.items():
            _check_dtype(hf, keys[hf][1], shards[0].tensor.dtype)
        plan.views = {hf: (shards[0] if len(shards) == 1 else shards) for hf, shards in views.items()}
        plan.addresses = addresses
        return plan.views

    def _pull(self, buffers: Mapping[str, Any], request: Request, step: int) -> int:
        assert self.store is not None
        if request.checkpoint is not None:
            return self.store.restore(buffers, uri=request.checkpoint, step=step)
        return self.store.get_into(buffers, step=step, timeout=request.timeout)


def _check_dtype(hf: str, published: str, held: torch.dtype) -> None:
    """Floats convert during the pull; anything else must match exactly."""
    if held.is_floating_point and published.startswith(("float", "bfloat")):
        return
    if str(held).replace("torch.", "") != published:
        raise LayoutError(f"astate: published {hf!r} is {published}, the engine holds {held}")


def _refuse_packed(model: torch.nn.Module) -> None:
    """A layer SGLang runs through an AMX-packed copy of its weight (CPUs with AMX): SGLang's session
    cannot put it back in the loaders' format, so neither its own loaders nor ours can update it."""
    for name, module in model.named_modules():
        if getattr(module, "use_intel_amx_backend", False):
            raise LayoutError(
                f"astate: SGLang computes {name!r} on an AMX-packed copy of its weight, which its "
                "update session cannot restore; updating it in place is not supported"
            )


def _refuse_unmatched(model: torch.nn.Module, baked: Baked) -> None:
    if baked.unwritten:
        raise LayoutError(
            f"astate: no published tensor writes parameter {baked.unwritten[0]!r} "
            f"({len(baked.unwritten)} in all: {baked.unwritten[:5]}); the published names do not "
            f"match what {type(model).__name__}'s loaders read"
        )
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    unused = [n for n in baked.unused if not n.endswith(_SKIPPED) and not (tied and n == "lm_head.weight")]
    if unused:
        raise LayoutError(
            f"astate: published tensor {unused[0]!r} is taken by no parameter of "
            f"{type(model).__name__} ({len(unused)} in all: {unused[:5]}): a name its loaders do not "
            "know (SGLang's loaders skip such names silently)"
        )


def _post_load(model: torch.nn.Module) -> None:
    """What the model's ``load_weights`` runs once its weights are written (derived weights)."""
    from sglang.srt.model_loader.loader import post_load_weights

    with torch.no_grad():
        post_load_weights(model)


def _tp_group() -> Any:
    from sglang.srt.distributed import get_tp_group

    try:
        group = get_tp_group()
    except AssertionError:
        return None
    return group if group.world_size > 1 else None


def _agreed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on every TP rank; if it failed on any, every rank raises (the first
    failing rank's error, named), so that no rank moves a byte while another refuses, and none waits
    in a collective for a rank that left."""
    err: BaseException | None = None
    out = None
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:
        err = exc
    group = _tp_group()
    if group is None:
        if err is not None:
            raise err
        return out
    msgs: list[Any] = [None] * group.world_size
    mine = None if err is None else f"{type(err).__name__}: {err}"
    torch.distributed.all_gather_object(msgs, mine, group=group.cpu_group)
    failed = [(rank, m) for rank, m in enumerate(msgs) if m is not None]
    if not failed:
        return out
    if err is not None and failed[0][0] == group.rank_in_group:
        raise err
    rank, msg = failed[0]
    raise UpdateError(f"astate: TP rank {rank} refused the update, so no rank changed its weights: {msg}")


def _all_max(value: int) -> int:
    """The maximum of ``value`` over the TP ranks (itself alone without a group)."""
    group = _tp_group()
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return int(t.item())


_RANK = _Rank()


def state() -> _Rank:
    """This process's astate side (its last step and timings; for tests and benchmarks)."""
    return _RANK


def load(model: torch.nn.Module, named_tensors: Any) -> None:
    """SGLang's custom weight loader entry: ``fn(model, named_tensors)`` on every TP rank."""
    _RANK.update(model, named_tensors)


def forgetting(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on SGLang's other weight writers: they run as they would; then this rank's
    next astate pull moves every byte (:meth:`_Rank.forget`)."""
    try:
        return original(*args, **kwargs)
    finally:
        _RANK.forget()


def guarded(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on SGLang's ``WeightUpdater.update_weights_from_tensor``: for the astate
    loader, an error becomes a failed update call (SGLang's scheduler would die of it) and a success
    reports the step; every other load format runs as it would, and counts as another writer
    (:func:`forgetting`)."""
    load_format = kwargs.get("load_format", args[2] if len(args) > 2 else None)
    if load_format != LOADER:
        return forgetting(original, *args, **kwargs)
    try:
        ok, message = original(*args, **kwargs)
    except Exception as exc:
        log.error("astate: update refused: %s: %s", type(exc).__name__, exc)
        return False, f"astate: {type(exc).__name__}: {exc}"
    if not ok:  # refused by SGLang before the loader ran
        return ok, message
    seconds = ", ".join(f"{k} {v:.3f}s" for k, v in _RANK.last_seconds.items())
    return True, f"astate: step {_RANK.last_step} ({seconds})"

"""The engine side of an RL loop, one call per update: the new weights, and no value computed with the old
ones left in a cache.

    from astate_store.integrations.vllm import apply_update, begin_update, update_weights

    llm = LLM(model, weight_transfer_config={"backend": "astate"})
    llm.init_weight_transfer_engine({"init_info": {"namespace": "policy"}})
    step = update_weights(llm, step)  # blocking: the newest version >= step; returns the step served

    begin_update(llm, step)  # returns at once: the pull runs while the engine serves the old weights
    ...  # generate
    step = apply_update(llm)  # a short pause: the swap, the caches cleared

``llm``: an offline ``vllm.LLM``, the URL of a vLLM OpenAI server started with ``VLLM_SERVER_DEV_MODE=1``
(its RL and cache routes), or a client of this module (:class:`OfflineClient`, :class:`HTTPClient`; both
are vLLM ``VLLMWeightSyncClient``\\ s, for its trainer factory, with the few calls an update needs besides).

:func:`update_weights` and :func:`apply_update`, numbered:

1. (apply) wait, while the engine serves, until every worker's preparation is ready (or failed);
2. ``start_weight_update``; pause scheduling with the requests in flight kept (vLLM's
   ``pause(mode="keep")``): no forward pass runs until 6;
3. ``update_weights`` (phase ``"now"`` or ``"apply"``). A refusal or failure ends the update here:
   resume, caches untouched, the error raised (the engine keeps its weights; a blocking pull that failed
   after bytes moved into live parameters is reported by the engine as ``touched``, and then the caches
   are cleared too, as they no longer match the weights);
4. ask the workers which step they serve; ``finish_weight_update(weight_version=str(step))``;
5. ``inflight="recompute"`` (default): clear what holds values computed with the weights: the prefix
   cache (KV blocks), preempting the requests in flight, which are recomputed with the new weights when
   scheduling resumes (their tokens so far are kept), and on a multimodal engine the encoder cache (its
   encoder outputs). The multimodal processor cache holds inputs, not values of the weights: kept;
6. resume.

``inflight="keep"``: requests in flight continue on the new weights with the KV they computed with the
old ones (as PipelineRL does); allowed only on an engine without prefix caching and not multimodal, where
no other request can reuse those blocks. Nothing is cleared, so no pause is needed: step 3 is one call to
every worker, between two forward passes, and the engine is held only for it.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol

from astate_store.errors import LayoutError

__all__ = [
    "EngineControl",
    "HTTPClient",
    "Inflight",
    "OfflineClient",
    "apply_update",
    "begin_update",
    "cancel_update",
    "client_for",
    "update_status",
    "update_weights",
]

Inflight = Literal["recompute", "keep"]
_POLL = 0.05  # seconds between readiness checks while the engine serves (each is a call through its loop)


class EngineError(LayoutError):
    """The engine refused or failed a call of an update (its message names the cause)."""


class EngineControl(Protocol):
    """What an update drives: vLLM's four weight-sync calls, and the few around them."""

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def clear_caches(self, encoder: bool = True) -> None: ...

    def status(self) -> list[dict[str, Any]]: ...


class OfflineClient:
    """An offline ``vllm.LLM`` as vLLM's ``VLLMWeightSyncClient`` (the trainer factory's client, for a
    trainer in the engine's process) and as an :class:`EngineControl`."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def pause(self) -> None:
        self.llm.sleep(level=0, mode="keep")  # level 0: scheduling only; the requests stay

    def resume(self) -> None:
        self.llm.wake_up(tags=["scheduling"])

    def clear_caches(self, encoder: bool = True) -> None:
        """The prefix cache (requests in flight preempted, recomputed when scheduling resumes), the KV
        connector's cache, and with ``encoder`` the encoder cache (multimodal encoder outputs)."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
            raise EngineError("astate: vLLM could not reset its prefix cache (KV blocks still held)")
        if encoder:
            self.llm.llm_engine.reset_encoder_cache()

    def status(self) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc("weight_transfer_engine"))

    def served(self) -> list[dict[str, str]]:
        """Per worker: parameter -> SHA-256 of what it computes with (the engine's ``"served"`` query)."""
        return list(self.llm.collective_rpc("weight_transfer_engine", args=("served",)))


class HTTPClient:
    """A vLLM OpenAI server (``VLLM_SERVER_DEV_MODE=1``) over its RL routes (``/start_weight_update`` ...,
    ``/pause``, ``/resume``), its cache routes (``/reset_prefix_cache``, ``/reset_encoder_cache``) and
    ``/collective_rpc``; vLLM's ``VLLMWeightSyncClient`` and an :class:`EngineControl`."""

    def __init__(self, base_url: str, timeout: float = 300) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, path: str, body: dict[str, Any] | None = None, **query: str) -> Any:
        import requests

        r = requests.post(f"{self.base_url}/{path}", json=body, params=query or None, timeout=self.timeout)
        if r.status_code >= 400:
            raise EngineError(f"astate: POST /{path}: HTTP {r.status_code}: {r.text[:4000]}")
        return r.json() if r.content else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post(
            "finish_weight_update", None if weight_version is None else {"weight_version": weight_version}
        )

    def pause(self) -> None:
        self._post("pause", mode="keep", clear_cache="false")

    def resume(self) -> None:
        self._post("resume")

    def clear_caches(self, encoder: bool = True) -> None:
        """As :meth:`OfflineClient.clear_caches`, through ``/reset_prefix_cache`` (``reset_external``: the
        KV connector's) and ``/reset_encoder_cache``."""
        done = self._post("reset_prefix_cache", reset_running_requests="true", reset_external="true")
        if not (done or {}).get("success"):
            raise EngineError(f"astate: vLLM could not reset its prefix cache: {done}")
        if encoder:
            self._post("reset_encoder_cache")

    def status(self) -> list[dict[str, Any]]:
        return list(self._post("collective_rpc", {"method": "weight_transfer_engine"})["results"])

    def served(self) -> list[dict[str, str]]:
        """Per worker: parameter -> SHA-256 of what it computes with (the engine's ``"served"`` query)."""
        return list(
            self._post("collective_rpc", {"method": "weight_transfer_engine", "args": ["served"]})["results"]
        )


_CONTROL = (
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "pause",
    "resume",
    "clear_caches",
)


def client_for(target: Any) -> EngineControl:
    """The :class:`EngineControl` of ``target``: a ``vllm.LLM``, a server URL, vLLM's
    ``HTTPVLLMWeightSyncClient`` (its ``base_url``), or an object with the methods of :class:`EngineControl`.

    Raises:
        LayoutError: anything else (nothing could clear its caches after an update).
    """
    if isinstance(target, str):
        return HTTPClient(target)
    if all(callable(getattr(target, m, None)) for m in (*_CONTROL, "status")):
        return target
    if isinstance(getattr(target, "base_url", None), str):  # vLLM's HTTPVLLMWeightSyncClient
        return HTTPClient(target.base_url, getattr(target, "timeout", 300))
    if hasattr(target, "llm_engine"):
        return OfflineClient(target)
    raise LayoutError(
        f"astate: cannot drive an update through a {type(target).__name__}: pass a vllm.LLM, a server URL, "
        "vLLM's HTTPVLLMWeightSyncClient, or an object with start_weight_update, update_weights, "
        "finish_weight_update, pause, resume, clear_caches and status (clients.EngineControl): the engine's "
        "caches must be cleared after each update"
    )


def _info(phase: str, step: int | None, timeout: float | None) -> dict[str, Any]:
    info: dict[str, Any] = {"phase": phase}
    if step is not None:
        info["step"] = step
    if timeout is not None:
        info["timeout"] = timeout
    return info


def update_status(llm: Any) -> list[dict[str, Any]]:
    """Every worker's state (:meth:`AstateWeightTransferEngine.__call__`): the step it serves, the update
    it prepares (``pending``: ``ready``, ``running``, ``error``, ``staging_bytes``), ``prefix_caching``."""
    return client_for(llm).status()


def update_weights(
    llm: Any, step: int | None = None, *, timeout: float | None = None, inflight: Inflight = "recompute"
) -> int:
    """Pull the newest committed version >= ``step`` (None: the newest) into the engine and clear its caches
    (steps 2-6 of the module doc); returns the step the engine now serves.

    Raises:
        EngineError, or the engine's own error offline: refused or failed; the engine keeps its weights
        and its caches (see step 3 for a pull that failed after bytes moved).
    """
    return _swap(client_for(llm), _info("now", step, timeout), inflight)


def begin_update(llm: Any, step: int | None = None, *, timeout: float | None = None) -> None:
    """Start preparing the newest committed version >= ``step`` while the engine keeps serving: the version
    is resolved and checked (refused at once, on every worker, if it cannot be applied), then each worker
    pulls it into staging and post-processes what it can, in the background. :func:`apply_update` swaps it
    in; :func:`cancel_update` drops it. The first update of a published set bakes (drives the loaders once)
    inside this call, holding the engine."""
    c = client_for(llm)
    c.start_weight_update()
    c.update_weights(_info("begin", step, timeout))
    c.finish_weight_update()


def apply_update(llm: Any, *, timeout: float | None = None, inflight: Inflight = "recompute") -> int:
    """Wait (the engine serving) until the update begun with :func:`begin_update` is ready on every worker,
    then swap it in during a pause and clear the caches (the module doc); returns the step now served.
    ``timeout``: seconds to wait for the preparation (None: the engine's init timeout)."""
    c = client_for(llm)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        states = c.status()
        pending = [s.get("pending") for s in states]
        if all(p is not None and p["ready"] for p in pending):
            break
        if any(p is None or not p["running"] for p in pending):
            break  # nothing prepared, or failed on a worker: the engine refuses, with the reason
        if deadline is not None and time.monotonic() >= deadline:
            break  # the engine refuses (NotReady) and the preparation goes on
        time.sleep(_POLL)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    # every worker pulled the same step: the apply serves it (no question asked during the pause)
    pulled = {p["got"] if p else None for p in pending}
    known = pulled.pop() if len(pulled) == 1 and None not in pulled else None
    return _swap(c, _info("apply", None, left), inflight, states, known)


def cancel_update(llm: Any) -> None:
    """Drop the update begun with :func:`begin_update` (waits for a pull in progress to end)."""
    c = client_for(llm)
    c.start_weight_update()
    c.update_weights({"phase": "cancel"})
    c.finish_weight_update()


def _swap(
    c: EngineControl,
    info: dict[str, Any],
    inflight: Inflight,
    states: list[dict[str, Any]] | None = None,
    known: int | None = None,
) -> int:
    """Steps 2-6 of the module doc. ``states``: the workers' state if just asked; ``known``: the step the
    update will serve if known before (then not asked during the pause). ``inflight="keep"`` needs no
    pause: the update is one call to every worker, between two forward passes, and no cache is cleared."""
    if inflight not in ("recompute", "keep"):
        raise LayoutError(f"astate: inflight must be 'recompute' or 'keep', got {inflight!r}")
    if inflight == "keep":
        states = states if states is not None else c.status()
        _check_keep(states)
    pause = inflight == "recompute"
    c.start_weight_update()  # before the pause: it only opens the workers' update session
    if pause:
        try:
            c.pause()
        except BaseException:
            c.finish_weight_update()
            raise
    try:
        try:
            c.update_weights(info)
        except BaseException:
            if any(s.get("touched") for s in _status_or_empty(c)):
                c.clear_caches()  # a pull that failed after bytes moved: the KV matches no weights now
            raise
        if known is None:
            states = c.status()
            known = _served(states)
        try:
            c.finish_weight_update(weight_version=str(known))
        finally:
            if pause:
                c.clear_caches(encoder=states is None or any(s.get("multimodal") for s in states))
    finally:
        if pause:
            c.resume()
    return known


def _status_or_empty(c: EngineControl) -> list[dict[str, Any]]:
    try:
        return c.status()
    except Exception:  # the error being raised says more
        return []


def _served(states: list[dict[str, Any]]) -> int:
    steps = {s.get("step") for s in states}
    if len(steps) != 1 or None in steps:
        raise EngineError(
            f"astate: the engine's workers report steps {sorted(map(str, steps))} after an update"
        )
    return int(steps.pop())


def _check_keep(states: list[dict[str, Any]]) -> None:
    for s in states:
        if s.get("prefix_caching") or s.get("multimodal"):
            raise LayoutError(
                "astate: inflight='keep' leaves KV blocks computed with the old weights in use; on an engine "
                "with prefix caching (or a multimodal one, whose encoder cache holds old outputs) another "
                "request could reuse them. Start the engine with enable_prefix_caching=False, or use "
                "inflight='recompute'"
            )

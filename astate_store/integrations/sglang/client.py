"""The caller's side of an astate update of an SGLang engine: one call, offline or over HTTP.

    from astate_store.integrations import sglang as astate_sglang

    engine = sgl.Engine(model_path=M, custom_weight_loader=[astate_sglang.LOADER], ...)   # offline
    step = astate_sglang.update(engine, "policy", step=7)
    # python -m sglang.launch_server ... --custom-weight-loader astate_store.integrations.sglang.loader.load
    step = astate_sglang.update_http("http://127.0.0.1:30000", "policy", step=7)

Each runs SGLang's own update session (mandatory in SGLang: updates happen between its
``begin_weight_update`` and ``end_weight_update``):

1. ``begin_weight_update``: SGLang puts every weight it packs after loading back in the loaders'
   format;
2. ``update_weights_from_tensor`` with one entry, the request (:mod:`.request`), ``load_format`` =
   the astate loader and ``flush_cache=True``: every TP rank's loader pulls its slices of the version
   into its parameters (:mod:`.loader`); SGLang flushes the prefix cache after a successful update;
3. ``end_weight_update`` (also after a failure): SGLang's post-processing of the loaded weights;
4. the step delivered becomes the engine's weight version (``str(step)``).

A refused or failed update raises :class:`~.request.UpdateError` with the engine's message; the
engine keeps its weights (unless the message says a pull failed mid-way, see docs/sglang.md).
This module needs no SGLang installed for the HTTP call (a trainer's environment), only torch.
"""

from __future__ import annotations

import base64
import json
import pickle
import urllib.error
import urllib.request
from typing import Any

import torch

from astate_store.integrations.sglang.request import LOADER, Request, UpdateError, step_of

__all__ = ["update", "update_http"]


def _entry(request: Request) -> list[tuple[str, torch.Tensor]]:
    return [(request.entry_name(), torch.empty(0, dtype=torch.uint8))]


def _delivered(ok: bool, message: str) -> int:
    """The step a finished update call delivered, or the engine's refusal raised."""
    if not ok:
        if "Unknown load_format" in message:
            message += f" (start the engine with custom_weight_loader=[{LOADER!r}])"
        raise UpdateError(f"astate: the SGLang engine refused the update: {message}")
    step = step_of(message)
    if step is None:
        raise UpdateError(
            f"astate: the SGLang engine did not run the astate loader ({message!r}); is the "
            "astate_store SGLang plugin disabled (SGLANG_PLUGINS)?"
        )
    return step


def _session(result: Any, call: str) -> None:
    ok, message = result if isinstance(result, tuple) else (True, "")
    if not ok:
        raise UpdateError(f"astate: SGLang's {call} failed: {message}")


def update(
    engine: Any,
    namespace: str,
    *,
    step: int | None = None,
    etcd: str | list[str] | None = None,
    timeout: float = 60.0,
    checkpoint: str | None = None,
    delta: bool = True,
    delta_choice: str = "bytes",
) -> int:
    """Update an offline ``sglang.Engine`` to the newest committed version ``>= step`` of
    ``namespace`` (``step=None``: the newest committed; ``checkpoint=URI``: cold start from the
    newest astate checkpoint under it, or its ``step``; ``delta``: pull only what changed since the
    version the engine holds, where the publisher records changes; ``delta_choice``: "bytes", or
    "time": through the changes only when measured faster than a whole pull, docs/delta.md). Returns
    the step delivered."""
    from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

    request = Request(namespace, etcd, step, timeout, checkpoint, delta, delta_choice)
    _session(engine.begin_weight_update(), "begin_weight_update")
    try:
        ok, message = engine.update_weights_from_tensor(
            named_tensors=_entry(request), load_format=LOADER, flush_cache=True
        )
    finally:
        _session(engine.end_weight_update(), "end_weight_update")
    got = _delivered(ok, message)
    version = UpdateWeightVersionReqInput(new_version=str(got), abort_all_requests=False)
    engine.loop.run_until_complete(engine.tokenizer_manager.update_weight_version(version))
    return got


def _call(url: str, route: str, body: dict[str, Any] | None, api_key: str | None, timeout: float) -> dict:
    """One JSON call to the SGLang server; an error status returns its JSON body (or raises)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + route, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return json.loads(text)
        except ValueError:
            raise UpdateError(f"astate: SGLang {route} answered {exc.code}: {text[:500]}") from exc


def update_http(
    url: str,
    namespace: str,
    *,
    step: int | None = None,
    etcd: str | list[str] | None = None,
    timeout: float = 60.0,
    checkpoint: str | None = None,
    delta: bool = True,
    delta_choice: str = "bytes",
    api_key: str | None = None,
) -> int:
    """As :func:`update`, for an SGLang server at ``url`` (``sglang.launch_server``; its admin routes
    take ``api_key`` if it has one). Returns the step delivered."""
    request = Request(namespace, etcd, step, timeout, checkpoint, delta, delta_choice)
    wait = timeout + 600.0  # the engine waits up to `timeout` for the commit, then pulls
    info = _call(url, "/server_info", None, api_key, 60.0)
    if LOADER not in (info.get("custom_weight_loader") or []):
        raise UpdateError(
            f"astate: the SGLang server at {url} was not started with --custom-weight-loader {LOADER}"
        )
    payload = base64.b64encode(pickle.dumps(_entry(request))).decode()
    tp = int(info.get("tp_size") or 1)  # one payload per TP rank: each rank reads its own
    _session(_flag(_call(url, "/begin_weight_update", {}, api_key, 60.0)), "begin_weight_update")
    try:
        body = {"serialized_named_tensors": [payload] * tp, "load_format": LOADER, "flush_cache": True}
        ok, message = _flag(_call(url, "/update_weights_from_tensor", body, api_key, wait))
    finally:
        _session(_flag(_call(url, "/end_weight_update", {}, api_key, 60.0)), "end_weight_update")
    got = _delivered(ok, message)
    version = {"new_version": str(got), "abort_all_requests": False}
    _session(_flag(_call(url, "/update_weight_version", version, api_key, 60.0)), "update_weight_version")
    return got


def _flag(reply: dict[str, Any]) -> tuple[bool, str]:
    return bool(reply.get("success")), str(reply.get("message", reply))

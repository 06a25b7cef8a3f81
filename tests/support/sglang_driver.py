"""Runs in SGLang's environment (.venv-sglang): one offline ``sglang.Engine``, driven over a local
connection by ``tests/support/sglang_engine.py`` (the tests' and benchmarks' side, in .venv).

    python -m tests.support.sglang_driver HOST:PORT AUTHKEY_HEX CONFIG_JSON

Only plain Python values cross the connection (the two sides run different torch versions). Each
request is ``(op, kwargs)``; each answer ``("ok", result)`` or ``("error", "Type: message")``.

:func:`probe` is a second custom weight loader for the tests: run on every TP rank inside SGLang's
scheduler, it reports what the astate loader learned next to what a preset says (never raising: a
custom loader's exception kills SGLang's scheduler; it writes its report, or its error, to a file).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import torch

PROBE = "tests.support.sglang_driver.probe"


def _generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [
        {
            "ids": list(o["output_ids"]),
            "cached": o["meta_info"].get("cached_tokens"),
            "version": o["meta_info"].get("weight_version"),
        }
        for o in outs
    ]


def _check_weights(engine: Any, action: str) -> dict[str, str]:
    """SGLang's own weights checker: ``checksum`` gives every parameter's digest per TP rank
    (``"rank:name"``); ``reset_tensors`` fills every parameter with random values."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    ok, message, ranks, _ = engine.loop.run_until_complete(
        engine.tokenizer_manager.check_weights(CheckWeightsReqInput(action=action), None)
    )
    if not ok:
        raise RuntimeError(f"weights_checker {action}: {message}")
    out = {}
    for info in ranks or []:
        rank = tp_rank(info)
        out.update({f"{rank}:{name}": digest for name, digest in info["checksums"].items()})
    return out


def tp_rank(info: dict[str, Any]) -> int:
    """The TP rank of one rank's checksum report (its ``parallelism_info``: one entry per runner)."""
    where = info["parallelism_info"]
    return (where[0] if isinstance(where, list) else where)["tp_rank"]


def _session(engine: Any, named_tensors: Any, load_format: str | None) -> tuple[bool, str]:
    """One update from tensors in SGLang's own session (begin, update, end)."""
    engine.begin_weight_update()
    try:
        return tuple(
            engine.update_weights_from_tensor(
                named_tensors=named_tensors, load_format=load_format, flush_cache=True
            )
        )
    finally:
        engine.end_weight_update()


_HELD: dict[str, Any] = {}  # tensors a benchmark's trainer holds in this process (``hold``)


def _hold(engine: Any, path: str) -> int:
    """Load a safetensors file into this process's memory (untimed: the trainer's weights)."""
    from safetensors.torch import load_file

    _HELD["tensors"] = list(load_file(path).items())
    return len(_HELD["tensors"])


def _from_held(engine: Any) -> list[Any]:
    """SGLang's plain path: the held full tensors through ``update_weights_from_tensor`` (SGLang
    serializes them to the scheduler, whose ``load_weights`` copies each rank's slice)."""
    return list(_session(engine, _HELD["tensors"], None))


def _probe(engine: Any, out: str, preset: str) -> list[dict[str, Any]]:
    name = json.dumps({"out": out, "preset": preset})
    ok, message = _session(engine, [(name, torch.empty(0))], PROBE)
    if not ok:
        raise RuntimeError(f"probe: {message}")
    return [json.loads(p.read_text()) for p in sorted(Path(out).parent.glob(Path(out).name + ".*"))]


def _ops() -> dict[str, Callable[..., Any]]:
    from astate_store.integrations import sglang as astate_sglang
    from astate_store.integrations.sglang.request import LOADER

    return {
        "generate": _generate,
        "checksums": lambda e: _check_weights(e, "checksum"),
        "reset": lambda e: _check_weights(e, "reset_tensors"),
        "update": astate_sglang.update,
        "raw_update": lambda e, name: list(_session(e, [(name, torch.empty(0))], LOADER)),
        "from_disk": lambda e, path: list(e.update_weights_from_disk(path))[:2],  # (ok, message, paused)
        "hold": _hold,
        "from_held": _from_held,
        "probe": _probe,
        "flush": lambda e: bool(e.flush_cache()),
    }


def probe(model: torch.nn.Module, named_tensors: Any) -> None:
    """A custom weight loader (tests only): this rank's preset views next to the astate bake, as
    ``{"preset": {hf: [...]}, "bake": {hf: [...]}, "pulls": {...}}``, each entry (parameter, element
    offset, sizes, strides, HF offsets), and the astate store's pull counts, written to
    ``<out>.<tp rank>``. It writes no weight, but counts as another writer (the next pull is whole)."""
    from sglang.srt.distributed import get_tp_group

    ((name, _),) = named_tensors
    args = json.loads(name)
    group = get_tp_group()
    try:
        report = _preset_and_bake(model, args["preset"], group.rank_in_group, group.world_size)
    except Exception:
        report = {"error": traceback.format_exc()}
    Path(f"{args['out']}.{group.rank_in_group}").write_text(json.dumps(report))


def _preset_and_bake(model: torch.nn.Module, preset: str, rank: int, size: int) -> dict[str, Any]:
    from astate_store.integrations import presets
    from astate_store.integrations.sglang.loader import state
    from tests.integrations._vllm import _describe

    params = dict(model.named_parameters())
    views = presets.views(preset, params, model.config, tp_rank=rank, tp_size=size)
    got: dict[str, list] = {}
    for hf, v in views.items():
        for shard in v if isinstance(v, list) else [v]:
            offsets = tuple(shard.offsets) if hasattr(shard, "offsets") else (0,) * shard.dim()
            got.setdefault(hf, []).append(list(_describe(shard, params) + (offsets,)))
    baked: dict[str, list] = {}
    for p in state().plan.baked.pieces:
        baked.setdefault(p.hf, []).append([p.param, p.base, p.sizes, p.strides, p.offsets])
    norm = lambda rows: sorted(json.loads(json.dumps(rows)))  # tuples and lists alike
    stats = state().store.stats
    return {
        "preset": {k: norm(v) for k, v in got.items()},
        "bake": {k: norm(v) for k, v in baked.items()},
        "pulls": {"delta": stats.delta_pulls, "all": stats.pulls},  # this rank's store, so far
    }


def main() -> None:
    import sglang as sgl

    address, authkey, config = sys.argv[1], bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3])
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=authkey)
    t0 = time.perf_counter()
    engine = sgl.Engine(**config)
    conn.send(("ready", {"start_seconds": time.perf_counter() - t0}))
    ops = _ops()
    try:
        while True:
            op, kwargs = conn.recv()
            if op == "shutdown":
                break
            try:
                conn.send(("ok", ops[op](engine, **kwargs)))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        engine.shutdown()
        conn.close()


if __name__ == "__main__":
    main()

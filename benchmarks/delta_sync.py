"""Delta versions against whole versions, from a real trainer; ONE JSON line.

A trainer process builds a Qwen2-shaped model from a ``transformers.Qwen2Config`` with random init
(18 layers of Qwen2.5-0.5B's shape: 0.40B parameters, tied embeddings; nothing is downloaded), keeps
fp32 master weights and steps them with ``torch.optim.AdamW`` (lr 1e-6, fused) on the gradients of a
causal-LM loss over random tokens. After every step it publishes a bf16 copy of the masters, as RL
trainers publish, to two namespaces: one with ``delta=True`` and one without (``ratio_put``: the put
with delta over the put without, of the same tensors, in alternating order). What changed is what
AdamW changed: the trainer counts the bf16 elements whose bits differ from the previous step's
(``changed_fraction``), nothing is synthesised.

Every version is pulled three times, side by side, by each consumer, into the same buffers: first as a
delta (a store with ``delta=True``; the buffers hold the previous version), then whole (a store without
delta, which writes every byte again; the delta store's next pull still finds the buffers holding the
version it delivered), then by a store with ``delta_choice="time"`` (through the changes or whole,
whichever its own pulls measured faster; the buffers already hold the version then, and its changes
write the same values again, so each way costs what it costs on buffers holding the previous version):

- ``tcp``: a consumer on host B pulls from host A over tcp. Host A and host B are two network
  namespaces joined by a veth link (needs root and iproute2): etcd, the trainer and the other roles
  run in A (one ``ip netns exec``, so they share A's mount namespace and count as one host), this
  consumer in B. Everything binds A's or B's own address.
- ``shm``: a consumer on host A pulls over shared memory.
- ``vllm``: a TP=1 vLLM engine on host A (``load_format="dummy"``: random weights until the first
  update) takes each version through the ``astate`` backend's ``update_weights`` (its defaults: delta
  pulls, the staged modules' staging kept between updates) and then the same version whole (the
  engine told to forget first); after each, what it computes with (the engine's ``served`` query: a
  prepacked GEMM's weight read back through the GEMM) is compared with SHA-256 digests of the
  published tensors in vLLM's layout. At the end the engine is re-initialised with ``keep_staging``
  false (its staged modules then pull whole into fresh staging, so every update is whole) and takes
  the last version three times (``vllm_nokeep_seconds``: the median of the last two; the first
  bakes). ``--no-vllm``: skipped.

Two phases, so that their memory does not add up (about 13 GB each on a 24 GB machine shared with
others): the trainer and the two consumers, in lockstep per step (the consumers one after another,
the trainer waiting: 2 shared cores); then the engine, fed by a publisher that replays the trainer's
versions (copies of each, saved in phase 1) in the same lockstep.
Exactness (``exact``): after every pull on every path, every element of the buffers is compared (as
raw bits) with what the trainer published, read from the file it published from (``/dev/shm``, mapped
by the consumers: an oracle outside the data path); the engine's served weights equal the published
ones (SHA-256 per parameter) after both its updates.

Keys: params, bytes (of one bf16 version), steps, changed_fraction (median over the trained
steps), ratio_delta_tcp / ratio_delta_shm (median whole pull seconds / median delta pull seconds,
with both medians as ``<path>_whole_seconds`` / ``<path>_delta_seconds``), ratio_time_tcp /
ratio_time_shm (median whole pull seconds / median seconds of the ``delta_choice="time"`` store, with
``<path>_time_seconds`` and ``<path>_time_ways``: per trained step, ``d`` through changes, ``w`` whole),
bytes_ratio (bytes the delta pulls moved / bytes the whole pulls moved, over the trained steps, tcp),
ratio_put (median put seconds with delta / without), ratio_vllm (median whole update / median delta
update, seconds, with ``vllm_whole_seconds``, ``vllm_delta_seconds``, ``vllm_nokeep_seconds``,
``vllm_kept_bytes``), exact,
per_step [...] (the engine's update phases too), null_reasons, date, load (the 1-minute load average
at the start; ``load_end`` at the end), cores. Appended to benchmarks/results/delta_sync.jsonl unless
``--small``. Memory: about 11 GB for the trainer (fp32 masters, AdamW, the published bf16 copy,
staging), 1.2 GB per consumer; then about 6 GB for the engine, 3 GB for the replaying publisher.

    .venv/bin/python benchmarks/delta_sync.py [--steps 6] [--small] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.spawn
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, ".."))

import torch  # noqa: E402
from _hosts import VethPair, netns_python  # noqa: E402

CTX = mp.get_context("spawn")
TIMEOUT = 900.0
LR = 1e-6
SEQ, BATCH = 128, 1  # one sequence: the logits of 151,936 tokens are most of the activations

DIMS = {
    # Qwen2.5-0.5B's shape with 18 of its 24 layers: 404,558,464 parameters (tied embeddings)
    "full": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=18,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "small": dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def qwen2_config(small: bool) -> Any:
    import transformers

    return transformers.Qwen2Config(
        tie_word_embeddings=True,
        max_position_embeddings=512,
        torch_dtype="bfloat16",
        **DIMS["small" if small else "full"],
    )


def shapes_of(small: bool) -> dict[str, tuple[int, ...]]:
    """The published tensors: the model's parameters (tied: ``lm_head`` is the embedding), in order."""
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(qwen2_config(small))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def mapped(path: str, small: bool, create: bool = False) -> dict[str, torch.Tensor]:
    """The published tensors (bf16) as views of one file mapped shared: the trainer writes what it
    publishes there (``/dev/shm``), the consumers compare their buffers with it (an oracle outside the
    data path: both hosts share one kernel), and the engine's publisher replays saved copies of it."""
    shapes = shapes_of(small)
    total = sum(_numel(s) for s in shapes.values()) * 2
    if create:
        with open(path, "wb") as f:
            f.truncate(total)
    flat = torch.from_file(path, shared=True, size=total // 2, dtype=torch.bfloat16)
    out, at = {}, 0
    for n, shape in shapes.items():
        out[n] = flat[at : at + _numel(shape)].view(shape)
        at += _numel(shape)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _send(out: Any, role: str, kind: str, payload: Any) -> None:
    out.put((role, kind, payload))


def _role(role: str, out: Any, fn: Any, *args: Any) -> None:
    """A process's body; an exception is sent to the driver as ("error", traceback)."""
    try:
        fn(*args)
    except BaseException:
        _send(out, role, "error", traceback.format_exc()[-3000:])
        raise


# ------------------------------------------------------------------------------------ trainer


def trainer(endpoint: str, ns: str, small: bool, oracle: str, save: str | None, cmds: Any, out: Any) -> None:
    """Builds the model; on ("step", k): trains one step (none for k == 0), writes the bf16 copy into
    the oracle file, publishes it to both namespaces, and answers what changed and the put times;
    with ``save``, a copy of the version goes to ``save/v{k}.bin`` (for the engine's phase)."""
    import transformers

    from astate_store.store import Store

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(qwen2_config(small)).float()
    model.train()
    params = dict(model.named_parameters())  # tied: lm_head.weight is model.embed_tokens.weight
    opt = torch.optim.AdamW(params.values(), lr=LR, fused=True)
    pub = mapped(oracle, small, create=True)  # what is published, where the consumers check it
    assert list(pub) == list(params)
    for n, p in params.items():
        pub[n].copy_(p.detach())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    stores = {
        "delta": Store(ns, endpoint=endpoint, rank=0, world_size=1, session_id=ns + "-d", delta=True),
        # one slot (nobody reads it): the copy costs the same, the memory is the engine's
        "plain": Store(
            ns + "-plain", endpoint=endpoint, rank=0, world_size=1, session_id=ns + "-p", staging_depth=1
        ),
    }
    _send(out, "trainer", "ready", {"params": sum(p.numel() for p in params.values())})
    try:
        while (cmd := cmds.get(timeout=TIMEOUT))[0] == "step":
            k = cmd[1]
            info: dict[str, Any] = {"step": k}
            if k > 0:
                t = time.perf_counter()
                tokens = torch.randint(vocab, (BATCH, SEQ), generator=gen)
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                info["loss"] = round(float(loss.detach()), 4)
                del loss  # the activations go before AdamW's step
                opt.step()
                opt.zero_grad(set_to_none=True)
                info["train_seconds"] = round(time.perf_counter() - t, 3)
                changed = 0
                with torch.no_grad():
                    for n, p in params.items():  # the bf16 copy, counting the elements whose bits changed
                        new = p.detach().to(torch.bfloat16)
                        changed += int((new.view(torch.int16) != pub[n].view(torch.int16)).sum())
                        pub[n].copy_(new)
                info["changed"] = changed
            order = ("delta", "plain") if k % 2 else ("plain", "delta")
            for which in order:
                t = time.perf_counter()
                stores[which].put(k, pub)
                info[f"put_{which}_seconds"] = round(time.perf_counter() - t, 4)
            if save is not None:
                shutil.copyfile(oracle, os.path.join(save, f"v{k}.bin"))
            _send(out, "trainer", "put", info)
    finally:
        for s in stores.values():
            s.close()


def replayer(endpoint: str, ns: str, small: bool, save: str, cmds: Any, out: Any) -> None:
    """The engine's publisher: on ("step", k) puts the trainer's version k again (``save/v{k}.bin``,
    with ``delta=True``) and answers what the engine must compute with (:func:`served_digests`)."""
    from astate_store.store import Store

    tied = qwen2_config(small).tie_word_embeddings
    store = Store(ns, endpoint=endpoint, rank=0, world_size=1, session_id=ns + "-r", delta=True)
    pub = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in shapes_of(small).items()}
    _send(out, "replayer", "ready", {})
    try:
        while (cmd := cmds.get(timeout=TIMEOUT))[0] == "step":
            k = cmd[1]
            version = mapped(os.path.join(save, f"v{k}.bin"), small)
            for n, t in pub.items():
                t.copy_(version[n])
            del version
            t0 = time.perf_counter()
            store.put(k, pub)
            info = {"put_seconds": round(time.perf_counter() - t0, 4)}
            info["served"] = served_digests(pub, tied)
            _send(out, "replayer", "put", info)
    finally:
        store.close()


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def served_digests(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, str]:
    """SHA-256 of what a TP=1 vLLM Qwen2 must compute with once it took ``tensors``, by vLLM's parameter
    names (the engine's ``served`` query): q, k, v fused into ``qkv_proj`` and gate, up into
    ``gate_up_proj`` (vLLM's Qwen2 layers), ``lm_head`` tied to the embedding. A matrix's ``-0.0`` reads
    back as ``0.0`` through a prepacked GEMM (integrations/vllm/served.py): compared as ``0.0``."""
    import hashlib

    parts = {p: (f, i) for f, ps in FUSED.items() for i, p in enumerate(ps)}
    groups: dict[str, list[Any]] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last in parts:
            f, i = parts[last]
            groups.setdefault(f"{parent}.{f}.{leaf}", [None] * len(FUSED[f]))[i] = t
        else:
            groups[name] = [t]
    if tied:
        groups["lm_head.weight"] = [tensors["model.embed_tokens.weight"]]
    out = {}
    for name, ts in groups.items():
        t = torch.cat(ts) if len(ts) > 1 else ts[0]
        if t.dim() == 2:
            t = t + 0  # -0.0 -> 0.0
        out[name] = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    return out


# ------------------------------------------------------------------------------------ consumers


def consumer(role: str, endpoint: str, ns: str, small: bool, oracle: str, cmds: Any, out: Any) -> None:
    """On ("pull", k): pulls step k into its buffers as a delta (they hold k-1), then whole (a store
    without delta writes them all again); after each, every element is compared with what the
    trainer published (the oracle file). Answers the times and the bytes each moved."""
    from astate_store.store import Store

    ref = mapped(oracle, small)
    stores = {
        "delta": Store(ns, endpoint=endpoint, session_id=f"{ns}-{role}-d", delta=True),
        "whole": Store(ns, endpoint=endpoint, session_id=f"{ns}-{role}-w"),
        "time": Store(ns, endpoint=endpoint, session_id=f"{ns}-{role}-t", delta=True, delta_choice="time"),
    }
    # One set of buffers for both (memory): the whole pull rewrites the version the delta pull left, so
    # the delta store's next pull still finds them holding it. The delta pull goes first: it is checked
    # on buffers that held the previous version.
    bufs = {n: torch.zeros_like(t) for n, t in ref.items()}
    _send(out, role, "ready", {})
    try:
        while (cmd := cmds.get(timeout=TIMEOUT))[0] == "pull":
            k = cmd[1]
            info: dict[str, Any] = {"step": k}
            for which in ("delta", "whole", "time"):
                st = stores[which]
                before = st.stats
                t = time.perf_counter()
                got = st.get_into(bufs, step=k, timeout=TIMEOUT)
                info[f"{which}_seconds"] = round(time.perf_counter() - t, 4)
                after = st.stats
                assert got == k, (got, k)
                info[f"{which}_bytes"] = after.pull_bytes - before.pull_bytes
                if which != "whole":
                    info[f"{which}_pull"] = after.delta_pulls > before.delta_pulls
                if which == "delta":
                    info["delta_elements"] = after.delta_elements - before.delta_elements
                info[f"{which}_exact"] = all(
                    torch.equal(b.view(torch.int16), ref[n].view(torch.int16)) for n, b in bufs.items()
                )
            info["exact"] = info["delta_exact"] and info["whole_exact"] and info["time_exact"]
            tr = stores["whole"].transport
            info["streamed_bytes"] = tr.streamed_bytes if hasattr(tr, "streamed_bytes") else None
            _send(out, role, "pull", info)
    finally:
        for s in stores.values():
            s.close()


# ------------------------------------------------------------------------------------ engine


def engine(endpoint: str, ns: str, model_dir: str, cmds: Any, out: Any) -> None:
    """A TP=1 vLLM engine (random weights until the first update) with the ``astate`` backend (delta
    pulls, staging kept: the defaults). On ("update", k, want): takes step k as a delta (the engine holds
    k-1), then again whole (forgotten first); after each, what it computes with against ``want``. On
    ("nokeep", k): re-initialised with ``keep_staging`` false, takes step k whole (staging allocated each
    time) twice after a first (which bakes)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM

    from astate_store.integrations.vllm import OfflineClient, update_weights

    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=2,
        dtype="bfloat16",
        weight_transfer_config={"backend": "astate"},
    )
    client = OfflineClient(llm)
    init = {"namespace": ns, "etcd": endpoint, "timeout": 300}
    llm.init_weight_transfer_engine({"init_info": init})
    _send(out, "vllm", "ready", {})
    try:
        while (cmd := cmds.get(timeout=TIMEOUT))[0] in ("update", "nokeep"):
            if cmd[0] == "nokeep":
                llm.init_weight_transfer_engine({"init_info": {**init, "keep_staging": False}})
                times = []
                for _ in range(3):
                    t = time.perf_counter()
                    update_weights(llm, cmd[1])
                    times.append(round(time.perf_counter() - t, 4))
                (st,) = client.status()
                _send(out, "vllm", "nokeep", {"seconds": times, "kept_bytes": st["kept_bytes"]})
                continue
            k, want = cmd[1], cmd[2]
            info: dict[str, Any] = {"step": k}
            for which in ("delta", "whole"):
                (before,) = client.status()
                if which == "whole":
                    llm.collective_rpc("weight_transfer_engine", args=("forget",))
                t = time.perf_counter()
                got = update_weights(llm, k)
                info[f"{which}_seconds"] = round(time.perf_counter() - t, 4)
                assert got == k, (got, k)
                (st,) = client.status()
                info[f"{which}_bytes"] = st["pulls"]["bytes"] - before["pulls"]["bytes"]
                info[f"{which}_pull"] = st["pulls"]["delta"] > before["pulls"]["delta"]
                info[f"{which}_phases"] = {p: round(x, 4) for p, x in st["seconds"].items()}
                (served,) = client.served()
                wrong = sorted(n for n in set(served) | set(want) if served.get(n) != want.get(n))
                info[f"{which}_exact"] = not wrong
                if wrong:
                    info[f"{which}_wrong"] = wrong[:8]
            info["exact"] = info["delta_exact"] and info["whole_exact"]
            info["kept_bytes"] = st["kept_bytes"]
            _send(out, "vllm", "update", info)
    finally:
        llm.llm_engine.engine_core.shutdown()


# ------------------------------------------------------------------------------------ driver


class Roles:
    """The processes of one run, each answering on one queue."""

    def __init__(self) -> None:
        self.out = CTX.Queue()
        self.cmds: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}

    def start(
        self, role: str, fn: Any, args: tuple[Any, ...], netns: str | None = None, daemon: bool = True
    ) -> None:
        self.cmds[role] = CTX.Queue()
        p = CTX.Process(
            target=_role, args=(role, self.out, fn, *args, self.cmds[role], self.out), daemon=daemon
        )
        exe = mp.spawn.get_executable()
        if netns is not None:  # the interpreter started through `ip netns exec` (host B)
            mp.spawn.set_executable(netns_python(netns))
        try:
            p.start()
        finally:
            mp.spawn.set_executable(exe)
        self.procs[role] = p

    def ask(self, role: str, *cmd: Any, timeout: float = TIMEOUT) -> dict[str, Any]:
        self.cmds[role].put(cmd)
        return self.wait(role, timeout)

    def wait(self, role: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                who, kind, payload = self.out.get(timeout=1.0)
            except queue.Empty:
                p = self.procs[role]
                if p.exitcode is not None:
                    raise RuntimeError(f"{role} exited with {p.exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{role}: no answer within {timeout:.0f}s") from None
                continue
            if kind == "error":
                raise RuntimeError(f"{who}: {payload}")
            assert who == role, (who, role, kind)
            return dict(payload)

    def close(self) -> None:
        for q in self.cmds.values():
            q.put(("exit",))
        for p in self.procs.values():
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Inside host A: etcd, then two phases (their memory does not add up: about 13 GB each).
    1. the trainer, the shm consumer here and the tcp consumer in host B, in lockstep per step;
    2. (the engine) a publisher replaying the trainer's versions and a vLLM engine, in lockstep."""
    from astate_store.etcd.embedded import EmbeddedEtcd

    load0 = os.getloadavg()[0]
    ns = "delta-" + uuid.uuid4().hex[:8]
    result: dict[str, Any] = {"bench": "delta_sync", "null_reasons": {}}
    engine_on = not args.no_vllm
    oracle = f"/dev/shm/{ns}.bin"
    with EmbeddedEtcd(host=args.a_addr) as etcd, tempfile.TemporaryDirectory(prefix="delta_sync-") as tmp:
        try:
            per_step = pulls(args, etcd.endpoint, ns, oracle, tmp if engine_on else None, result)
        finally:
            if os.path.exists(oracle):
                os.unlink(oracle)
        if engine_on:
            updates(args, etcd.endpoint, ns + "-engine", tmp, per_step, result)
        else:
            result["null_reasons"]["vllm"] = "skipped (--no-vllm)"
    return summarize(result, per_step, load0)


def pulls(
    args: argparse.Namespace, endpoint: str, ns: str, oracle: str, save: str | None, result: dict[str, Any]
) -> list[dict[str, Any]]:
    """Phase 1: per step, the trainer's step and puts, then each consumer's delta and whole pulls."""
    per_step: list[dict[str, Any]] = []
    roles = Roles()
    try:
        roles.start("trainer", trainer, (endpoint, ns, args.small, oracle, save))
        result["params"] = roles.wait("trainer")["params"]
        paths = ["shm"] + (["tcp"] if args.b_ns else [])
        if not args.b_ns:
            result["null_reasons"]["tcp"] = args.no_hosts
        for path in paths:
            host = args.b_ns if path == "tcp" else None
            roles.start(path, consumer, (path, endpoint, ns, args.small, oracle), host)
            roles.wait(path)
        for k in range(args.steps + 1):
            row = {"step": k, **roles.ask("trainer", "step", k)}
            for path in paths:
                got = roles.ask(path, "pull", k)
                row[path] = {key: v for key, v in got.items() if key != "step"}
            per_step.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        roles.close()
    return per_step


def updates(
    args: argparse.Namespace, endpoint: str, ns: str, save: str, per_step: list[dict[str, Any]], result: dict
) -> None:
    """Phase 2: per step, the trainer's version published again, then the engine's delta and whole
    updates (into ``per_step``); then the engine without kept staging."""
    roles = Roles()
    model_dir = os.path.join(save, "model")
    qwen2_config(args.small).save_pretrained(model_dir)
    try:
        roles.start("replayer", replayer, (endpoint, ns, args.small, save))
        roles.wait("replayer")
        roles.start("vllm", engine, (endpoint, ns, model_dir), daemon=False)  # vLLM starts processes
        roles.wait("vllm")
        for row in per_step:
            k = row["step"]
            put = roles.ask("replayer", "step", k)
            got = roles.ask("vllm", "update", k, put.pop("served"))
            row["vllm"] = {key: v for key, v in got.items() if key != "step"}
            row["vllm"]["put_seconds"] = put["put_seconds"]
            print(json.dumps({"step": k, "vllm": row["vllm"]}), file=sys.stderr, flush=True)
        result["vllm_nokeep"] = roles.ask("vllm", "nokeep", per_step[-1]["step"])
    finally:
        roles.close()


def summarize(result: dict[str, Any], per_step: list[dict[str, Any]], load0: float) -> dict[str, Any]:
    trained = [r for r in per_step if r["step"] > 0]
    nbytes = result["params"] * 2
    result["bytes"] = nbytes
    result["steps"] = len(trained)
    result["changed_fraction"] = _median([r["changed"] / result["params"] for r in trained])
    for path in ("tcp", "shm"):
        rows = [r[path] for r in trained if path in r]
        result[f"ratio_delta_{path}"] = _ratio(
            _median([x["whole_seconds"] for x in rows]), _median([x["delta_seconds"] for x in rows])
        )
        result[f"{path}_whole_seconds"] = _median([x["whole_seconds"] for x in rows])
        result[f"{path}_delta_seconds"] = _median([x["delta_seconds"] for x in rows])
        result[f"{path}_delta_pulls"] = sum(bool(x.get("delta_pull")) for x in rows)
        result[f"ratio_time_{path}"] = _ratio(
            _median([x["whole_seconds"] for x in rows]), _median([x["time_seconds"] for x in rows])
        )
        result[f"{path}_time_seconds"] = _median([x["time_seconds"] for x in rows])
        # step by step: d through changes, w whole
        result[f"{path}_time_ways"] = "".join("d" if x.get("time_pull") else "w" for x in rows)
    src = "tcp" if any("tcp" in r for r in trained) else "shm"
    moved = sum(r[src]["delta_bytes"] for r in trained)
    whole = sum(r[src]["whole_bytes"] for r in trained)
    result["bytes_ratio"] = round(moved / whole, 5) if whole else None
    result["ratio_put"] = _ratio(
        _median([r["put_delta_seconds"] for r in trained]), _median([r["put_plain_seconds"] for r in trained])
    )
    result["put_delta_seconds"] = _median([r["put_delta_seconds"] for r in trained])
    result["put_plain_seconds"] = _median([r["put_plain_seconds"] for r in trained])
    rows = [r["vllm"] for r in trained if "vllm" in r]
    result["vllm_whole_seconds"] = _median([x["whole_seconds"] for x in rows])
    result["vllm_delta_seconds"] = _median([x["delta_seconds"] for x in rows])
    result["ratio_vllm"] = _ratio(result["vllm_whole_seconds"], result["vllm_delta_seconds"])
    result["vllm_delta_pulls"] = sum(bool(x["delta_pull"]) for x in rows)
    if rows:
        result["vllm_kept_bytes"] = rows[-1]["kept_bytes"]
    nokeep = result.get("vllm_nokeep")
    if nokeep:  # the first update after the re-init bakes: the others are the steady cost
        result["vllm_nokeep_seconds"] = _median(nokeep["seconds"][1:])
    result["exact"] = all(r[p]["exact"] for r in per_step for p in ("tcp", "shm", "vllm") if p in r) and bool(
        per_step
    )
    result["per_step"] = per_step
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["load"] = f"load {load0:.1f}"  # the 1-minute load average at the start (report.py's form)
    result["load_end"] = round(os.getloadavg()[0], 2)
    result["cores"] = len(os.sched_getaffinity(0))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="trained steps (each published)")
    ap.add_argument("--small", action="store_true", help="a tiny model (a quick check of the script)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM engine")
    # set by the outer run for the inner one (inside host A)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--a-addr", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--b-ns", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-hosts", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        print(json.dumps(run(args)), flush=True)
        return
    line = outer(args)
    print(json.dumps(line))
    if not args.small:
        out = Path(_HERE) / "results" / "delta_sync.jsonl"
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


def outer(args: argparse.Namespace) -> dict[str, Any]:
    """Makes hosts A and B and runs the benchmark inside A; without namespaces (not root, no
    iproute2), runs it on this host without the tcp path."""
    from astate_store.etcd.embedded import tied_to_caller

    me = [sys.executable, os.path.abspath(__file__), "--inside", "--steps", str(args.steps)]
    me += ["--small"] * args.small + ["--no-vllm"] * args.no_vllm
    try:
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        hosts = VethPair("delta", net=233).open()
    except (OSError, subprocess.CalledProcessError) as exc:
        why = f"no network namespaces here ({exc}): no second host"
        cmd, hosts = [*me, "--no-hosts", why], None
    else:
        cmd = ["ip", "netns", "exec", hosts.a, *me, "--a-addr", hosts.a_addr, "--b-ns", hosts.b]
    try:
        p = subprocess.run(tied_to_caller(cmd), stdout=subprocess.PIPE, text=True, timeout=TIMEOUT * 4)
    finally:
        if hosts is not None:
            hosts.close()
    for ln in reversed(p.stdout.splitlines()):
        if ln.startswith("{"):
            return dict(json.loads(ln))
    raise RuntimeError(f"the run inside host A exited with {p.returncode} and no result")


if __name__ == "__main__":
    main()

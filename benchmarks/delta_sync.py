"""Delta versions against whole versions, from a real trainer; ONE JSON line.

A trainer process builds a Qwen2-shaped model from a ``transformers.Qwen2Config`` with random init
(18 layers of Qwen2.5-0.5B's shape: 0.40B parameters, tied embeddings; nothing is downloaded), keeps
fp32 master weights and steps them with ``torch.optim.AdamW`` (lr 1e-6, fused) on the gradients of a
causal-LM loss over random tokens. After every step it publishes a bf16 copy of the masters, as RL
trainers publish, to two namespaces: one with ``delta=True`` and one without (``ratio_put``: the put
with delta over the put without, of the same tensors, in alternating order). What changed is what
AdamW changed: the trainer counts the bf16 elements whose bits differ from the previous step's
(``changed_fraction``), nothing is synthesised.

Every version is pulled twice, side by side, by each consumer: whole (a store without delta, into
its own buffers) and as a delta (a store with ``delta=True``, into the buffers of its previous pull):

- ``tcp``: a consumer on host B pulls from host A over tcp. Host A and host B are two network
  namespaces joined by a veth link (needs root and iproute2): etcd, the trainer and the other
  consumers run in A (one ``ip netns exec``, so they share A's mount namespace and count as one
  host), this consumer in B. Everything binds A's or B's own address.
- ``shm``: a consumer on host A pulls over shared memory.
- ``vllm``: a TP=1 vLLM engine on host A takes each version through the ``astate`` backend
  (``delta`` on by default) and again whole (the same version, forgotten first), and what it
  computes with is compared with the published tensors (``--no-vllm``: skipped).

The consumers run one after another (2 shared cores); the trainer waits meanwhile.
Exactness (``exact``): after every step, on every path, the delta pull's buffers equal the whole
pull's, every element compared as raw bits, and the whole pull's buffers hash (XXH3 per tensor) to
the trainer's published tensors.

Keys: params, bytes (of one bf16 version), steps, changed_fraction (median over the trained
steps), ratio_delta_tcp / ratio_delta_shm (median whole pull seconds / median delta pull seconds),
bytes_ratio (bytes a delta pull moved / bytes a whole pull moved, over the trained steps, tcp),
ratio_put (median put seconds with delta / without), ratio_vllm (median whole update / median delta
update, seconds), exact, per_step [...], null_reasons, date, load (the 1-minute load average at the
start and the end), cores. Appended to benchmarks/results/delta_sync.jsonl unless ``--small``.

    .venv/bin/python benchmarks/delta_sync.py [--steps 6] [--small] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.spawn
import os
import queue
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

CTX = mp.get_context("spawn")
TIMEOUT = 900.0
LR = 1e-6
SEQ, BATCH = 128, 2

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


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """XXH3-64 of every tensor's bytes."""
    import xxhash

    return {
        n: xxhash.xxh3_64_intdigest(t.contiguous().view(-1).view(torch.uint8).numpy())
        for n, t in tensors.items()
    }


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


def trainer(endpoint: str, ns: str, small: bool, cmds: Any, out: Any) -> None:
    """Builds the model; on ("step", k): trains one step (none for k == 0), publishes bf16 to both
    namespaces, and answers what changed, the put times and the published tensors' digests."""
    import transformers

    from astate_store.store import Store

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(qwen2_config(small)).float()
    model.train()
    params = dict(model.named_parameters())  # tied: lm_head.weight is model.embed_tokens.weight
    opt = torch.optim.AdamW(params.values(), lr=LR, fused=True)
    pub = {n: torch.empty_like(p, dtype=torch.bfloat16) for n, p in params.items()}
    for n, p in params.items():
        pub[n].copy_(p.detach())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    stores = {
        "delta": Store(ns, endpoint=endpoint, rank=0, world_size=1, session_id=ns + "-d", delta=True),
        "plain": Store(ns + "-plain", endpoint=endpoint, rank=0, world_size=1, session_id=ns + "-p"),
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
                opt.step()
                opt.zero_grad(set_to_none=True)
                info["loss"] = round(float(loss.detach()), 4)
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
            info["digests"] = digests(pub)
            _send(out, "trainer", "put", info)
    finally:
        for s in stores.values():
            s.close()


# ------------------------------------------------------------------------------------ consumers


def consumer(role: str, endpoint: str, ns: str, small: bool, cmds: Any, out: Any) -> None:
    """On ("pull", k, digests): pulls step k whole and as a delta (the order alternating), checks
    both, and answers the times and the bytes each moved."""
    import transformers

    from astate_store.store import Store

    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape)
            for n, p in transformers.Qwen2ForCausalLM(qwen2_config(small)).named_parameters()
        }
    stores = {
        "whole": Store(ns, endpoint=endpoint, session_id=f"{ns}-{role}-w"),
        "delta": Store(ns, endpoint=endpoint, session_id=f"{ns}-{role}-d", delta=True),
    }
    bufs = {w: {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()} for w in stores}
    _send(out, role, "ready", {})
    try:
        while (cmd := cmds.get(timeout=TIMEOUT))[0] == "pull":
            k, want = cmd[1], cmd[2]
            info: dict[str, Any] = {"step": k}
            order = ("whole", "delta") if k % 2 else ("delta", "whole")
            for which in order:
                st = stores[which]
                before = st.stats
                t = time.perf_counter()
                got = st.get_into(bufs[which], step=k, timeout=TIMEOUT)
                info[f"{which}_seconds"] = round(time.perf_counter() - t, 4)
                after = st.stats
                assert got == k, (got, k)
                info[f"{which}_bytes"] = after.pull_bytes - before.pull_bytes
                if which == "delta":
                    info["delta_pull"] = after.delta_pulls > before.delta_pulls
                    info["delta_elements"] = after.delta_elements - before.delta_elements
            same = all(
                torch.equal(bufs["delta"][n].view(torch.int16), bufs["whole"][n].view(torch.int16))
                for n in shapes
            )
            info["exact"] = bool(same and digests(bufs["whole"]) == want)
            tr = stores["whole"].transport
            info["streamed_bytes"] = tr.streamed_bytes if hasattr(tr, "streamed_bytes") else None
            _send(out, role, "pull", info)
    finally:
        for s in stores.values():
            s.close()


# ------------------------------------------------------------------------------------ driver


class Roles:
    """The processes of one run, each answering on one queue."""

    def __init__(self) -> None:
        self.out = CTX.Queue()
        self.cmds: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}

    def start(self, role: str, fn: Any, args: tuple[Any, ...], netns: str | None = None) -> None:
        self.cmds[role] = CTX.Queue()
        p = CTX.Process(
            target=_role, args=(role, self.out, fn, *args, self.cmds[role], self.out), daemon=True
        )
        exe = mp.spawn.get_executable()
        if netns is not None:  # the interpreter started through `ip netns exec` (host B)
            mp.spawn.set_executable(_netns_exec(netns))
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


def _netns_exec(netns: str) -> str:
    path = os.path.join(tempfile.gettempdir(), f"{netns}-python.sh")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec ip netns exec {netns} {sys.executable} "$@"\n')
        os.chmod(path, 0o700)
    return path


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Inside host A: etcd, the trainer, the shm consumer, the engine; the tcp consumer in host B."""
    from astate_store.etcd.embedded import EmbeddedEtcd

    load0 = os.getloadavg()[0]
    ns = "delta-" + uuid.uuid4().hex[:8]
    result: dict[str, Any] = {"bench": "delta_sync", "null_reasons": {}}
    per_step: list[dict[str, Any]] = []
    roles = Roles()
    with EmbeddedEtcd(host=args.a_addr) as etcd:
        try:
            roles.start("trainer", trainer, (etcd.endpoint, ns, args.small))
            result["params"] = roles.wait("trainer")["params"]
            paths = ["shm"] + (["tcp"] if args.b_ns else [])
            if not args.b_ns:
                result["null_reasons"]["tcp"] = args.no_hosts
            for path in paths:
                roles.start(
                    path,
                    consumer,
                    (path, etcd.endpoint, ns, args.small),
                    args.b_ns if path == "tcp" else None,
                )
                roles.wait(path)
            for k in range(args.steps + 1):
                put = roles.ask("trainer", "step", k)
                want = put.pop("digests")
                row = {"step": k, **put}
                for path in paths:
                    got = roles.ask(path, "pull", k, want)
                    row[path] = {key: v for key, v in got.items() if key != "step"}
                per_step.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            roles.close()
    result["null_reasons"]["vllm"] = args.vllm_reason
    return summarize(result, per_step, load0)


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
    src = "tcp" if any("tcp" in r for r in trained) else "shm"
    moved = sum(r[src]["delta_bytes"] for r in trained)
    whole = sum(r[src]["whole_bytes"] for r in trained)
    result["bytes_ratio"] = round(moved / whole, 5) if whole else None
    result["ratio_put"] = _ratio(
        _median([r["put_delta_seconds"] for r in trained]), _median([r["put_plain_seconds"] for r in trained])
    )
    result["put_delta_seconds"] = _median([r["put_delta_seconds"] for r in trained])
    result["put_plain_seconds"] = _median([r["put_plain_seconds"] for r in trained])
    result.setdefault("ratio_vllm", None)
    result["exact"] = all(r[p]["exact"] for r in per_step for p in ("tcp", "shm", "vllm") if p in r) and bool(
        per_step
    )
    result["per_step"] = per_step
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    result["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    result["cores"] = len(os.sched_getaffinity(0))
    return result


# ------------------------------------------------------------------------------------ hosts


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class Hosts:
    """Two network namespaces joined by a veth pair: (A's name, A's address, B's name)."""

    def __init__(self) -> None:
        tag = "%06x" % int.from_bytes(os.urandom(3), "big")
        self.net = f"10.233.{int.from_bytes(os.urandom(1), 'big') % 254 + 1}"
        self.a, self.b = f"delta-{tag}-a", f"delta-{tag}-b"
        self.devs = (f"da{tag}", f"db{tag}")

    def __enter__(self) -> Hosts:
        try:
            for ns in (self.a, self.b):
                _ip("netns", "add", ns)
            _ip("link", "add", self.devs[0], "type", "veth", "peer", "name", self.devs[1])
            for ns, dev, addr in ((self.a, self.devs[0], ".1"), (self.b, self.devs[1], ".2")):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.net}{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
            try:
                os.unlink(os.path.join(tempfile.gettempdir(), f"{ns}-python.sh"))
            except OSError:
                pass


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
    args.vllm_reason = "skipped (--no-vllm)" if args.no_vllm else VLLM_PENDING
    if args.inside:
        print(json.dumps(run(args)), flush=True)
        return
    line = outer(args)
    print(json.dumps(line))
    if not args.small:
        out = Path(_HERE) / "results" / "delta_sync.jsonl"
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


VLLM_PENDING = (
    "the vLLM backend's delta updates are not merged yet (issue 37's engine branch adds keep_staging, "
    "which staged modules need to keep a base between updates)"
)


def outer(args: argparse.Namespace) -> dict[str, Any]:
    """Makes hosts A and B and runs the benchmark inside A; without namespaces (not root, no
    iproute2), runs it on this host without the tcp path."""
    from astate_store.etcd.embedded import tied_to_caller

    me = [sys.executable, os.path.abspath(__file__), "--inside", "--steps", str(args.steps)]
    me += ["--small"] * args.small + ["--no-vllm"] * args.no_vllm
    try:
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        hosts = Hosts().__enter__()
    except (OSError, subprocess.CalledProcessError) as exc:
        why = f"no network namespaces here ({exc}): no second host"
        cmd, hosts = [*me, "--no-hosts", why], None
    else:
        cmd = ["ip", "netns", "exec", hosts.a, *me, "--a-addr", f"{hosts.net}.1", "--b-ns", hosts.b]
    try:
        p = subprocess.run(tied_to_caller(cmd), stdout=subprocess.PIPE, text=True, timeout=TIMEOUT * 4)
    finally:
        if hosts is not None:
            hosts.__exit__()
    for ln in reversed(p.stdout.splitlines()):
        if ln.startswith("{"):
            return dict(json.loads(ln))
    raise RuntimeError(f"the run inside host A exited with {p.returncode} and no result")


if __name__ == "__main__":
    main()

"""Control-plane cost at model scale: R publisher ranks x T tiny tensors x C consumers, real etcd.

The tensors are tiny (a few bytes each), so what is measured is metadata: layouts, manifests,
commits, reader registration, planning. The model is DeepSeek-V3 with Hugging Face per-expert
names (~90k tensors with the FP8 ``weight_scale_inv``), experts spread over the ranks (EP),
everything else replicated on every rank; or a dense model split over the ranks (TP on dim 0).

Each step every publisher puts (concurrently), then each consumer pulls the whole model into
preallocated buffers, one consumer at a time (on 2 cores, concurrent consumers would measure
the scheduler). Figures, one JSON line:

    first_get_seconds     a consumer's first get_into (connect, layouts, plan), median over consumers
    steady_get_seconds    median get_into of steps >= 2
    steady_put_seconds    median put of steps >= 2 over ranks
    etcd_round_trips_put  etcd requests of one steady put (median over ranks and steps)
    etcd_round_trips_get  etcd requests of one steady get_into
    metadata_bytes_per_step  gRPC bytes etcd sent + received during one steady step (all processes)
    layout_bytes          bytes of every layout and manifest record in etcd

Usage: python benchmarks/control_plane.py [--model deepseek-v3-hf|dense] [--ranks 8] [--consumers 4]
       [--steps 4] [--layers N (fewer MoE layers, for quick runs)]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CTX = mp.get_context("spawn")

# (name, global shape, dtype name, expert index or -1)
Spec = list[tuple[str, tuple[int, ...], str, int]]


def deepseek_v3_hf(layers: int = 61, experts: int = 256, dense_layers: int = 3) -> Spec:
    """HF names of DeepSeek-V3 (FP8 weights with block scales), shapes shrunk to a few bytes."""
    out: Spec = [
        ("model.embed_tokens.weight", (4, 2), "bfloat16", -1),
        ("model.norm.weight", (2,), "bfloat16", -1),
        ("lm_head.weight", (4, 2), "bfloat16", -1),
    ]

    def fp8(prefix: str, expert: int) -> None:
        out.append((prefix + ".weight", (2, 2), "float8_e4m3fn", expert))
        out.append((prefix + ".weight_scale_inv", (1, 1), "float32", expert))

    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [
            (p + ".input_layernorm.weight", (2,), "bfloat16", -1),
            (p + ".post_attention_layernorm.weight", (2,), "bfloat16", -1),
            (p + ".self_attn.q_a_layernorm.weight", (2,), "bfloat16", -1),
            (p + ".self_attn.kv_a_layernorm.weight", (2,), "bfloat16", -1),
        ]
        for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            fp8(f"{p}.self_attn.{proj}", -1)
        mlp = ("gate_proj", "up_proj", "down_proj")
        if layer < dense_layers:
            for proj in mlp:
                fp8(f"{p}.mlp.{proj}", -1)
            continue
        out += [
            (p + ".mlp.gate.weight", (4, 2), "bfloat16", -1),
            (p + ".mlp.gate.e_score_correction_bias", (4,), "float32", -1),
        ]
        for proj in mlp:
            fp8(f"{p}.mlp.shared_experts.{proj}", -1)
        for e in range(experts):
            for proj in mlp:
                fp8(f"{p}.mlp.experts.{e}.{proj}", e)
    return out


def dense(layers: int = 80) -> Spec:
    """A Llama-style dense model; every matrix is split over the ranks on dim 0 (expert -2)."""
    out: Spec = [
        ("model.embed_tokens.weight", (64, 2), "bfloat16", -2),
        ("model.norm.weight", (2,), "bfloat16", -1),
        ("lm_head.weight", (64, 2), "bfloat16", -2),
    ]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out += [
            (p + ".input_layernorm.weight", (2,), "bfloat16", -1),
            (p + ".post_attention_layernorm.weight", (2,), "bfloat16", -1),
        ]
        out += [
            (f"{p}.self_attn.{n}.weight", (64, 2), "bfloat16", -2)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
        out += [
            (f"{p}.mlp.{n}.weight", (64, 2), "bfloat16", -2) for n in ("gate_proj", "up_proj", "down_proj")
        ]
    return out


def model(args: argparse.Namespace) -> Spec:
    if args.model == "dense":
        return dense()
    return deepseek_v3_hf(layers=args.layers)


def _tensors(spec: Spec, rank: int, ranks: int, *, consumer: bool) -> dict[str, Any]:
    import torch

    from astate_store import Shard
    from astate_store.model.dtypes import torch_dtype

    out: dict[str, Any] = {}
    for name, shape, dt, expert in spec:
        if consumer:
            out[name] = torch.zeros(shape, dtype=torch_dtype(dt))
        elif expert >= 0:
            if expert % ranks == rank:
                out[name] = torch.zeros(shape, dtype=torch_dtype(dt))
        elif expert == -2:  # split on dim 0
            rows = shape[0] // ranks
            out[name] = Shard(
                torch.zeros((rows,) + shape[1:], dtype=torch_dtype(dt)), (rank * rows, 0), shape
            )
        else:
            out[name] = torch.zeros(shape, dtype=torch_dtype(dt))
    return out


def publisher(
    endpoint: str, ns: str, rank: int, ranks: int, args: argparse.Namespace, cmds: Any, out: Any
) -> None:
    from astate_store.store import Store

    tensors = _tensors(model(args), rank, ranks, consumer=False)
    store = Store(
        ns, endpoint=endpoint, rank=rank, world_size=ranks, transport="shm", session_id=ns, lease_ttl=30
    )
    out.put(("ready", rank, len(tensors)))
    while True:
        cmd = cmds.get()
        if cmd[0] == "exit":
            break
        step = cmd[1]
        rpcs = store.catalog.client.rpcs
        t0 = time.perf_counter()
        store.put(step, tensors)
        out.put(("put", rank, time.perf_counter() - t0, store.catalog.client.rpcs - rpcs))
    store.close()


def consumer(
    endpoint: str, ns: str, index: int, ranks: int, args: argparse.Namespace, cmds: Any, out: Any
) -> None:
    from astate_store.store import Store

    bufs = _tensors(model(args), 0, ranks, consumer=True)
    store = Store(ns, endpoint=endpoint, transport="shm", lease_ttl=30)
    out.put(("ready", index, len(bufs)))
    while True:
        cmd = cmds.get()
        if cmd[0] == "exit":
            break
        step = cmd[1]
        store.wait(step, timeout=600)  # timed from the commit on: the metadata path alone
        rpcs = store.catalog.client.rpcs
        t0 = time.perf_counter()
        got = store.get_into(bufs, step=step, timeout=600)
        out.put(("got", index, time.perf_counter() - t0, store.catalog.client.rpcs - rpcs, got))
    store.close()


def _etcd_bytes(endpoint: str) -> int:
    """gRPC bytes the etcd server sent and received so far (its Prometheus metrics)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(
            ("etcd_network_client_grpc_sent_bytes_total", "etcd_network_client_grpc_received_bytes_total")
        ):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _record_bytes(endpoint: str, ns: str) -> int:
    import pyetcd

    host, _, port = endpoint.rpartition(":")
    client = pyetcd.client(
        host=host, port=int(port), grpc_options=[("grpc.max_receive_message_length", 1 << 30)]
    )
    total = 0
    for family in ("layouts", "manifests"):
        for value, _meta in client.get_prefix(f"/astate/{ns}/{family}/"):
            total += len(value)
    client.close()
    return total


def _expect(q: Any, kind: str, n: int) -> list[tuple[Any, ...]]:
    got = []
    for _ in range(n):
        msg = q.get(timeout=900)
        if msg[0] != kind:
            raise RuntimeError(f"expected {kind!r}, got {msg!r}")
        got.append(msg)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("deepseek-v3-hf", "dense"), default="deepseek-v3-hf")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--consumers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=61, help="DeepSeek-V3 layers (61; fewer for a quick run)")
    args = ap.parse_args()

    from astate_store.etcd.embedded import EmbeddedEtcd

    ns = f"cp-{os.getpid()}"
    with EmbeddedEtcd() as etcd:
        pq, cq, out = (
            [CTX.Queue() for _ in range(args.ranks)],
            [CTX.Queue() for _ in range(args.consumers)],
            CTX.Queue(),
        )
        procs = [
            CTX.Process(
                target=publisher, args=(etcd.endpoint, ns, r, args.ranks, args, pq[r], out), daemon=True
            )
            for r in range(args.ranks)
        ]
        procs += [
            CTX.Process(
                target=consumer, args=(etcd.endpoint, ns, c, args.ranks, args, cq[c], out), daemon=True
            )
            for c in range(args.consumers)
        ]
        for p in procs:
            p.start()
        try:
            ready = _expect(out, "ready", args.ranks + args.consumers)
            tensors = max(m[2] for m in ready)
            puts, gets, step_bytes = [], [], []
            for step in range(1, args.steps + 1):
                before = _etcd_bytes(etcd.endpoint)
                for q in pq:
                    q.put(("put", step))
                puts.append(_expect(out, "put", args.ranks))
                row = []
                for q in cq:  # one consumer at a time
                    q.put(("get", step))
                    row += _expect(out, "got", 1)
                gets.append(row)
                step_bytes.append(_etcd_bytes(etcd.endpoint) - before)
            steady_p = [m for s in puts[1:] for m in s]
            steady_g = [m for s in gets[1:] for m in s]
            print(
                json.dumps(
                    {
                        "model": args.model,
                        "tensors": tensors,
                        "ranks": args.ranks,
                        "consumers": args.consumers,
                        "first_get_seconds": round(statistics.median(m[2] for m in gets[0]), 3),
                        "steady_get_seconds": round(statistics.median(m[2] for m in steady_g), 4),
                        "first_put_seconds": round(max(m[2] for m in puts[0]), 3),
                        "steady_put_seconds": round(statistics.median(m[2] for m in steady_p), 4),
                        "etcd_round_trips_put": statistics.median(m[3] for m in steady_p),
                        "etcd_round_trips_get": statistics.median(m[3] for m in steady_g),
                        "metadata_bytes_per_step": int(statistics.median(step_bytes[1:])),
                        "layout_bytes": _record_bytes(etcd.endpoint, ns),
                        "cpus": os.cpu_count(),
                    }
                ),
                flush=True,
            )
        finally:
            for q in pq + cq:
                q.put(("exit",))
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()


if __name__ == "__main__":
    main()

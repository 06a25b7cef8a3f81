"""Plan a full trainer -> rollout weight sync at model scale and print ONE JSON line.

Trainer (Megatron-like): PP splits layers into contiguous stages balanced by parameter bytes
(embedding on the first stage, final norm + lm_head on the last); TP splits attention and dense
MLP (column-parallel on dim 0: q_b/kv_b/q/k/v/gate/up/embedding/lm_head; row-parallel on dim 1:
o_proj/down); MLA down-projections (q_a, kv_a), norms and the router are replicated over TP;
EP splits routed experts [E, out, in] on E and ETP (= TP) splits inside each expert (gate/up on
out, down on in), gate/up stored fused per expert like Megatron's GLU fc1. Dense tensors have
ep*dp replicas per stage, experts dp = gpus / (tp*pp*ep) replicas.

Rollout (vLLM-like): every instance TP-splits the same way (column/row parallel; experts split
inside each expert on the intermediate dim, no EP), q_a/kv_a/norms/router replicated, gate/up
fused per expert into w13 (strided destination views). Every rollout GPU is one consumer with its
own link. FP8 runs keep embeddings, norms and router in bf16 and add fp32 128x128 block scales.

Times: ``plan_seconds`` = pass 1 (balance + pre-pack decision) + pass 2 (final plan with the
packed copies as sources, all reads counted exactly; reads are materialized per consumer on
demand, ``materialize_seconds_one`` is one consumer's array). Pass 2 reuses pass 1's stages up to
balancing while pass 1's plan is alive (the planner memoizes them on the identity of its inputs),
so it pays for matching the packed copies, their templates, merging and totals only.
``plan_cpu_seconds`` is the same span in this process's CPU time (what the wall time would be on an idle
core; the machine is
shared). ``--config`` picks one of the three configurations of issue 30.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from astate_store.model.dtypes import itemsize  # noqa: E402
from astate_store.model.layout import Box, ShardRecord, TensorLayout, contiguous_strides  # noqa: E402
from astate_store.plan import CostModel, Fabric, Placement, Planner, plan_consumer, plan_global  # noqa: E402

BLOCK = 128


# ----------------------------------------------------------------------------------------------
# Model description: tensors with trainer / rollout split rules


class TSpec:
    __slots__ = ("name", "shape", "dtype", "train", "roll", "layer", "fuse", "unit")

    def __init__(self, name, shape, dtype, train, roll, layer, fuse=None, unit=None):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.train = train  # dim -> "tp" | "ep"
        self.roll = roll  # dim -> "tp"
        self.layer = layer  # -1 embedding, L final
        self.fuse = fuse  # (group key, part index, n parts, dim) for fused buffers
        self.unit = unit or {}  # dim -> split granularity (heads)

    @property
    def nbytes(self):
        return math.prod(self.shape) * itemsize(self.dtype)


def _linear(out, name, o, i, dtype, layer, train, roll, fuse=None, unit=None, experts=None):
    """A linear weight (+ fp8 block scale). ``train``/``roll`` map weight dims to split kinds."""
    lead = (experts,) if experts else ()
    out.append(TSpec(name, lead + (o, i), dtype, train, roll, layer, fuse, unit))
    if dtype.startswith("float8"):
        so, si = math.ceil(o / BLOCK), math.ceil(i / BLOCK)
        su = {d: max(1, u // BLOCK) for d, u in (unit or {}).items()}
        f = None if fuse is None else (fuse[0] + ".scale",) + fuse[1:]
        out.append(TSpec(name + "_scale_inv", lead + (so, si), "float32", train, roll, layer, f, su))


def model_tensors(model: str, dtype: str) -> tuple[list[TSpec], int]:
    wd = "float8_e4m3fn" if dtype == "fp8" else "bfloat16"
    bf = "bfloat16"
    t: list[TSpec] = []
    if model in ("kimi-k2", "deepseek-v3"):
        H = 7168
        L = 61
        E = 384 if model == "kimi-k2" else 256
        heads = 64 if model == "kimi-k2" else 128
        V = 163840 if model == "kimi-k2" else 129280
        moe_i, dense_i, qr, kvr, rope, nope, vd = 2048, 18432, 1536, 512, 64, 128, 128
        t.append(TSpec("model.embed_tokens.weight", (V, H), bf, {0: "tp"}, {0: "tp"}, -1))
        for l in range(L):
            p = f"model.layers.{l}."
            t.append(TSpec(p + "input_layernorm.weight", (H,), bf, {}, {}, l))
            t.append(TSpec(p + "post_attention_layernorm.weight", (H,), bf, {}, {}, l))
            a = p + "self_attn."
            _linear(t, a + "q_a_proj.weight", qr, H, wd, l, {}, {})
            t.append(TSpec(a + "q_a_layernorm.weight", (qr,), bf, {}, {}, l))
            _linear(t, a + "q_b_proj.weight", heads * (nope + rope), qr, wd, l, {0: "tp"}, {0: "tp"})
            _linear(t, a + "kv_a_proj_with_mqa.weight", kvr + rope, H, wd, l, {}, {})
            t.append(TSpec(a + "kv_a_layernorm.weight", (kvr,), bf, {}, {}, l))
            _linear(t, a + "kv_b_proj.weight", heads * (nope + vd), kvr, wd, l, {0: "tp"}, {0: "tp"})
            _linear(t, a + "o_proj.weight", H, heads * vd, wd, l, {1: "tp"}, {1: "tp"})
            m = p + "mlp."
            if l == 0:
                _linear(
                    t,
                    m + "gate_proj.weight",
                    dense_i,
                    H,
                    wd,
                    l,
                    {0: "tp"},
                    {0: "tp"},
                    fuse=(m + "gu", 0, 2, 0),
                )
                _linear(
                    t, m + "up_proj.weight", dense_i, H, wd, l, {0: "tp"}, {0: "tp"}, fuse=(m + "gu", 1, 2, 0)
                )
                _linear(t, m + "down_proj.weight", H, dense_i, wd, l, {1: "tp"}, {1: "tp"})
                continue
            t.append(TSpec(m + "gate.weight", (E, H), bf, {}, {}, l))
            t.append(TSpec(m + "gate.e_score_correction_bias", (E,), "float32", {}, {}, l))
            x = m + "experts."
            _linear(
                t,
                x + "gate_proj.weight",
                moe_i,
                H,
                wd,
                l,
                {0: "ep", 1: "tp"},
                {1: "tp"},
                fuse=(x + "w13", 0, 2, 1),
                experts=E,
            )
            _linear(
                t,
                x + "up_proj.weight",
                moe_i,
                H,
                wd,
                l,
                {0: "ep", 1: "tp"},
                {1: "tp"},
                fuse=(x + "w13", 1, 2, 1),
                experts=E,
            )
            _linear(t, x + "down_proj.weight", H, moe_i, wd, l, {0: "ep", 2: "tp"}, {2: "tp"}, experts=E)
            s = m + "shared_experts."
            _linear(
                t, s + "gate_proj.weight", moe_i, H, wd, l, {0: "tp"}, {0: "tp"}, fuse=(s + "gu", 0, 2, 0)
            )
            _linear(t, s + "up_proj.weight", moe_i, H, wd, l, {0: "tp"}, {0: "tp"}, fuse=(s + "gu", 1, 2, 0))
            _linear(t, s + "down_proj.weight", H, moe_i, wd, l, {1: "tp"}, {1: "tp"})
        t.append(TSpec("model.norm.weight", (H,), bf, {}, {}, L))
        t.append(TSpec("lm_head.weight", (V, H), bf, {0: "tp"}, {0: "tp"}, L))
        return t, L
    if model == "dense-70b":
        H, L, I, heads, kvh, hd, V = 8192, 80, 28672, 64, 8, 128, 128256
        t.append(TSpec("model.embed_tokens.weight", (V, H), bf, {0: "tp"}, {0: "tp"}, -1))
        for l in range(L):
            p = f"model.layers.{l}."
            t.append(TSpec(p + "input_layernorm.weight", (H,), bf, {}, {}, l))
            a = p + "self_attn."
            u = {0: hd}
            _linear(
                t,
                a + "q_proj.weight",
                heads * hd,
                H,
                wd,
                l,
                {0: "tp"},
                {0: "tp"},
                fuse=(a + "qkv", 0, 3, 0),
                unit=u,
            )
            _linear(
                t,
                a + "k_proj.weight",
                kvh * hd,
                H,
                wd,
                l,
                {0: "tp"},
                {0: "tp"},
                fuse=(a + "qkv", 1, 3, 0),
                unit=u,
            )
            _linear(
                t,
                a + "v_proj.weight",
                kvh * hd,
                H,
                wd,
                l,
                {0: "tp"},
                {0: "tp"},
                fuse=(a + "qkv", 2, 3, 0),
                unit=u,
            )
            _linear(t, a + "o_proj.weight", H, heads * hd, wd, l, {1: "tp"}, {1: "tp"}, unit={1: hd})
            t.append(TSpec(p + "post_attention_layernorm.weight", (H,), bf, {}, {}, l))
            m = p + "mlp."
            _linear(t, m + "gate_proj.weight", I, H, wd, l, {0: "tp"}, {0: "tp"}, fuse=(m + "gu", 0, 2, 0))
            _linear(t, m + "up_proj.weight", I, H, wd, l, {0: "tp"}, {0: "tp"}, fuse=(m + "gu", 1, 2, 0))
            _linear(t, m + "down_proj.weight", H, I, wd, l, {1: "tp"}, {1: "tp"})
        t.append(TSpec("model.norm.weight", (H,), bf, {}, {}, L))
        t.append(TSpec("lm_head.weight", (V, H), bf, {0: "tp"}, {0: "tp"}, L))
        return t, L
    raise SystemExit(f"unknown model {model}")


def _split(n: int, k: int, i: int, unit: int = 1) -> tuple[int, int]:
    """(offset, size) of part i of k of a dim of n, in whole units; more parts than units
    replicate units (like KV heads with TP > heads)."""
    units = max(n // unit, 1) if n % unit == 0 else n
    unit = n // units
    if k > units:
        j = i * units // k
        return j * unit, unit
    base, rem = divmod(units, k)
    start = i * base + min(i, rem)
    size = base + (1 if i < rem else 0)
    return start * unit, size * unit


def _stage_of_layers(specs: list[TSpec], L: int, pp: int) -> dict[int, int]:
    """Contiguous partition of [embed, layers..., head] into pp stages minimizing the max bytes."""
    w = np.zeros(L + 2)
    for s in specs:
        w[s.layer + 1] += s.nbytes
    n = L + 2
    pref = np.concatenate([[0.0], np.cumsum(w)])
    INF = float("inf")
    best = np.full((pp + 1, n + 1), INF)
    cut = np.zeros((pp + 1, n + 1), np.int64)
    best[0, 0] = 0.0
    for k in range(1, pp + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1, i], pref[j] - pref[i])
                if v < best[k, j]:
                    best[k, j] = v
                    cut[k, j] = i
    bounds = []
    j = n
    for k in range(pp, 0, -1):
        i = int(cut[k, j])
        bounds.append((i, j))
        j = i
    bounds.reverse()
    out = {}
    for st, (a, b) in enumerate(bounds):
        for item in range(a, b):
            out[item - 1] = st
    return out


def _local_box(spec: TSpec, rules: dict, idx: dict, sizes: dict) -> Box:
    offs, szs = [], []
    for d, n in enumerate(spec.shape):
        kind = rules.get(d)
        if kind is None:
            offs.append(0)
            szs.append(n)
        else:
            o, s = _split(n, sizes[kind], idx[kind], spec.unit.get(d, 1))
            offs.append(o)
            szs.append(s)
    return Box(tuple(offs), tuple(szs))


def _place(specs_boxes, cursor: int, align: int = 256):
    """Lay records out in one flat region; fused groups share a buffer along the fuse dim.
    Returns [(spec, box, strides, byte_offset)], new cursor."""
    out = []
    groups: dict = {}
    for spec, box in specs_boxes:
        if spec.fuse is None:
            cursor = -(-cursor // align) * align
            out.append((spec, box, contiguous_strides(box.sizes), cursor))
            cursor += box.numel * itemsize(spec.dtype)
            continue
        key, part, nparts, fdim = spec.fuse
        groups.setdefault(key, []).append((part, nparts, fdim, spec, box))
        if len(groups[key]) == nparts:
            parts = sorted(groups.pop(key), key=lambda x: x[0])
            fsz = sum(p[4].sizes[fdim] for p in parts)
            shape = list(parts[0][4].sizes)
            shape[fdim] = fsz
            strides = contiguous_strides(shape)
            cursor = -(-cursor // align) * align
            isz = itemsize(spec.dtype)
            acc = 0
            for _, _, _, sp, bx in parts:
                out.append((sp, bx, strides, cursor + acc * strides[fdim] * isz))
                acc += bx.sizes[fdim]
            cursor += math.prod(shape) * isz
    assert not groups
    return out, cursor


def build(args):
    specs, L = model_tensors(args.model, args.dtype)
    tp, ep, pp = args.trainer_tp, args.trainer_ep, args.trainer_pp
    if args.trainer_gpus % (tp * ep * pp):
        raise SystemExit("trainer-gpus must be a multiple of tp*ep*pp")
    dp = args.trainer_gpus // (tp * ep * pp)
    per_stage = tp * ep * dp
    stage = _stage_of_layers(specs, L, pp)
    by_stage: dict[int, list[TSpec]] = {}
    for s in specs:
        by_stage.setdefault(stage[s.layer], []).append(s)
    shards: dict[str, list[ShardRecord]] = {s.name: [] for s in specs}
    for st_i, ss in by_stage.items():
        for g in range(per_stage):
            rank = st_i * per_stage + g
            tp_i = g % tp
            ep_i = (g // tp) % ep
            boxes = [(s, _local_box(s, s.train, {"tp": tp_i, "ep": ep_i}, {"tp": tp, "ep": ep})) for s in ss]
            placed, _ = _place(boxes, 0)
            for s, box, strides, off in placed:
                shards[s.name].append(ShardRecord(s.name, s.dtype, s.shape, box, strides, rank, 0, off))
    layouts = {}
    for s in specs:
        recs = sorted(shards[s.name], key=lambda r: (r.box.offsets, r.box.sizes, r.rank, r.region))
        layouts[s.name] = TensorLayout(s.name, s.dtype, s.shape, tuple(recs))
    rtp = args.rollout_tp
    per_rank = []
    for k in range(rtp):
        boxes = [(s, _local_box(s, s.roll, {"tp": k}, {"tp": rtp})) for s in specs]
        placed, _ = _place(boxes, 0)
        per_rank.append(
            tuple(
                ShardRecord(s.name, s.dtype, s.shape, box, strides, k, 0, off)
                for s, box, strides, off in placed
            )
        )
    requests = {}
    for inst in range(args.rollout_instances):
        for k in range(rtp):
            requests[inst * rtp + k] = per_rank[k]  # identical layouts share one tuple
    topo = None
    if args.topology:
        gph = args.gpus_per_host
        src = {
            r: Placement(f"t{r // gph}", numa=(r % gph) * 2 // gph, nic=f"rail{r % gph}")
            for r in range(args.trainer_gpus)
        }
        con = {
            c: Placement(f"r{c // gph}", numa=(c % gph) * 2 // gph, nic=f"rail{c % gph}") for c in requests
        }
        topo = Fabric(src, con)
    return specs, layouts, requests, topo, dp


def simulate_publishers(items: dict) -> list:
    """Each publisher packs its items back to back into region 1."""
    packed = []
    for rank, its in items.items():
        off = 0
        for it in its:
            packed.append(it.packed(region=1, byte_offset=off))
            off += -(-it.nbytes // 256) * 256
    return packed


#: The three configurations of issue 30 (``--config``); explicit options override them.
CONFIGS = {
    "kimi-k2": dict(
        model="kimi-k2",
        dtype="fp8",
        trainer_gpus=256,
        trainer_tp=8,
        trainer_ep=8,
        trainer_pp=4,
        rollout_instances=16,
        rollout_tp=16,
    ),
    "deepseek-v3": dict(
        model="deepseek-v3",
        dtype="fp8",
        trainer_gpus=128,
        trainer_tp=8,
        trainer_ep=8,
        trainer_pp=2,
        rollout_instances=8,
        rollout_tp=8,
    ),
    "dense-70b": dict(
        model="dense-70b",
        dtype="bf16",
        trainer_gpus=64,
        trainer_tp=8,
        trainer_ep=1,
        trainer_pp=2,
        rollout_instances=32,
        rollout_tp=2,
    ),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--config",
        choices=sorted(CONFIGS),
        default=None,
        help="one of the named configurations (explicit options given after it override it)",
    )
    ap.add_argument("--model", choices=["kimi-k2", "deepseek-v3", "dense-70b"], default="kimi-k2")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--trainer-gpus", type=int, default=256)
    ap.add_argument("--trainer-tp", type=int, default=8)
    ap.add_argument("--trainer-ep", type=int, default=8)
    ap.add_argument("--trainer-pp", type=int, default=4)
    ap.add_argument("--rollout-instances", type=int, default=16)
    ap.add_argument("--rollout-tp", type=int, default=16)
    ap.add_argument("--nic-gbps", type=float, default=400.0, help="per GPU link, Gbit/s")
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument(
        "--consumers-reserve",
        action="store_true",
        help="P2P fan-out: the first half of the rollout instances (wave 1) reads from the trainer; "
        "their buffers are then republished as replicas and wave 2 reads from them "
        "(sequential waves, makespan = wave 1 + wave 2)",
    )
    ap.add_argument("--topology", action="store_true", help="pass host/NUMA/rail placements to the planner")
    ap.add_argument("--balance", choices=["greedy", "rotation"], default="greedy")
    args = ap.parse_args(argv)
    if args.config is not None:
        given = {
            a.split("=")[0][2:].replace("-", "_")
            for a in (argv if argv is not None else sys.argv[1:])
            if a.startswith("--")
        }
        for k, v in CONFIGS[args.config].items():
            if k not in given:
                setattr(args, k, v)
    if args.model == "dense-70b" and args.trainer_ep != 1 and "--trainer-ep" not in (argv or sys.argv):
        args.trainer_ep = 1

    t_build = time.perf_counter()
    specs, layouts, requests, topo, dp = build(args)
    t_build = time.perf_counter() - t_build
    cost = CostModel(link_gb_per_s=args.nic_gbps / 8)

    if args.consumers_reserve:
        return reserve(args, specs, layouts, requests, topo, dp, cost, t_build)

    c0 = time.process_time()
    t0 = time.perf_counter()
    gp1 = plan_global(layouts, requests, topology=topo, cost=cost, balance=args.balance)
    items = gp1.pack_items()
    t1 = time.perf_counter()
    c1 = time.process_time()
    packed = simulate_publishers(items)
    c2 = time.process_time()
    t2 = time.perf_counter()
    gp = plan_global(layouts, requests, topology=topo, cost=cost, packed=packed, balance=args.balance)
    reads = gp.total_reads
    t3 = time.perf_counter()
    c3 = time.process_time()
    first = next(iter(requests))
    t4 = time.perf_counter()
    r0 = gp.reads(first)
    t5 = time.perf_counter()
    assert len(r0) == gp.read_count(first)
    # steady state: a Planner's first call fingerprints (hashes the frozen inputs), an unchanged
    # step is a cache hit (memoized hashes: one lookup per tensor and per consumer)
    planner = Planner(cost)
    t6 = time.perf_counter()
    planner.plan(layouts, requests, topology=topo, packed=packed, balance=args.balance)
    t7 = time.perf_counter()
    planner.plan(layouts, requests, topology=topo, packed=packed, balance=args.balance)
    t8 = time.perf_counter()
    assert planner.hits == 1
    # one consumer planning itself (what a data path calls), rotation = its instance index
    last = list(requests)[-1]
    my_packed = [p for p in packed if last in p.consumers]
    t9 = time.perf_counter()
    cp = plan_consumer(
        layouts,
        requests[last],
        consumer=last,
        rotation=last // args.rollout_tp,
        stagger=last,
        topology=topo,
        cost=cost,
        packed=my_packed,
    )
    t10 = time.perf_counter()

    bw = args.nic_gbps / 8 * 1e9
    src_link = gp.src_link_bytes()
    dst = np.array(list(gp.dst_bytes().values()), np.float64)
    total = float(dst.sum())
    n_src_links = args.trainer_gpus
    makespan = max(src_link.max(), dst.max()) / bw
    lower = max(dst.max() / bw, total / (n_src_links * bw))
    out = {
        "config": args.config,
        "model": args.model,
        "dtype": args.dtype,
        "trainer_gpus": args.trainer_gpus,
        "trainer_tp": args.trainer_tp,
        "trainer_ep": args.trainer_ep,
        "trainer_pp": args.trainer_pp,
        "trainer_dp": dp,
        "rollout_instances": args.rollout_instances,
        "rollout_tp": args.rollout_tp,
        "balance": args.balance,
        "topology": bool(args.topology),
        "consumers_reserve": False,
        "tensors": len(specs),
        "params": int(sum(math.prod(s.shape) for s in specs if not s.name.endswith("_scale_inv"))),
        "plan_seconds": round((t1 - t0) + (t3 - t2), 4),
        "plan_cpu_seconds": round((c1 - c0) + (c3 - c2), 4),
        "plan_seconds_pass1": round(t1 - t0, 4),
        "plan_seconds_pass2": round(t3 - t2, 4),
        "materialize_seconds_one": round(t5 - t4, 4),
        "planner_miss_seconds": round(t7 - t6, 4),
        "planner_hit_seconds": round(t8 - t7, 4),
        "plan_consumer_seconds": round(t10 - t9, 4),
        "plan_consumer_reads": int(cp.read_count),
        "reads": int(reads),
        "reads_before_prepack": int(gp1.total_reads),
        "pack_items": int(sum(len(v) for v in items.values())),
        "pack_bytes": int(sum(it.nbytes for v in items.values() for it in v)),
        "bytes_total": int(total),
        "max_src_bytes": int(src_link.max()),
        "mean_src_bytes": int(total / n_src_links),
        "max_dst_bytes": int(dst.max()),
        "mean_dst_bytes": int(dst.mean()),
        "makespan_seconds": round(makespan, 4),
        "lower_bound_seconds": round(lower, 4),
        "ratio": round(makespan / lower, 4),
        "per_read_overhead_seconds_max_consumer": round(
            max(gp.read_counts().values()) * cost.per_read_seconds, 4
        ),
        "build_seconds": round(t_build, 2),
    }
    print(json.dumps(out))


PEER_RANK = 1_000_000


def reserve(args, specs, layouts, requests, topo, dp, cost, t_build):
    """Two waves: wave 1 from the trainer, wave 2 from wave-1 consumers (republished layouts)."""
    rtp = args.rollout_tp
    w1 = (args.rollout_instances + 1) // 2
    req1 = {c: r for c, r in requests.items() if c // rtp < w1}
    req2 = {c: r for c, r in requests.items() if c // rtp >= w1}
    t0 = time.perf_counter()
    gp1 = plan_global(layouts, req1, topology=topo, cost=cost, balance=args.balance)
    items = gp1.pack_items()
    t1 = time.perf_counter()
    packed = simulate_publishers(items)
    t2 = time.perf_counter()
    gpa = plan_global(layouts, req1, topology=topo, cost=cost, packed=packed, balance=args.balance)
    # wave-1 consumers' buffers as publisher shards (peer rank ids above the trainer's)
    by_name: dict = {}
    for c, recs in req1.items():
        for r in recs:
            by_name.setdefault(r.name, []).append(
                ShardRecord(
                    r.name, r.dtype, r.global_shape, r.box, r.strides, PEER_RANK + c, r.region, r.byte_offset
                )
            )
    peer_layouts = {
        n: TensorLayout(
            n,
            layouts[n].dtype,
            layouts[n].global_shape,
            tuple(sorted(v, key=lambda x: (x.box.offsets, x.box.sizes, x.rank))),
        )
        for n, v in by_name.items()
    }
    gpb = plan_global(peer_layouts, req2, cost=cost, balance=args.balance) if req2 else None
    reads = gpa.total_reads + (gpb.total_reads if gpb else 0)
    t3 = time.perf_counter()
    bw = args.nic_gbps / 8 * 1e9
    dst_a = np.array(list(gpa.dst_bytes().values()), np.float64)
    dst_b = np.array(list(gpb.dst_bytes().values()), np.float64) if gpb else np.zeros(1)
    src_a = gpa.src_link_bytes()
    src_b = gpb.src_link_bytes() if gpb else np.zeros(1)
    t_a = max(src_a.max(), dst_a.max()) / bw
    t_b = max(src_b.max(), dst_b.max()) / bw
    total = float(dst_a.sum() + dst_b.sum())
    n_src = args.trainer_gpus
    n_cons = len(requests)
    # with re-serving, wave-1 consumer links count as sources too
    lower = max(max(dst_a.max(), dst_b.max()) / bw, total / ((n_src + n_cons) * bw))
    out = {
        "model": args.model,
        "dtype": args.dtype,
        "trainer_gpus": args.trainer_gpus,
        "trainer_dp": dp,
        "rollout_instances": args.rollout_instances,
        "rollout_tp": rtp,
        "consumers_reserve": True,
        "wave1_instances": w1,
        "plan_seconds": round((t1 - t0) + (t3 - t2), 4),
        "reads": int(reads),
        "bytes_total": int(total),
        "max_src_bytes": int(max(src_a.max(), src_b.max())),
        "mean_src_bytes": int(total / (n_src + len(req1))),  # trainer links + re-serving wave-1 links
        "max_dst_bytes": int(max(dst_a.max(), dst_b.max())),
        "mean_dst_bytes": int(total / n_cons),
        "wave1_seconds": round(t_a, 4),
        "wave2_seconds": round(t_b, 4),
        "makespan_seconds": round(t_a + t_b, 4),
        "lower_bound_seconds": round(lower, 4),
        "ratio": round((t_a + t_b) / lower, 4),
        "direct_lower_bound_seconds": round(max(max(dst_a.max(), dst_b.max()) / bw, total / (n_src * bw)), 4),
        "build_seconds": round(t_build, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

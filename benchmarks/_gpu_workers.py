"""GPU sync benchmark for ``benchmarks/gpu_check.sh``; prints ONE JSON line.

Cases (``--gib`` of fp32 in ``--tensors`` equal tensors, default 4 GiB in 16):
  host_to_gpu  a publisher process puts CPU tensors (snapshot in host staging); this process pulls
               them with ``get_into`` into preallocated CUDA buffers.
  gpu_to_gpu   a publisher process puts CUDA tensors (snapshot in device staging); this process
               pulls them into CUDA buffers on the same or another GPU (UCX cuda_ipc).
References, same bytes: ``h2d_copy_gbps`` (pinned host -> device ``copy_``) and ``d2d_copy_gbps``
(device ``copy_``). Every pull is checked against the publisher's values on the device.
Exits 2 with a JSON line {"error": ...} when torch sees no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
import uuid
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))

import torch  # noqa: E402

CTX = mp.get_context("spawn")


def _values(i: int, numel: int, device: str) -> torch.Tensor:
    """Tensor ``i``'s values: distinct per position and per tensor (exact in fp32 below 2**24)."""
    return torch.arange(numel, dtype=torch.float32, device=device).remainder_(1 << 23).add_(i)


def publisher(endpoint: str, ns: str, device: str, n: int, numel: int, out: Any, stop: Any) -> None:
    try:
        from astate_store.store import Store

        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        tensors = {f"t{i:03d}": _values(i, numel, device) for i in range(n)}
        store = Store(ns, endpoint=endpoint, transport="auto")
        times = []
        for step in (1, 2):  # the second put is the steady one (pool and registrations exist)
            t0 = time.perf_counter()
            store.put(step, tensors)
            times.append(time.perf_counter() - t0)
        out.put(("ok", {"put_seconds": [round(t, 4) for t in times]}))
        stop.wait(900)
        store.close()
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))


def _pull_case(
    endpoint: str, src_device: str, dst_device: str, n: int, numel: int, iters: int
) -> dict[str, Any]:
    from astate_store.store import Store

    ns = f"gpu-{uuid.uuid4().hex[:8]}"
    out, stop = CTX.Queue(), CTX.Event()
    p = CTX.Process(target=publisher, args=(endpoint, ns, src_device, n, numel, out, stop), daemon=True)
    p.start()
    try:
        status, payload = out.get(timeout=300)
        if status != "ok":
            return {"error": payload[-1500:]}
        bufs = {f"t{i:03d}": torch.zeros(numel, dtype=torch.float32, device=dst_device) for i in range(n)}
        nbytes = n * numel * 4
        with Store(ns, endpoint=endpoint, transport="auto") as store:
            store.wait(2, timeout=120)
            times = []
            for k in range(iters + 1):  # the first pull connects and plans
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                store.get_into(bufs, step=2, timeout=300)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            bad = [
                name
                for i, (name, b) in enumerate(bufs.items())
                if not torch.equal(b, _values(i, numel, dst_device))
            ]
            peers = [store.transport.peer_info(x).lanes[:300] for x in store.transport.peers]
        steady = times[1:]
        med = statistics.median(steady)
        return {
            "gbps": round(nbytes / med / 1e9, 3),
            "seconds": round(med, 4),
            "first_step_seconds": round(times[0], 4),
            "times": [round(t, 4) for t in steady],
            "put_seconds": payload["put_seconds"],
            "verified": not bad,
            "mismatched": bad[:5],
            "bytes": nbytes,
            "endpoint": peers[:1],
        }
    finally:
        stop.set()
        p.join(60)
        if p.is_alive():
            p.kill()


def _copy_refs(nbytes: int, dev: str) -> dict[str, float]:
    src_h = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
    dst_d = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
    src_d = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)

    def best(fn: Any) -> float:
        b = float("inf")
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            b = min(b, time.perf_counter() - t0)
        return round(nbytes / b / 1e9, 3)

    out = {
        "h2d_copy_gbps": best(lambda: dst_d.copy_(src_h, non_blocking=True)),
        "d2d_copy_gbps": best(lambda: dst_d.copy_(src_d)),
    }
    return out  # the buffers go with this frame (main empties the cache after)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="GiB of fp32 per case (default 4)")
    ap.add_argument("--tensors", type=int, default=16, help="tensors the bytes are split into (default 16)")
    ap.add_argument("--iters", type=int, default=3, help="timed pulls after the first (default 3)")
    ap.add_argument("--cases", default="host_to_gpu,gpu_to_gpu")
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.tensors < 1 or args.iters < 1:
        ap.error("--gib must be > 0, --tensors >= 1, --iters >= 1")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - {"host_to_gpu", "gpu_to_gpu"}
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}")
    if not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    "error": "torch sees no CUDA device (torch.cuda.is_available() is False)",
                    "torch": torch.__version__,
                    "torch_cuda": torch.version.cuda,
                }
            ),
            flush=True,
        )
        return 2
    from astate_store.etcd.embedded import EmbeddedEtcd

    numel = int(args.gib * 2**30 / 4 / args.tensors)
    nbytes = numel * 4 * args.tensors
    ndev = torch.cuda.device_count()
    dst = "cuda:1" if ndev > 1 else "cuda:0"
    out: dict[str, Any] = {
        "bytes": nbytes,
        "tensors": args.tensors,
        "devices": ndev,
        "device_name": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    out.update(_copy_refs(nbytes, dst))
    torch.cuda.empty_cache()
    res: dict[str, Any] = {}
    with EmbeddedEtcd() as etcd:
        for case in cases:
            src = "cpu" if case == "host_to_gpu" else "cuda:0"
            try:
                res[case] = _pull_case(etcd.endpoint, src, dst, args.tensors, numel, args.iters)
            except Exception as exc:  # noqa: BLE001 - report the case, run the next
                res[case] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
            torch.cuda.empty_cache()
    out["cases"] = res
    for case, ref in (("host_to_gpu", "h2d_copy_gbps"), ("gpu_to_gpu", "d2d_copy_gbps")):
        g = res.get(case, {}).get("gbps")
        out[f"{case}_gbps"] = g
        out[f"ratio_{case}"] = round(g / out[ref], 3) if g and out[ref] else None
    print(json.dumps(out), flush=True)
    return 0 if all("error" not in v and v.get("verified") for v in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

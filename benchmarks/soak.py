"""Soak: 1,000 steps of a job's whole life, with churn; do process resources, etcd and storage stay flat?

Every step:

- a publisher group (2 ranks, each its own process) puts the step;
- a consumer (one of two consumer processes, in turn) joins, pulls the step in a rotating layout
  (whole, column halves, a subset, converted to bf16, strided), checks every byte and leaves;
- an opener process opens a store, reads ``latest()`` and closes it;
- every ``--ckpt-every`` (50) steps both ranks write a checkpoint under the retention policy
  (``keep_last``/``keep_every`` where ``Store.checkpoint`` takes them, else the driver retires
  old checkpoints itself);
- every ``--restart-every`` (100) steps the publisher group is SIGKILLed and a new group (new
  processes, new session) recovers the newest state and carries on.

Every ``--sample-every`` (10) steps: RSS, open fds and threads of the long-lived processes (the two
consumers, the opener) and of the publishers, etcd's key count (by family) and db size, the
/dev/shm entries and memfds the run's processes hold, and the checkpoint bytes on storage.

Appends one JSON line to ``benchmarks/results/soak.jsonl``:

- ``steps``, ``warmup_steps``; ``rss_growth``, ``anon_growth`` (anonymous memory: where a leak grows;
  RSS also counts the publishers' shared staging pages mapped at the moment, which restarts change),
  ``fds_growth``, ``threads_growth``: growth over the
  steps after the warm-up as a fraction of the value after warm-up (median of the last 5 samples
  against the median of the first 5 after warm-up, so one sample's noise does not count), the
  largest over the long-lived processes; ``growth_by_process`` has each one's, with the
  least-squares trend over the same steps;
- ``bounded``: the checkpoints on storage never exceeded what the retention settings allow (and
  their bytes that many checkpoints' bytes), and no family of etcd keys grew after warm-up beyond
  what it held in the first 200 steps after it (checkpoint records: within the retention bound),
  both between restarts; samples taken right after a restart (the killed group's records live
  until their lease ends) may hold at most twice the steady key count;
- ``orphans``: processes this run started that still ran at its end (must be empty);
- ``samples``; ``errors`` (wrong bytes, failed steps); the date and load.

    python benchmarks/soak.py [--steps 1000] [--keep-last 3] [--keep-every 500] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for p in (str(_HERE), str(_HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

from tests.support.faults.driver import Actor, Died, Hang, Pool, SetupError  # noqa: E402
from tests.support.faults.model import LAYOUTS, slope_per_100  # noqa: E402

WORLD = 2
LONG_LIVED = ("consumer0", "consumer1", "opener")


# ---------------------------------------------------------------------------------------- probes


def etcd_keys(client: Any) -> dict[str, int]:
    """Key count per family: the key's first three path segments (``/astate/<ns>/<family>``)."""
    fam: dict[str, int] = {}
    for _v, meta in client.get_all(keys_only=True):
        parts = meta.key.decode(errors="replace").split("/")
        name = "/".join(parts[:2] + parts[3:4]) if len(parts) > 3 else "/".join(parts[:3])
        fam[name] = fam.get(name, 0) + 1
    return fam


def etcd_db(client: Any) -> dict[str, int]:
    from pyetcd.etcdrpc import rpc_pb2  # type: ignore[import-not-found]

    st = client.maintenancestub.Status(rpc_pb2.StatusRequest(), client.timeout)
    return {"db_size": int(st.dbSize), "db_in_use": int(getattr(st, "dbSizeInUse", 0))}


def _fd_links(pid: int) -> list[str]:
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return out


def shm_and_memfd(pids: Sequence[int]) -> dict[str, int]:
    """/dev/shm entries the run's processes hold open or map, and their memfds."""
    shm, memfd = set(), 0
    for pid in pids:
        for link in _fd_links(pid):
            if link.startswith("/dev/shm/"):
                shm.add(link)
            elif link.startswith("/memfd:"):
                memfd += 1
        try:
            with open(f"/proc/{pid}/maps") as f:
                shm.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line)
        except OSError:
            pass
    return {"shm": len(shm), "memfd": memfd}


def tree_bytes(path: str) -> tuple[int, int]:
    """(bytes, checkpoints) under the checkpoint root (a checkpoint: a ``step-N`` directory per step,
    complete or still being written)."""
    total, steps = 0, 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    try:
        steps = sum(1 for e in os.scandir(path) if e.is_dir() and e.name.startswith("step-"))
    except OSError:
        pass
    return total, steps


# ------------------------------------------------------------------------------------- the run


class Soak:
    def __init__(self, args: argparse.Namespace):
        from astate_store.etcd.embedded import EmbeddedEtcd

        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="astate-soak-")
        self.uri = os.path.join(self.tmp, "ckpt")
        # auto-compaction: without it etcd keeps every revision and its db grows with every put
        self.etcd = EmbeddedEtcd(
            data_dir=os.path.join(self.tmp, "etcd"),
            extra_args=["--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000"],
        ).start()
        self.ep = self.etcd.endpoint
        import pyetcd  # type: ignore[import-not-found]

        host, port = self.ep.rsplit(":", 1)
        self.client = pyetcd.client(host=host, port=int(port))
        self.ns = "soak"
        os.makedirs(os.path.join(self.tmp, "logs"))
        self.pool = Pool(os.path.join(self.tmp, "logs"), spares=WORLD)
        self.gen = 0
        self.pubs: list[Actor] = []
        self.cons = [self.pool.take(), self.pool.take()]
        self.opener = self.pool.take()
        self.errors: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.kept: list[int] = []  # checkpoints the driver keeps when the store cannot retire them
        self.retention_in_store: bool | None = None
        self.recoveries: list[dict[str, Any]] = []
        self.ckpt_bytes_each = 0

    # ---- the publisher group
    def start_group(self, recover: bool) -> None:
        self.gen += 1
        self.pubs = [self.pool.take() for _ in range(WORLD)]
        session = f"{self.ns}-g{self.gen}"
        for r, a in enumerate(self.pubs):
            a.must(
                "pub_open",
                "p",
                self.ep,
                self.ns,
                rank=r,
                world=WORLD,
                session=session,
                size="small",
                transport="shm",
                lease_ttl=5.0,
                affinity=False,
                timeout=120,
            )
        if recover:
            ids = [a.send("pub_recover", "p", timeout=90) for a in self.pubs]
            res = [a.result(i, 120) for a, i in zip(self.pubs, ids)]
            for r in res:
                if not r["ok"] or not r["result"]["exact"]:
                    self.errors.append(f"recover (group {self.gen}): {r}"[:400])
            self.recoveries.append(
                {"group": self.gen, "steps": [r.get("result", {}).get("step") for r in res]}
            )

    def kill_group(self) -> None:
        for a in self.pubs:
            a.kill()
        self.pubs = []

    def put(self, s: int) -> None:
        ids = [a.send("pub_put", "p", s) for a in self.pubs]
        for a, i in zip(self.pubs, ids):
            r = a.result(i, 120)
            if not r["ok"]:
                self.errors.append(f"put {s}: {r.get('etype')}: {r.get('msg')}"[:400])

    def checkpoint(self, s: int) -> None:
        a = self.args
        ids = [
            p.send(
                "pub_checkpoint", "p", s, self.uri, keep_last=a.keep_last, keep_every=a.keep_every, timeout=60
            )
            for p in self.pubs
        ]
        res = [p.result(i, 180) for p, i in zip(self.pubs, ids)]
        for r in res:
            if not r["ok"]:
                self.errors.append(f"checkpoint {s}: {r.get('etype')}: {r.get('msg')}"[:400])
                return
        self.retention_in_store = bool(res[0]["result"]["retention"])
        if not any(r["result"]["complete"] for r in res):
            self.errors.append(f"checkpoint {s}: no rank completed it")
        if not self.retention_in_store:
            self._retire_by_hand(s)

    def _retire_by_hand(self, s: int) -> None:
        """Without retention in the store: keep the policy's checkpoints, remove the rest (files;
        their catalog records stay, which ``bounded`` then shows)."""
        from astate_store.checkpoint.retention import RetentionPolicy, keep_reasons

        self.kept.append(s)
        why = keep_reasons(self.kept, RetentionPolicy(self.args.keep_last, self.args.keep_every), upto=s)
        for step, reason in why.items():
            if reason == "remove":
                shutil.rmtree(os.path.join(self.uri, f"step-{step:020d}"), ignore_errors=True)
                self.kept.remove(step)

    # ---- consumers
    def churn(self, s: int) -> None:
        con = self.cons[s % 2]
        key, lay = f"c{s}", LAYOUTS[s % len(LAYOUTS)]
        con.must(
            "con_open",
            key,
            self.ep,
            self.ns,
            size="small",
            transport="shm",
            read_timeout=20.0,
            lease_ttl=5.0,
            timeout=60,
        )
        r = con.call("con_pull", key, lay, step=s, wait=60, timeout=120)
        if not r["ok"] or not r["result"]["exact"] or r["result"]["step"] < s:
            self.errors.append(f"pull {s} ({lay}): {r}"[:400])
        con.must("close", key, timeout=60)
        r = self.opener.call("open_close", self.ep, self.ns, transport="shm", timeout=60)
        if not r["ok"] or (r["result"]["latest"] or 0) < s:
            self.errors.append(f"open/close {s}: {r}"[:400])

    # ---- samples
    def sample(self, s: int) -> None:
        procs = {"consumer0": self.cons[0], "consumer1": self.cons[1], "opener": self.opener}
        procs.update({f"publisher{r}": a for r, a in enumerate(self.pubs)})
        row: dict[str, Any] = {"step": s, "group": self.gen}
        for name, a in procs.items():
            p = a.must("probe", None, timeout=60)
            row[name] = {k: p[k] for k in ("rss_kb", "anon_kb", "fds", "threads")}
        fam = etcd_keys(self.client)
        row["etcd_keys"], row["etcd_families"] = sum(fam.values()), fam
        row.update(etcd_db(self.client))
        pids = [a.proc.pid for a in self.pool.all if not a.dead and a.proc.poll() is None]
        row.update(shm_and_memfd(pids))
        row["ckpt_bytes"], row["ckpt_steps"] = tree_bytes(self.uri)
        self.samples.append(row)

    def close(self) -> None:
        self.pool.close()
        self.client.close()
        self.etcd.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def growth(samples: Sequence[dict[str, Any]], proc: str, field: str, warm: int) -> dict[str, Any] | None:
    pts = [(r["step"], r[proc][field]) for r in samples if r["step"] >= warm and proc in r]
    if len(pts) < 6:
        return None
    first, last = _median([v for _, v in pts[:5]]), _median([v for _, v in pts[-5:]])
    slope = slope_per_100([float(x) for x, _ in pts], [float(v) for _, v in pts]) or 0.0
    span = pts[-1][0] - pts[0][0]
    return {
        "after_warmup": first,
        "end": last,
        "growth": round((last - first) / first, 4) if first else None,
        "trend": round(slope * span / 100 / first, 4) if first else None,
    }


def retention_allows(s: int, args: argparse.Namespace) -> int:
    """Complete checkpoints the policy allows on storage at step ``s`` (+1 being written)."""
    windows = (s // args.keep_every + 1) if args.keep_every else 0
    return args.keep_last + windows + 1


def judge(soak: Soak, args: argparse.Namespace, warm: int) -> dict[str, Any]:
    """Growth fractions of the long-lived processes, and whether etcd and storage stayed bounded."""
    out: dict[str, Any] = {"growth_by_process": {}}
    fields = (
        ("rss_kb", "rss_growth"),
        ("anon_kb", "anon_growth"),
        ("fds", "fds_growth"),
        ("threads", "threads_growth"),
    )
    for field, key in fields:
        worst = None
        for proc in LONG_LIVED:
            g = growth(soak.samples, proc, field, warm)
            out["growth_by_process"].setdefault(proc, {})[field] = g
            if g is not None and g["growth"] is not None and (worst is None or g["growth"] > worst):
                worst = g["growth"]
        out[key] = worst
    after = [r for r in soak.samples if r["step"] >= warm]
    why: list[str] = []
    per_ckpt = max((r["ckpt_bytes"] / r["ckpt_steps"] for r in soak.samples if r["ckpt_steps"]), default=0)
    for r in soak.samples:
        allow = retention_allows(r["step"], args)
        if r["ckpt_steps"] > allow:
            why.append(
                f"step {r['step']}: {r['ckpt_steps']} checkpoints on storage, retention allows {allow}"
            )
        if per_ckpt and r["ckpt_bytes"] > allow * per_ckpt * 1.01:
            why.append(f"step {r['step']}: {r['ckpt_bytes']} checkpoint bytes > {allow} x {per_ckpt:.0f}")
    # A sample right after a restart still holds the SIGKILLed group's leased records (members, layouts,
    # recovery) until their lease runs out (lease_ttl): compared apart, against one group's worth more.
    steady = [r for r in after if r["step"] % args.restart_every]
    restarts = [r for r in after if not r["step"] % args.restart_every]
    early_steady = [r for r in steady if r["step"] < warm + 200]
    top_steady = max((r["etcd_keys"] for r in early_steady), default=0)
    for r in restarts:
        if r["etcd_keys"] > 2 * top_steady:
            why.append(
                f"etcd keys at restart step {r['step']}: {r['etcd_keys']}, more than twice the steady "
                f"{top_steady}"
            )
    fams = {f for r in after for f in r["etcd_families"]}
    for f in sorted(fams):
        base = max((r["etcd_families"].get(f, 0) for r in early_steady), default=0)
        top = max((r["etcd_families"].get(f, 0) for r in steady), default=0)
        if f.endswith("/checkpoints"):  # one record per checkpoint, the policy's bound at each sample
            over = [r for r in steady if r["etcd_families"].get(f, 0) > retention_allows(r["step"], args)]
            if over:
                why.append(
                    f"etcd keys {f}: {over[0]['etcd_families'][f]} at step {over[0]['step']}, retention "
                    f"allows {retention_allows(over[0]['step'], args)}"
                )
        elif top > base:
            why.append(
                f"etcd keys {f}: {top} after warm-up, more than the {base} of the first 200 steps after it"
            )
    out["bounded"] = not why
    out["unbounded"] = why[:20]
    out["etcd_keys"] = {
        "steady_after_warmup": top_steady,
        "steady_end": steady[-1]["etcd_keys"] if steady else None,
        "max_at_restarts": max((r["etcd_keys"] for r in restarts), default=None),
    }
    out["etcd_db"] = {
        "after_warmup": after[0]["db_size"] if after else None,
        "end": soak.samples[-1]["db_size"] if soak.samples else None,
        "in_use_end": soak.samples[-1]["db_in_use"] if soak.samples else None,
    }
    return out


def step(soak: Soak, args: argparse.Namespace, s: int, t0: float) -> None:
    """One step: put, churn, and on their steps checkpoint, restart the group, sample."""
    soak.put(s)
    soak.churn(s)
    if s % args.ckpt_every == 0:
        soak.checkpoint(s)
    if s % args.restart_every == 0 and s < args.steps:
        soak.kill_group()
        soak.start_group(recover=True)
    if s % args.sample_every == 0 or s == 1:
        soak.sample(s)
    if args.verbose and s % 50 == 0:
        print(
            f"# step {s}: {time.monotonic() - t0:.0f}s, errors {len(soak.errors)}",
            file=sys.stderr,
            flush=True,
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.support import orphans

    tag = orphans.tag_children()
    t0 = time.monotonic()
    warm = min(args.warmup, max(10, args.steps // 10))
    soak = Soak(args)
    try:
        soak.start_group(recover=False)
        for s in range(1, args.steps + 1):
            try:
                step(soak, args, s, t0)
            except (Hang, Died, SetupError) as exc:  # a process hung or died: say which, with its log
                soak.errors.append(f"step {s}: {type(exc).__name__}: {exc}"[:400])
                for a in soak.pool.all:
                    if a.name in str(exc):
                        soak.errors.append(f"{a.name} stacks and log: " + a.stacks()[-3000:])
                break
            if len(soak.errors) > 20:
                soak.errors.append(f"aborted at step {s}")
                break
    finally:
        soak.close()
    left = orphans.leftovers(tag, wait=20.0)
    orphans.end_leftovers(left, tag)
    orphans.untag(tag)
    out: dict[str, Any] = {
        "bench": "soak",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load": [round(x, 2) for x in os.getloadavg()],
        "steps": args.steps,
        "warmup_steps": warm,
        "seconds": round(time.monotonic() - t0, 1),
        "publishers": WORLD,
        "ckpt_every": args.ckpt_every,
        "restart_every": args.restart_every,
        "keep_last": args.keep_last,
        "keep_every": args.keep_every,
        "retention_in_store": soak.retention_in_store,
    }
    out.update(judge(soak, args, warm))
    out.update(orphans=left, errors=soak.errors, recoveries=soak.recoveries, samples=soak.samples)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100, help="steps before growth counts (default 100)")
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--restart-every", type=int, default=100)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--keep-every", type=int, default=500)
    ap.add_argument("--out", default=str(_HERE / "results" / "soak.jsonl"), help="'-': stdout only")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally: blocks run, actors end
    out = run(args)
    line = json.dumps(out)
    if args.out != "-":
        with open(args.out, "a") as f:
            f.write(line + "\n")
    summary = {
        k: out[k]
        for k in (
            "steps",
            "seconds",
            "rss_growth",
            "anon_growth",
            "fds_growth",
            "threads_growth",
            "bounded",
            "orphans",
            "retention_in_store",
        )
    }
    summary["errors"] = out["errors"][:3]
    print(json.dumps(summary))
    ok = not out["errors"] and out["bounded"] and not out["orphans"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Weight sync between Ray actors: an FSDP2 trainer actor group and rollout actors, through the store.

The driver starts (or is given) etcd and a local Ray cluster, then:

- two ``TrainerActor``s form their own gloo group (``MASTER_ADDR=127.0.0.1``, a free port that trainer
  actor 0 picks and the driver hands to all) and run ``examples/rl_loop.py``'s trainer: FSDP2, REINFORCE,
  ``store.put(step, model.state_dict())`` every step;
- ``RolloutActor``s (one plain HF model, one vLLM-style fused model) run its rollout: ``get_into`` in place,
  ``generate``, and their logits go back through the store for trainer rank 0 to compare bit for bit.

How actors learn the etcd endpoint: the driver puts it in the job's ``runtime_env`` as ``ASTATE_ETCD``;
``astate_store.connect(namespace)`` (no ``etcd=``) reads it in every actor. Passing it as an actor argument
(``LoopOptions(etcd=...)``) works as well and wins over the environment.

``python examples/ray_sync.py`` (Ray is started here with ``num_cpus``, loopback only, no dashboard).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `examples` importable here and in the actors
    sys.path.insert(0, str(REPO))

import ray  # noqa: E402

from examples import rl_loop  # noqa: E402


@ray.remote(num_cpus=1)
class TrainerActor:
    """One rank of the trainer group; the group is formed in :meth:`run` (gloo, env://)."""

    def __init__(self, rank: int, world: int, opts: rl_loop.LoopOptions):
        self.rank, self.world, self.opts = rank, world, opts

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address the group meets at (loopback here; a node IP on a real cluster)."""
        return "127.0.0.1", rl_loop.free_port()

    def run(self, master_addr: str, master_port: int) -> list[dict[str, Any]]:
        o = dataclasses.replace(self.opts, master_addr=master_addr, master_port=master_port)
        return [dataclasses.asdict(r) for r in rl_loop.train(self.rank, self.world, o, echo=False)]


@ray.remote(num_cpus=1)
class RolloutActor:
    def __init__(self, index: int, kind: str, opts: rl_loop.LoopOptions):
        self.index, self.kind, self.opts = index, kind, opts

    def run(self) -> list[float]:
        """Per-step ``get_into`` times (s)."""
        return rl_loop.rollout(self.index, self.kind, self.opts)


def start_ray(endpoint: str, *, num_cpus: int = 4, temp_dir: str | None = None) -> str:
    """A local Ray cluster on loopback, no dashboard; the etcd endpoint reaches every actor as
    ``ASTATE_ETCD`` through the job's runtime_env (and ``PYTHONPATH`` so actors import ``examples``).
    Returns Ray's temp dir (short, under /tmp: its socket paths must fit 107 bytes)."""
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = {
        "ASTATE_ETCD": endpoint,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
        log_to_driver=False,
        runtime_env={"env_vars": env},
        configure_logging=False,
    )
    return temp_dir


def run(opts: rl_loop.LoopOptions, *, world: int = 2) -> list[rl_loop.StepReport]:
    """Start the actors on the running Ray cluster, run the loop, return trainer rank 0's reports."""
    o = dataclasses.replace(opts, session=opts.session or f"ray-{os.getpid()}-{time.time_ns()}")
    trainers = [TrainerActor.remote(r, world, o) for r in range(world)]  # type: ignore[attr-defined]
    rollouts = [RolloutActor.remote(i, k, o) for i, k in enumerate(o.rollouts)]  # type: ignore[attr-defined]
    try:
        addr, port = ray.get(trainers[0].rendezvous.remote(), timeout=o.timeout)
        refs = [t.run.remote(addr, port) for t in trainers] + [r.run.remote() for r in rollouts]
        _wait_all(refs, o.timeout * (o.steps + 2))
        return [rl_loop.StepReport(**d) for d in ray.get(refs[0])]
    finally:
        for actor in trainers + rollouts:
            ray.kill(actor)


def _wait_all(refs: list[Any], timeout: float) -> None:
    """Wait for every task; raise the first failure at once (the others would only wait out their
    timeouts for a peer that is gone)."""
    deadline, pending = time.monotonic() + timeout, list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise TimeoutError(f"{len(pending)} actor tasks still running after {timeout:.0f}s")
        ray.get(done)  # raises the task's error


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--etcd", default=os.environ.get("ASTATE_ETCD", ""), help="host:port (default: embedded)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--namespace", default="rl-ray")
    ap.add_argument("--num-cpus", type=int, default=4)
    ap.add_argument("--tied", action="store_true", help="tie lm_head to the embedding")
    a = ap.parse_args(argv)
    from astate_store.etcd.embedded import EmbeddedEtcd

    etcd = None if a.etcd else EmbeddedEtcd().start()
    endpoint = a.etcd or etcd.endpoint  # type: ignore[union-attr]
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        start_ray(endpoint, num_cpus=a.num_cpus, temp_dir=temp)
        # etcd="": each actor's connect() reads ASTATE_ETCD from the runtime_env.
        o = rl_loop.LoopOptions(etcd="", namespace=a.namespace, steps=a.steps, tied=a.tied)
        reports = run(o)
        for r in reports:
            print(r.line(), flush=True)
        good, last = rl_loop.summary(reports, o)
        print(last, flush=True)
        return 0 if good else 1
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        if etcd is not None:
            etcd.stop()


if __name__ == "__main__":
    sys.exit(main())

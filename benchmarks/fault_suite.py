"""Fault suite: real etcd, real UCX, separate processes; faults injected at bad moments.

Prints one JSON line: ``cases`` (one entry per case) and ``totals``. Per case:

- ``trials``; ``completed_correct``: every pull of the trial returned exact bytes of the step it
  reported; ``typed_errors``: the trial ended in an ``astate_store.errors.AStateError`` subclass
  within its timeout (``typed_kinds`` counts them by class);
- ``wrong_bytes``: returned pulls whose buffers differ from the step they reported (must be 0);
- ``hangs``: trials that did not finish within their timeout (the processes are killed by PID);
- ``lost_versions``: steps reported committed that later are neither readable (while retention
  keeps them) nor superseded, or ``latest`` moving back;
- ``crashes``: untyped exceptions (anything that is not an ``AStateError``; for the decoders,
  anything that is not a ``CodecError`` / ``AStateError``) or a process dying on its own;
- ``violations``: other broken promises (a publisher blocked past ``retire_timeout``, a zombie
  write accepted, a zombie error other than ``StaleSessionError``);
- ``harness_errors``: the suite itself failed (not a finding about the store);
- ``skipped``: why the case did not run (e.g. network namespaces need root), else absent.

Cases: publisher SIGKILL mid-pull with and without re-serving replicas, consumer SIGKILL mid-pull,
etcd restarted mid-run (SIGSTOP/SIGCONT, SIGKILL or SIGTERM and restart on the same data dir and
port), a member lost from a 3-member etcd cluster, the link cut between two network-namespace hosts
mid-pull, consumer churn, zombie writes after fencing, hostile records in every key family and bad
API input, records fuzzed through every decoder (hypothesis), and a soak whose RSS, fds, threads and
UCX registrations must stay flat (slopes per 100 steps, least squares).

    python benchmarks/fault_suite.py [--trials 3] [--only NAME[,NAME]] [--soak-steps 1000]

Processes: every store lives in an actor process (``tests/support/faults/``); nothing here waits
without a timeout, and every process started is ended by PID. Actors and the etcd servers they or
the driver start get SIGTERM when their starter dies (``tied_to_caller``), and ``orphans`` lists any
process this run started that still ran at its end (then ended by PID; must be empty).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
if os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(1, os.path.dirname(_HERE))

from _hosts import VethPair, ip  # noqa: E402

from tests.support.faults import fuzz, hostile  # noqa: E402
from tests.support.faults.driver import Actor, Died, EtcdProcess, Hang, Pool, SetupError  # noqa: E402
from tests.support.faults.model import LAYOUTS, slope_per_100  # noqa: E402

FIELDS = (
    "trials",
    "completed_correct",
    "typed_errors",
    "wrong_bytes",
    "hangs",
    "lost_versions",
    "crashes",
    "violations",
    "harness_errors",
)
RETIRE_TIMEOUT = 3.0
RETIRE_SLACK = 10.0  # a put may take retire_timeout plus this before it counts as blocked
TRIAL_TIMEOUT = 150.0


class Skip(Exception):
    """The case cannot run here (reported as skipped)."""


# ------------------------------------------------------------------------------------ one trial


class Trial:
    """What one trial saw. Classified at the end as exactly one of correct / typed / wrong /
    hang / crash / violation / harness; ``wrong`` counts wrong pulls and ``lost`` lost steps."""

    def __init__(self, suite: Suite, case: str, index: int, timeout: float = TRIAL_TIMEOUT):
        self.suite, self.case, self.index = suite, case, index
        self.deadline = time.monotonic() + timeout
        self.actors: list[Actor] = []
        self.pulls = 0
        self.wrong = 0
        self.lost = 0
        self.typed: list[str] = []
        self.crash: list[str] = []
        self.violation: list[str] = []
        self.harness: list[str] = []
        self.hang: str | None = None
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}

    # ---- actors and time
    def left(self, cap: float | None = None) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise Hang(f"{self.case} trial {self.index}: trial timeout")
        return remaining if cap is None else min(cap, remaining)

    def take(self) -> Actor:
        a = self.suite.pool.take(timeout=self.left(180))
        self.actors.append(a)
        return a

    def take_in(self, netns: str, env: Mapping[str, str] | None = None) -> Actor:
        a = self.suite.pool.take_in(netns, timeout=self.left(180), env=env)
        self.actors.append(a)
        return a

    # ---- outcomes
    def reply(self, what: str, r: Mapping[str, Any], *, pull: bool = False) -> bool:
        """Account one actor reply; True when the operation succeeded (and, for a pull, exact)."""
        if r.get("ok"):
            if not pull:
                return True
            self.pulls += 1
            res = r["result"]
            if res.get("exact"):
                return True
            self.wrong += 1
            self.notes.append(
                f"WRONG BYTES: {what}: step {res.get('step')} reported, buffers {res.get('bad')} differ"
                f" ({res.get('looks_like')})"
            )
            return False
        self.error(what, r)
        return False

    def error(self, what: str, r: Mapping[str, Any]) -> None:
        msg = f"{what}: {r.get('etype')}: {str(r.get('msg'))[:240]}"
        if r.get("typed"):
            self.typed.append(str(r.get("etype")))
            self.notes.append(msg)
        else:
            self.crash.append(msg)
            self.notes.append("CRASH " + msg + ("\n" + str(r.get("tb", ""))[-600:] if r.get("tb") else ""))

    def pull(self, what: str, r: Mapping[str, Any]) -> bool:
        return self.reply(what, r, pull=True)

    def violate(self, msg: str) -> None:
        self.violation.append(msg)
        self.notes.append("VIOLATION " + msg)

    def check_lost(self, view: Mapping[str, Any], committed: Sequence[int], retention: int) -> None:
        """Steps reported committed must stay committed while retention keeps them (the newest
        ``retention`` of them), and ``latest`` must never be below one of them."""
        latest = view.get("latest")
        have = set(view.get("committed") or [])
        readable = {int(k): v for k, v in (view.get("readable") or {}).items()}
        kept = sorted(set(committed))[-retention:]
        lost = []
        for s in sorted(set(committed)):
            if latest is None or latest < s:
                lost.append((s, f"latest is {latest}"))
            elif s in kept and s not in have:
                lost.append((s, "not in committed_steps"))
            elif s in kept and s in readable and readable[s] is not True:
                lost.append((s, f"read_version: {readable[s]}"))
        self.lost += len(lost)
        for s, why in lost:
            self.notes.append(
                f"LOST VERSION {s}: {why} (committed {sorted(set(committed))}, view {dict(view)})"
            )

    def outcome(self) -> str:
        if self.harness:
            return "harness"
        if self.wrong:
            return "wrong"
        if self.hang:
            return "hang"
        if self.crash:
            return "crash"
        if self.violation:
            return "violation"
        if self.typed:
            return "typed"
        return "correct"

    def finish(self) -> None:
        """Hand surviving actors back (reset) and end the others by PID."""
        for a in self.actors:
            if self.hang or a.dead or a.proc.poll() is not None:
                a.kill()
            else:
                self.suite.pool.give(a)
        self.actors.clear()


# ------------------------------------------------------------------------------------ one case


class Entry:
    def __init__(self, name: str):
        self.name = name
        self.counts = dict.fromkeys(FIELDS, 0)
        self.typed_kinds: Counter[str] = Counter()
        self.details: list[str] = []
        self.typed_examples: list[str] = []
        self.extra: dict[str, Any] = {}
        self.skipped: str | None = None
        self.t0 = time.monotonic()

    def add(self, t: Trial) -> None:
        c = self.counts
        c["trials"] += 1
        kind = t.outcome()
        c["completed_correct"] += kind == "correct"
        c["typed_errors"] += kind == "typed"
        c["wrong_bytes"] += t.wrong
        c["hangs"] += kind == "hang"
        c["crashes"] += kind == "crash"
        c["violations"] += kind == "violation"
        c["harness_errors"] += kind == "harness"
        c["lost_versions"] += t.lost
        if kind == "typed":
            self.typed_kinds.update(t.typed[-1:])
        if kind != "correct":
            for n in ([t.hang] if t.hang else []) + t.harness + t.notes:
                line = f"trial {t.index}: {n}"[: 3000 if n.startswith("HANG stacks") else 1200]
                if n.split(" ", 1)[0].isupper() or n in t.harness:  # a finding: WRONG, CRASH, HANG, LOST...
                    if len(self.details) < 24 and line not in self.details:
                        self.details.append(line)
                elif len(self.typed_examples) < 6 and kind == "typed":
                    self.typed_examples.append(line[:400])
        for k, v in t.extra.items():
            self.extra.setdefault(k, []).append(v)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, **self.counts}
        if self.skipped:
            out["skipped"] = self.skipped
        if self.typed_kinds:
            out["typed_kinds"] = dict(self.typed_kinds)
        out.update(self.extra)
        out["seconds"] = round(time.monotonic() - self.t0, 1)
        if self.details:
            out["details"] = self.details
        if self.typed_examples:
            out["typed_examples"] = self.typed_examples
        return out


class Suite:
    """Shared state of one run: the actor pool, the shared etcd, a temp dir."""

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        trials: int = 3,
        soak_steps: int = 1000,
        fuzz_examples: int = 100,
        churn_steps: int = 6,
        spares: int = 2,
        seed: int | None = None,
    ):
        self.tmp = tempfile.mkdtemp(prefix="astate-faults-")
        self.trials, self.soak_steps, self.fuzz_examples, self.churn_steps = (
            trials,
            soak_steps,
            fuzz_examples,
            churn_steps,
        )
        self.seed = random.randrange(1 << 30) if seed is None else seed
        self.rng = random.Random(self.seed)
        self._etcd: Any = None
        if endpoint is None:
            from astate_store.etcd.embedded import EmbeddedEtcd

            self._etcd = EmbeddedEtcd(data_dir=os.path.join(self.tmp, "etcd")).start()
            endpoint = self._etcd.endpoint
        self.endpoint = endpoint
        self.pool = Pool(os.path.join(self.tmp), spares=spares)

    def ns(self, tag: str) -> str:
        return f"f{tag}-{uuid.uuid4().hex[:10]}"

    def close(self) -> None:
        self.pool.close()
        if self._etcd is not None:
            self._etcd.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def trial(
        self, entry: Entry, index: int, fn: Callable[[Trial], None], timeout: float = TRIAL_TIMEOUT
    ) -> Trial:
        t = Trial(self, entry.name, index, timeout)
        try:
            fn(t)
        except Hang as exc:
            t.hang = f"HANG {exc}"
            _hung_stacks(t, str(exc))
        except Died as exc:
            t.crash.append(str(exc))
            t.notes.append(f"CRASH a process died on its own: {exc}; log: {_tails(t)}")
        except SetupError as exc:
            if exc.reply.get("typed"):
                t.typed.append(str(exc.reply.get("etype")))
                t.notes.append(f"set-up failed with a typed error: {exc}")
            elif exc.reply:
                t.crash.append(str(exc))
                t.notes.append(f"CRASH set-up: {exc}\n{str(exc.reply.get('tb', ''))[-600:]}")
            else:
                t.harness.append(str(exc))
        except Skip:
            raise
        except Exception as exc:
            t.harness.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}")
        finally:
            t.finish()
        entry.add(t)
        return t


def _hung_stacks(t: Trial, why: str) -> None:
    """Before the hung trial's actors are killed: the Python stacks of the one that did not answer."""
    for a in t.actors:
        if f"actor {a.name} " in why + " " or why.endswith(a.name):
            tail = a.stacks()
            if tail:
                t.notes.append(f"HANG stacks of {a.name}:\n{tail[-2500:]}")


def _tails(t: Trial) -> str:
    return " | ".join(f"{a.name}: {a.log_tail(300)!r}" for a in t.actors if a.proc.poll() is not None)


# ---------------------------------------------------------------------------- shared set-ups


def _open_pubs(t: Trial, ep: str, ns: str, world: int, **kw: Any) -> list[Actor]:
    pubs = [t.take() for _ in range(world)]
    ids = [a.send("pub_open", "p", ep, ns, rank=r, world=world, session=ns, **kw) for r, a in enumerate(pubs)]
    for a, rid in zip(pubs, ids):
        r = a.result(rid, t.left(120))
        if not r["ok"]:
            raise SetupError(f"{a.name}.pub_open: {r['etype']}: {r['msg']}", r)
    return pubs


def _put_all(
    t: Trial,
    pubs: Sequence[Actor],
    step: int,
    committed: list[int],
    *,
    cap: float = 90.0,
    must: bool = True,
    **kw: Any,
) -> list[dict[str, Any]]:
    """Every rank puts ``step``; records a commit; returns the replies."""
    ids = [a.send("pub_put", "p", step, **kw) for a in pubs]
    replies = [a.result(rid, t.left(cap)) for a, rid in zip(pubs, ids)]
    for r in replies:
        if r["ok"] and r["result"]["committed"]:
            committed.append(step)
    bad = [r for r in replies if not r["ok"]]
    if bad and must:
        raise SetupError(f"put {step}: {bad[0]['etype']}: {bad[0]['msg']}", bad[0])
    for r in bad:
        t.error(f"put {step}", r)
    return replies


def _view(t: Trial, a: Actor, key: str, steps: Sequence[int]) -> dict[str, Any] | None:
    r = a.call("catalog_view", key, steps=list(steps), timeout=t.left(60))
    if not r["ok"]:
        t.error("catalog view", r)
        return None
    return dict(r["result"])


# ---------------------------------------------------------------------------------- the cases


def case_publisher_kill(suite: Suite, entry: Entry, replicas: bool) -> None:
    """Publisher rank 1 of 2 is SIGKILLed while a consumer's pull is under way (the consumer's
    transport kills it as its batched read starts, or a few ms in). Without replicas the pull must
    be exact (it won the race) or PeerUnreachable; with a re-serving consumer it should fail over."""
    for i in range(suite.trials):

        def run(t: Trial) -> None:
            transport = ("shm", "tcp")[i % 2]
            delay = (0.0, 0.003, 0.02)[i % 3]
            ep, ns = suite.endpoint, suite.ns("pk")
            committed: list[int] = []
            pubs = _open_pubs(t, ep, ns, 2, size="big", transport=transport, lease_ttl=3.0)
            _put_all(t, pubs, 1, committed)
            if replicas:
                rep = t.take()
                rep.must(
                    "con_open",
                    "r",
                    ep,
                    ns,
                    size="big",
                    transport=transport,
                    lease_ttl=3.0,
                    timeout=t.left(60),
                )
                if not t.pull(
                    "re-server's pull", rep.call("con_pull", "r", "whole", step=1, timeout=t.left(60))
                ):
                    return
                rep.must("con_serve", "r", 1, timeout=t.left(30))
            con = t.take()
            con.must(
                "con_open",
                "c",
                ep,
                ns,
                size="big",
                transport=transport,
                read_timeout=10.0,
                lease_ttl=3.0,
                timeout=t.left(60),
            )
            victim = pubs[1]
            r = con.call(
                "con_pull", "c", "whole", step=1, kill_pid=victim.pid, kill_delay=delay, timeout=t.left(60)
            )
            t.pull(f"pull while rank 1 is SIGKILLed ({transport}, +{delay * 1000:.0f} ms)", r)
            victim.proc.wait(15)
            victim.dead = True
            con.must(
                "con_open",
                "c2",
                ep,
                ns,
                size="big",
                transport=transport,
                read_timeout=10.0,
                lease_ttl=3.0,
                timeout=t.left(60),
            )
            t.pull(
                "fresh pull after the kill", con.call("con_pull", "c2", "cols0", step=1, timeout=t.left(60))
            )
            view = _view(t, con, "c2", [1])
            if view is not None:
                t.check_lost(view, committed, 4)

        suite.trial(entry, i, run)


def case_consumer_kill(suite: Suite, entry: Entry) -> None:
    """A consumer is SIGKILLed in the middle of a pull (registered as a reader, holding it; its
    lease is long). The publisher's next puts reuse that step's memory: they must return within
    ``retire_timeout`` (plus slack), and later pulls stay exact."""
    worst: list[float] = []
    for i in range(suite.trials):

        def run(t: Trial) -> None:
            copy = i % 2 == 0
            hold = (20.0, 20.0, 0.0)[i % 3]
            ep, ns = suite.endpoint, suite.ns("ck")
            committed: list[int] = []
            pubs = _open_pubs(
                t, ep, ns, 1, size="big", transport="shm", retire_timeout=RETIRE_TIMEOUT, lease_ttl=5.0
            )
            _put_all(t, pubs, 1, committed, copy=copy)
            victim = t.take()
            victim.must(
                "con_open", "v", ep, ns, size="big", transport="shm", lease_ttl=30.0, timeout=t.left(60)
            )
            victim.send("con_pull", "v", "whole", step=1, wait=30, hold=hold, announce=True)
            ev = victim.event(t.left(60))
            if ev.get("event") != "pulling":
                raise SetupError(f"victim: unexpected event {ev}")
            time.sleep((0.0, 0.002, 0.004)[i % 3])
            victim.kill()
            longest = 0.0
            for s in (2, 3):
                for r in _put_all(t, pubs, s, committed, cap=RETIRE_TIMEOUT + 60, must=False, copy=copy):
                    if r["ok"]:
                        longest = max(longest, r["result"]["seconds"])
            worst.append(longest)
            t.extra["put_seconds_max"] = round(longest, 2)
            if longest > RETIRE_TIMEOUT + RETIRE_SLACK:
                t.violate(
                    f"a put blocked {longest:.1f}s with a dead reader (retire_timeout {RETIRE_TIMEOUT}s)"
                )
            con = t.take()
            con.must("con_open", "c", ep, ns, size="big", transport="shm", timeout=t.left(60))
            t.pull("pull after the puts", con.call("con_pull", "c", "cols1", step=3, timeout=t.left(60)))
            view = _view(t, con, "c", [1, 2, 3])
            if view is not None:
                t.check_lost(view, committed, 4)

        suite.trial(entry, i, run)
    entry.extra["retire_timeout"] = RETIRE_TIMEOUT


def _after_outage(t: Any, pubs: Any, con: Any, ep: str, ns: str, committed: list[int]) -> None:
    """After an etcd outage: steps 5-8 must sync, and a fresh reader must find every committed step."""
    _steady(t, pubs, con, range(5, 9), committed)
    con.must("con_open", "v", ep, ns, size="small", timeout=t.left(60))
    view = _view(t, con, "v", sorted(set(committed)))
    if view is not None:
        t.check_lost(view, committed, 16)


def _steady(
    t: Trial,
    pubs: Sequence[Actor],
    con: Actor,
    steps: Iterator[int] | Sequence[int],
    committed: list[int],
    layout: str = "whole",
) -> None:
    for s in steps:
        _put_all(t, pubs, s, committed, must=False)
        t.pull(f"pull {s}", con.call("con_pull", "c", layout, step=s, wait=30, timeout=t.left(60)))


def case_etcd_restart(suite: Suite, entry: Entry) -> None:
    """etcd goes away mid-run — SIGSTOP for 3 s, or SIGKILL / SIGTERM and a restart 3 s later on
    the same data dir and port — while a consumer waits for the next step and the publisher puts
    it. Puts and pulls must carry on (or fail typed), and no committed version may be lost."""
    for i in range(suite.trials):

        def run(t: Trial) -> None:
            mode = ("pause", "kill", "term")[i % 3]
            etcd = EtcdProcess(suite.tmp).start()
            try:
                ep, ns = etcd.endpoint, suite.ns("er")
                committed: list[int] = []
                pubs = _open_pubs(t, ep, ns, 1, size="small", transport="shm", retention=16, lease_ttl=10.0)
                con = t.take()
                con.must(
                    "con_open", "c", ep, ns, size="small", transport="shm", lease_ttl=10.0, timeout=t.left(60)
                )
                _steady(t, pubs, con, range(1, 4), committed)
                pid = con.send("con_pull", "c", "cols0", step=4, wait=60)
                if mode == "pause":
                    etcd.send_signal(signal.SIGSTOP)
                else:
                    etcd.kill(signal.SIGKILL if mode == "kill" else signal.SIGTERM)
                put = pubs[0].send("pub_put", "p", 4)
                time.sleep(3.0)
                if mode == "pause":
                    etcd.send_signal(signal.SIGCONT)
                else:
                    etcd.start()
                r = pubs[0].result(put, t.left(90))
                if r["ok"] and r["result"]["committed"]:
                    committed.append(4)
                t.reply("put 4 across the outage", r)
                t.pull("pull 4 waiting across the outage", con.result(pid, t.left(90)))
                _after_outage(t, pubs, con, ep, ns, committed)
                t.extra.setdefault("modes", mode)
            finally:
                etcd.stop()

        suite.trial(entry, i, run)


def case_etcd_member_loss(suite: Suite, entry: Entry) -> None:
    """A 3-member etcd cluster loses one member (SIGKILL) mid-run: the one the publisher talks
    to, the consumer's, or another; the survivors carry on with no committed version lost."""
    from tests.support.etcd_cluster import EtcdCluster

    for i in range(suite.trials):

        def run(t: Trial) -> None:
            cluster = EtcdCluster(3).start()
            try:
                ep, ns = cluster.endpoint, suite.ns("em")
                committed: list[int] = []
                pubs = _open_pubs(t, ep, ns, 1, size="small", transport="shm", retention=16, lease_ttl=10.0)
                con = t.take()
                con.must(
                    "con_open", "c", ep, ns, size="small", transport="shm", lease_ttl=10.0, timeout=t.left(60)
                )
                _steady(t, pubs, con, range(1, 4), committed)
                used = {
                    "publisher": pubs[0].must("member_in_use", "p", timeout=t.left(30)),
                    "consumer": con.must("member_in_use", "c", timeout=t.left(30)),
                }
                which = ("publisher", "consumer", "other")[i % 3]
                victim = used.get(which) or next(
                    (m for m in cluster.endpoints if m not in used.values()), cluster.endpoints[0]
                )
                pid = con.send("con_pull", "c", "cols1", step=4, wait=60)
                cluster.kill(cluster.index_of(victim))
                r = pubs[0].call("pub_put", "p", 4, timeout=t.left(90))
                if r["ok"] and r["result"]["committed"]:
                    committed.append(4)
                t.reply("put 4 after the member died", r)
                t.pull("pull 4 waiting while the member died", con.result(pid, t.left(90)))
                _after_outage(t, pubs, con, ep, ns, committed)
            finally:
                cluster.stop()

        suite.trial(entry, i, run)


# ---- network namespaces ----------------------------------------------------------------------


class Hosts(VethPair):
    """Two test hosts (network namespaces) joined by a veth pair, made at once; removed on close."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise Skip("network namespaces need root")
        if shutil.which("ip") is None:
            raise Skip("iproute2 (ip) is not installed")
        super().__init__("af")
        try:
            self.open()
        except (OSError, subprocess.SubprocessError) as exc:
            raise Skip(f"cannot make two network-namespace hosts here: {exc}") from None

    def _tc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            ["ip", "netns", "exec", self.a, "tc", "qdisc", *args],
            check=check,
            capture_output=True,
            timeout=20,
        )

    def netem_available(self) -> bool:
        """Whether ``tc netem`` works here (the kernel may lack sch_netem)."""
        if shutil.which("tc") is None:
            return False
        ok = self._tc("add", "dev", self.a_dev, "root", "netem", "loss", "0%", check=False).returncode == 0
        if ok:
            self._tc("del", "dev", self.a_dev, "root", check=False)
        return ok

    def cut(self, how: str) -> None:
        """``netem``: 100% loss on A's end; ``down``: A's end down; ``down_b``: B's end down."""
        if how == "netem":
            self._tc("add", "dev", self.a_dev, "root", "netem", "loss", "100%")
        elif how == "down_b":
            ip("-n", self.b, "link", "set", self.b_dev, "down")
        else:
            ip("-n", self.a, "link", "set", self.a_dev, "down")

    def restore(self, how: str) -> None:
        if how == "netem":
            self._tc("del", "dev", self.a_dev, "root", check=False)
        elif how == "down_b":
            ip("-n", self.b, "link", "set", self.b_dev, "up", check=False)
        else:
            ip("-n", self.a, "link", "set", self.a_dev, "up", check=False)


def case_netns_link_cut(suite: Suite, entry: Entry) -> None:
    """Host A (etcd, publisher) and host B (consumer) in network namespaces: the veth link is cut
    (link down, or netem loss 100%) just as B's pull of 32 MiB over UCX tcp starts; restored 3 s
    later, or only after the pull ended. The pull must be exact or typed within read_timeout,
    and a pull after the link is back must be exact."""
    try:
        probe = Hosts()
        try:
            netem = probe.netem_available()
        finally:
            probe.close()
    except Skip as exc:
        entry.skipped = str(exc)
        return
    if not netem:
        entry.extra["netem"] = (
            "unavailable (no sch_netem in this kernel): that trial cuts B's end of the link instead"
        )
    for i in range(suite.trials):

        def run(t: Trial) -> None:
            how = ("down", "netem" if netem else "down_b", "down")[i % 3]
            stay = i % 3 == 2
            hold = (0.3, 0.0, 0.3)[i % 3]  # cut before the bytes move, or while they move
            hosts = Hosts()
            try:
                # Both hosts share this kernel (and its pids): UCX tcp only, never process_vm_readv,
                # so the bytes cross the veth link.
                env = {"ASTATE_SHM_DIRECT": "0"}
                et = t.take_in(hosts.a, env)
                ep = et.must("etcd_start", hosts.a_addr, timeout=t.left(60))["endpoint"]
                pub = t.take_in(hosts.a, env)
                con = t.take_in(hosts.b, env)
                ns = suite.ns("nl")
                committed: list[int] = []
                pub.must(
                    "pub_open", "p", ep, ns, size="big", transport="tcp", lease_ttl=10.0, timeout=t.left(60)
                )
                con.must(
                    "con_open",
                    "c",
                    ep,
                    ns,
                    size="big",
                    transport="tcp",
                    read_timeout=8.0,
                    lease_ttl=10.0,
                    timeout=t.left(60),
                )
                _steady(t, [pub], con, [1], committed)
                paths = con.must("peer_paths", "c", timeout=t.left(30))
                t.extra["data_path"] = [(p["direct"], p["lanes"][:120]) for p in paths]
                if any(p["direct"] for p in paths):
                    t.harness.append(
                        f"the consumer reads host A's memory directly, not over the link: {paths}"
                    )
                _put_all(t, [pub], 2, committed)
                pid = con.send("con_pull", "c", "whole", step=2, wait=40, announce=True, hold=hold)
                ev = con.event(t.left(60))
                if ev.get("event") != "pulling":
                    raise SetupError(f"consumer: unexpected event {ev}")
                hosts.cut(how)
                t0 = time.monotonic()
                try:
                    if not stay:
                        time.sleep(3.0)
                        hosts.restore(how)
                    r = con.result(pid, t.left(90))
                    t.extra["pull_seconds_from_cut"] = round(time.monotonic() - t0, 1)
                    t.pull(f"pull across the cut ({how}{', stays cut' if stay else ', back after 3 s'})", r)
                finally:
                    hosts.restore(how)
                t.pull(
                    "pull after the link is back",
                    con.call("con_pull", "c", "cols1", step=2, timeout=t.left(60)),
                )
                view = _view(t, con, "c", [1, 2])
                if view is not None:
                    t.check_lost(view, committed, 4)
            finally:
                for a in t.actors:  # netns actors are never reused
                    a.kill()
                hosts.close()

        suite.trial(entry, i, run)


# ---- churn, zombies ---------------------------------------------------------------------------


def case_churn(suite: Suite, entry: Entry) -> None:
    """Consumers join and leave every step: a fresh consumer pulls (rotating layouts: whole, column
    halves, a subset, converted to bf16, strided) and closes; a re-server joins, serves the step and
    leaves — by ``close`` (then its process reuses the buffers for the next step) or by its next
    ``get_into`` (the documented withdraw) — while a long-lived consumer is reading the step it
    serves (held 1 s after planning). Every pull must be exact or typed."""
    for i in range(suite.trials):

        def run(t: Trial) -> None:
            ep, ns = suite.endpoint, suite.ns("ch")
            committed: list[int] = []
            pubs = _open_pubs(t, ep, ns, 2, size="small", transport="shm", lease_ttl=5.0, retire_timeout=5.0)
            long_, joiner, server = t.take(), t.take(), t.take()
            long_.must(
                "con_open", "L", ep, ns, size="small", transport="shm", read_timeout=10.0, timeout=t.left(60)
            )
            _put_all(t, pubs, 1, committed)
            prev: str | None = None
            for s in range(1, suite.churn_steps + 1):
                lay = LAYOUTS[(s + i) % len(LAYOUTS)]
                joiner.must(
                    "con_open",
                    f"x{s}",
                    ep,
                    ns,
                    size="small",
                    transport="shm",
                    read_timeout=10.0,
                    timeout=t.left(60),
                )
                t.pull(
                    f"joiner pull {s} ({lay})",
                    joiner.call("con_pull", f"x{s}", lay, step=s, timeout=t.left(60)),
                )
                joiner.must("close", f"x{s}", timeout=t.left(30))
                key = f"y{s}"
                server.must(
                    "con_open",
                    key,
                    ep,
                    ns,
                    size="small",
                    transport="shm",
                    read_timeout=10.0,
                    timeout=t.left(60),
                )
                if not t.pull(
                    f"re-server pull {s}",
                    server.call("con_pull", key, "whole", step=s, reuse_from=prev, timeout=t.left(60)),
                ):
                    break
                server.must("con_serve", key, s, timeout=t.left(30))
                lid = long_.send("con_pull", "L", "whole", step=s, wait=30, hold=1.0, announce=True)
                long_.event(t.left(60))
                _put_all(t, pubs, s + 1, committed)
                by_close = (s + i) % 2 == 0
                if by_close:  # leave, and reuse the buffers at once for the next step
                    server.must("close", key, keep_buffers=True, timeout=t.left(30))
                    server.must(
                        "con_open", key + "r", ep, ns, size="small", transport="shm", timeout=t.left(60)
                    )
                    t.pull(
                        f"re-server rejoins with its buffers, pull {s + 1}",
                        server.call(
                            "con_pull", key + "r", "whole", step=s + 1, reuse_from=key, timeout=t.left(60)
                        ),
                    )
                    server.must("close", key + "r", keep_buffers=True, timeout=t.left(30))
                    prev = key + "r"
                else:  # the documented way: the next get_into withdraws the offer first
                    t.pull(
                        f"re-server pulls {s + 1} (withdraws {s})",
                        server.call("con_pull", key, "whole", step=s + 1, timeout=t.left(60)),
                    )
                    server.must("close", key, keep_buffers=True, timeout=t.left(30))
                    prev = key
                t.pull(
                    f"long-lived consumer pull {s} while the re-server left "
                    f"({'close' if by_close else 'get_into'})",
                    long_.result(lid, t.left(60)),
                )
            view = _view(t, long_, "L", sorted(set(committed))[-4:])
            if view is not None:
                t.check_lost(view, committed, 4)

        suite.trial(entry, i, run, timeout=TRIAL_TIMEOUT + 10 * suite.churn_steps)


def case_zombie(suite: Suite, entry: Entry) -> None:
    """An old publisher session writes after a new session opened (with a commit, with the same
    step, or before the new session's first commit): every write must be StaleSessionError and
    none may commit; consumers get the new session's bytes."""
    for i in range(suite.trials):

        def run(t: Trial) -> None:
            a = t.take()
            r = a.call("zombie", suite.endpoint, suite.ns("zo"), i, timeout=t.left(90))
            if not r["ok"]:
                t.error("zombie scenario", r)
                return
            for step in r["result"]:
                if step.get("zombie"):
                    if step.get("ok"):
                        t.violate(f"{step['what']} was accepted ({step.get('result')})")
                    elif step.get("etype") != "StaleSessionError":
                        if step.get("typed"):
                            t.violate(
                                f"{step['what']}: {step['etype']} instead of StaleSessionError: {step['msg']}"
                            )
                        else:
                            t.error(step["what"], step)
                    else:
                        t.typed.append("StaleSessionError")
                elif step.get("what") == "catalog":
                    if step["zombie_commits"]:
                        t.wrong += len(step["zombie_commits"])
                        t.notes.append(
                            f"WRONG BYTES: zombie steps {step['zombie_commits']} committed ({step})"
                        )
                elif step.get("pull"):
                    t.pulls += 1
                    if not step["exact"] or step["step"] != step["expected_step"]:
                        t.wrong += 1
                        t.notes.append(f"WRONG BYTES: {step}")

        suite.trial(entry, i, run)


# ---- hostile inputs -------------------------------------------------------------------------


def _account_results(t: Trial, results: Sequence[Mapping[str, Any]]) -> None:
    for r in results:
        if r.get("ok"):
            if r.get("pull"):
                t.pulls += 1
                if not r.get("exact"):
                    t.wrong += 1
                    t.notes.append(
                        f"WRONG BYTES: {r['what']}: step {r.get('step')}, buffers {r.get('bad')} differ"
                    )
        elif "etype" in r:
            t.error(r["what"], r)


def case_hostile_records(suite: Suite, entry: Entry) -> None:
    """A bad record in every key family, written over the catalog with the raw etcd client; then
    fresh and steady consumers pull, the publisher puts two more steps, consumers pull again (and
    restore / recover where the record is a checkpoint, epoch, session or recovery one)."""
    names = [n for n, _ in hostile.HOSTILE_RECORDS]
    entry.extra["inputs"] = len(names)
    for i, name in enumerate(names):

        def run(t: Trial) -> None:
            a = t.take()
            r = a.call("hostile_record", suite.endpoint, name, timeout=t.left(90))
            if not r["ok"]:
                t.error(f"{name} (set-up)", r)
                return
            _account_results(t, [dict(x, what=f"{name}: {x['what']}") for x in r["result"]])

        suite.trial(entry, i, run, timeout=120)


def case_hostile_api(suite: Suite, entry: Entry, chunk: int = 7) -> None:
    """Bad API input (names, shapes, dtypes, boxes, non-tensors, steps, namespaces, ranks, serve and
    checkpoint misuse), each followed by a good put and an exact pull on the same stores."""
    names = list(hostile.HOSTILE_API)
    entry.extra["inputs"] = len(names)
    index = [0]

    def one_by_one(group: Sequence[str]) -> None:
        for name in group:

            def run(t: Trial) -> None:
                a = t.take()
                r = a.call("hostile_api", suite.endpoint, [name], timeout=t.left(60))
                if not r["ok"]:
                    t.error(f"{name} (set-up)", r)
                    return
                _account_results(t, [dict(x, what=f"{name}: {x['what']}") for x in r["result"][name]])

            suite.trial(entry, index[0], run, timeout=90)
            index[0] += 1

    for k in range(0, len(names), chunk):
        group = names[k : k + chunk]
        a = suite.pool.take()
        try:
            r = a.call("hostile_api", suite.endpoint, group, timeout=60 + 15 * len(group))
        except (Hang, Died):
            a.kill()
            one_by_one(group)  # find which input hangs or kills it
            continue
        suite.pool.give(a)
        if not r["ok"]:
            one_by_one(group)
            continue
        for name in group:
            t = Trial(suite, entry.name, index[0])
            index[0] += 1
            _account_results(t, [dict(x, what=f"{name}: {x['what']}") for x in r["result"][name]])
            entry.add(t)


def case_fuzz(suite: Suite, entry: Entry) -> None:
    """Hypothesis-made records through every decoder: ``codec.decode`` of every kind, counters,
    ``blob_from_kvs``, ``manifest_from_record``, ``layout_from_record``, ``version_from_kvs``.
    Each example is a trial; anything but a decoded record or a CodecError/AStateError is a crash."""
    n = max(1, suite.fuzz_examples)
    per: dict[str, Any] = {}
    examples: list[dict[str, Any]] = []
    a: Actor | None = None
    for target in fuzz.fuzz_targets():
        if a is None:
            a = suite.pool.take()
        try:
            r = a.call("fuzz", target, n, suite.seed, timeout=120 + n * 0.2)
        except (Hang, Died) as exc:
            a.kill()
            a = None
            entry.counts["trials"] += 1
            entry.counts["hangs" if isinstance(exc, Hang) else "crashes"] += 1
            entry.details.append(f"{target}: {exc}")
            continue
        if not r["ok"]:
            entry.counts["harness_errors"] += 1
            entry.details.append(f"{target}: {r['etype']}: {r['msg']}")
            continue
        res = r["result"]
        per[target] = {k: res[k] for k in ("trials", "ok", "typed", "crashes")}
        for k, f in (
            ("trials", "trials"),
            ("ok", "completed_correct"),
            ("typed", "typed_errors"),
            ("crashes", "crashes"),
        ):
            entry.counts[f] += res[k]
        for c in res["crash_examples"]:
            examples.append({"target": target, **c})
    if a is not None:
        suite.pool.give(a)
    entry.extra["examples_per_target"] = n
    entry.extra["seed"] = suite.seed
    entry.extra["per_target"] = per
    if examples:
        entry.extra["crash_examples"] = examples[:12]
    if entry.counts["typed_errors"]:
        entry.typed_kinds["CodecError/AStateError"] = entry.counts["typed_errors"]


# ---- soak -------------------------------------------------------------------------------------


SOAK_SERIES = {
    "publisher": ("rss_kb", "fds", "threads", "regions"),
    "consumer": ("rss_kb", "fds", "threads", "regions", "peers"),
    "churn": ("rss_kb", "fds", "threads"),
}


def case_soak(suite: Suite, entry: Entry) -> None:
    """``--soak-steps`` steps: a publisher puts, a long-lived consumer pulls every step, a churning
    consumer joins, pulls (rotating layouts) and leaves every step, and every 10 steps a re-server
    joins (serves) and leaves 10 steps later. Each step is a trial. RSS, open fds, threads and UCX
    registrations (regions; the long-lived consumer's peers) are sampled; their least-squares
    slopes per 100 steps (after a warm-up) are reported with the growth over the run."""
    steps = suite.soak_steps
    every = max(1, steps // 60)
    warm = max(10, steps // 10)  # from step 10 on the churning process always holds one re-serving store
    samples: dict[str, list[tuple[int, dict[str, int]]]] = {k: [] for k in SOAK_SERIES}
    ep, ns = suite.endpoint, suite.ns("sk")
    setup = Trial(suite, entry.name, -1, timeout=300)
    committed: list[int] = []
    try:
        pub = setup.take()
        long_ = setup.take()
        churn = setup.take()
        pub.must(
            "pub_open",
            "p",
            ep,
            ns,
            rank=0,
            world=1,
            session=ns,
            size="small",
            transport="shm",
            lease_ttl=5.0,
            timeout=120,
        )
        long_.must("con_open", "L", ep, ns, size="small", transport="shm", read_timeout=10.0, timeout=60)
    except Exception as exc:  # set-up of the soak itself
        setup.harness.append(f"soak set-up: {type(exc).__name__}: {exc}")
        setup.finish()
        entry.add(setup)
        return
    actors = list(setup.actors)
    setup.actors.clear()
    serving: str | None = None
    aborted = False
    t_start = time.monotonic()
    try:
        for s in range(1, steps + 1):
            t = Trial(suite, entry.name, s, timeout=120)
            try:
                _put_all(t, [pub], s, committed, must=False)
                lay = LAYOUTS[s % len(LAYOUTS)]
                serve_step = s % 10 == 0
                # On a re-serving step the long-lived consumer pulls after the offer (it may read
                # from the re-server, then the re-server leaves); otherwise alongside the churn.
                lid = None if serve_step else long_.send("con_pull", "L", "whole", step=s, wait=30)
                key = f"x{s}"
                churn.must(
                    "con_open",
                    key,
                    ep,
                    ns,
                    size="small",
                    transport="shm",
                    read_timeout=10.0,
                    lease_ttl=5.0,
                    timeout=t.left(60),
                )
                t.pull(
                    f"churn pull {s} ({lay})", churn.call("con_pull", key, lay, step=s, timeout=t.left(60))
                )
                if serve_step:
                    if serving is not None:
                        churn.must("close", serving, timeout=t.left(30))
                        serving = None
                    t.pull(
                        f"re-server pull {s}",
                        churn.call("con_pull", key, "whole", step=s, timeout=t.left(60)),
                    )
                    churn.must("con_serve", key, s, timeout=t.left(30))
                    serving = key
                else:
                    churn.must("close", key, timeout=t.left(30))
                if lid is None:
                    lid = long_.send("con_pull", "L", "whole", step=s, wait=30)
                t.pull(f"long-lived pull {s}", long_.result(lid, t.left(60)))
                if s % every == 0 or s == steps:
                    for role, (a, k) in (
                        ("publisher", (pub, "p")),
                        ("consumer", (long_, "L")),
                        ("churn", (churn, None)),
                    ):
                        samples[role].append((s, a.must("probe", k, timeout=t.left(30))))
            except Hang as exc:
                t.hang = f"HANG {exc}"
                aborted = True
            except Died as exc:
                t.crash.append(str(exc))
                t.notes.append(f"CRASH a process died on its own: {exc}")
                aborted = True
            except SetupError as exc:
                (
                    t.typed.append(str(exc.reply.get("etype")))
                    if exc.reply.get("typed")
                    else t.crash.append(str(exc))
                )
                t.notes.append(f"{'' if exc.reply.get('typed') else 'CRASH '}{exc}")
            except Exception as exc:
                t.harness.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-800:]}")
                aborted = True
            entry.add(t)
            if aborted:
                entry.details.append(f"soak aborted at step {s}")
                break
        if not aborted:
            view = long_.call("catalog_view", "L", steps=sorted(set(committed))[-4:], timeout=60)
            t = Trial(suite, entry.name, steps + 1)
            if view["ok"]:
                t.check_lost(view["result"], committed, 4)
                entry.counts["lost_versions"] += t.lost
                entry.details.extend(n for n in t.notes if n.startswith("LOST"))
    finally:
        for a in actors:
            if aborted:
                a.kill()
            else:
                a.close(timeout=15)
    entry.extra["steps"] = steps
    entry.extra["steps_per_second"] = round(
        len(samples["publisher"]) and ((samples["publisher"][-1][0]) / max(1e-9, time.monotonic() - t_start)),
        2,
    )
    entry.extra["warmup_steps"] = warm
    entry.extra["samples"] = len(samples["publisher"])
    slopes: dict[str, Any] = {}
    growth: dict[str, Any] = {}
    for role, fields in SOAK_SERIES.items():
        pts = [(s, v) for s, v in samples[role] if s >= warm]
        for f in fields:
            xs = [float(s) for s, v in pts if f in v]
            ys = [float(v[f]) for s, v in pts if f in v]
            sl = slope_per_100(xs, ys)
            slopes[f"{role}_{f}"] = None if sl is None else round(sl, 3)
            if ys:
                growth[f"{role}_{f}"] = {"first": ys[0], "last": ys[-1], "growth": ys[-1] - ys[0]}
    entry.extra["slopes_per_100_steps"] = slopes
    entry.extra["growth_after_warmup"] = growth


# ------------------------------------------------------------------------------------ the suite

CASES: dict[str, Callable[[Suite, Entry], None]] = {
    "publisher_kill_mid_pull": lambda s, e: case_publisher_kill(s, e, replicas=False),
    "publisher_kill_mid_pull_replicas": lambda s, e: case_publisher_kill(s, e, replicas=True),
    "consumer_kill_mid_pull": case_consumer_kill,
    "etcd_restart": case_etcd_restart,
    "etcd_member_loss": case_etcd_member_loss,
    "netns_link_cut": case_netns_link_cut,
    "consumer_churn": case_churn,
    "zombie_writes": case_zombie,
    "hostile_records": case_hostile_records,
    "hostile_api": case_hostile_api,
    "fuzz_decoders": case_fuzz,
    "soak": case_soak,
}


def run_case(suite: Suite, name: str) -> dict[str, Any]:
    entry = Entry(name)
    try:
        CASES[name](suite, entry)
    except Skip as exc:
        entry.skipped = str(exc)
    except Exception as exc:  # the case's own code failed outside a trial
        entry.counts["harness_errors"] += 1
        entry.details.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1200:]}")
    return entry.to_json()


def totals(cases: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    return {f: sum(int(c.get(f, 0)) for c in cases) for f in FIELDS}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3, help="trials per fault case (default 3)")
    ap.add_argument("--only", default=None, help=f"comma list of cases: {','.join(CASES)}")
    ap.add_argument("--soak-steps", type=int, default=1000, help="steps of the soak (default 1000)")
    ap.add_argument(
        "--fuzz-examples",
        type=int,
        default=None,
        help="hypothesis examples per decoder (default 100 x trials)",
    )
    ap.add_argument("--churn-steps", type=int, default=6, help="steps per churn trial (default 6)")
    ap.add_argument("--seed", type=int, default=None, help="fuzz seed (default random; reported)")
    ap.add_argument(
        "--etcd", default=None, help="use this etcd (host:port) instead of a private embedded one"
    )
    args = ap.parse_args(argv)
    names = list(CASES) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    from tests.support import orphans

    tag = orphans.tag_children()  # every process started from here on carries the tag (the orphan check)
    t0 = time.monotonic()
    suite = Suite(
        endpoint=args.etcd,
        trials=args.trials,
        soak_steps=args.soak_steps,
        fuzz_examples=args.fuzz_examples or 100 * args.trials,
        churn_steps=args.churn_steps,
        seed=args.seed,
    )
    cases = []
    try:
        for name in names:
            cases.append(run_case(suite, name))
            print(
                f"# {name}: "
                + json.dumps(
                    {k: cases[-1].get(k) for k in FIELDS + ("skipped",) if cases[-1].get(k) is not None}
                ),
                file=sys.stderr,
                flush=True,
            )
    finally:
        suite.close()
    # Nothing this run started may outlive it (issue 29): etcds in netns hosts, actors, clusters.
    left = orphans.leftovers(tag, wait=20.0)
    orphans.end_leftovers(left, tag)
    orphans.untag(tag)
    out = {
        "suite": "fault_suite",
        "trials": args.trials,
        "soak_steps": args.soak_steps,
        "seed": suite.seed,
        "seconds": round(time.monotonic() - t0, 1),
        "cases": cases,
        "totals": totals(cases),
        "orphans": left,
    }
    print(json.dumps(out))
    t = out["totals"]
    return (
        0 if all(t[f] == 0 for f in ("wrong_bytes", "hangs", "lost_versions", "crashes")) and not left else 1
    )


if __name__ == "__main__":
    sys.exit(main())

"""Background jobs (catalog/background.py): one daemon thread, pokes coalesced per job, poke order,
failures contained, close bounded. Real threads; every wait is on an event with a deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from astate_store.catalog.background import Job, Runner, own_job

WAIT = 20.0  # seconds any wait here may take on a loaded machine before the test fails


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_the_thread_starts_at_the_first_poke_and_runs_the_job() -> None:
    runner = Runner("bg-first-poke")
    ran = threading.Event()
    job = runner.job("j", ran.set)
    assert _threads("bg-first-poke") == []  # nothing started for an idle runner
    job.poke()
    assert ran.wait(WAIT)
    assert job.wait_idle(WAIT)
    (t,) = _threads("bg-first-poke")
    assert t.daemon
    runner.close()
    t.join(WAIT)
    assert not t.is_alive()


def test_pokes_while_a_run_is_pending_are_coalesced() -> None:
    runner = Runner("bg-coalesce")
    gate, started = threading.Event(), threading.Event()
    counts = {"blocker": 0, "j": 0}

    def blocker() -> None:
        counts["blocker"] += 1
        started.set()
        gate.wait(WAIT)

    b, j = runner.job("blocker", blocker), runner.job("j", lambda: counts.__setitem__("j", counts["j"] + 1))
    b.poke()
    assert started.wait(WAIT)  # the thread is busy: j's pokes queue up
    for _ in range(5):
        j.poke()
    assert j.pending
    gate.set()
    assert j.wait_idle(WAIT) and b.wait_idle(WAIT)
    assert counts == {"blocker": 1, "j": 1}
    j.poke()  # a poke after the run: one more run
    assert j.wait_idle(WAIT)
    assert counts["j"] == 2
    runner.close()


def test_a_poke_during_a_run_runs_the_job_again() -> None:
    runner = Runner("bg-rerun")
    gate, started = threading.Event(), threading.Event()
    runs: list[int] = []

    def fn() -> None:
        runs.append(1)
        if len(runs) == 1:
            started.set()
            gate.wait(WAIT)

    job = runner.job("j", fn)
    job.poke()
    assert started.wait(WAIT) and job.busy and not job.pending
    job.poke()  # what the running pass read may be stale: it must run once more
    gate.set()
    assert job.wait_idle(WAIT)
    assert len(runs) == 2
    runner.close()


def test_jobs_run_in_poke_order() -> None:
    runner = Runner("bg-order")
    gate, started = threading.Event(), threading.Event()
    order: list[str] = []

    def record(name: str) -> Callable[[], None]:
        return lambda: order.append(name)

    first = runner.job("first", lambda: (started.set(), gate.wait(WAIT)))
    jobs = {n: runner.job(n, record(n)) for n in ("c", "a", "b")}
    first.poke()
    assert started.wait(WAIT)
    for n in ("b", "c", "a", "b"):
        jobs[n].poke()
    gate.set()
    assert all(j.wait_idle(WAIT) for j in jobs.values())
    assert order == ["b", "c", "a"]
    runner.close()


def test_a_failing_job_is_logged_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    runner = Runner("bg-fail")
    ok = threading.Event()

    def boom() -> None:
        raise RuntimeError("etcd went away")

    bad, good = runner.job("retention ns-x", boom), runner.job("good", ok.set)
    with caplog.at_level("WARNING", logger="astate_store.catalog"):
        bad.poke()
        assert bad.wait_idle(WAIT)
        good.poke()
        assert ok.wait(WAIT)
    assert "retention ns-x failed: etcd went away" in caplog.text
    runner.close()


def test_a_closed_job_never_runs_again_and_others_still_do() -> None:
    runner = Runner("bg-closed")
    gate, started = threading.Event(), threading.Event()
    runs = {"a": 0, "b": 0}
    hold = runner.job("hold", lambda: (started.set(), gate.wait(WAIT)))
    a = runner.job("a", lambda: runs.__setitem__("a", runs["a"] + 1))
    b = runner.job("b", lambda: runs.__setitem__("b", runs["b"] + 1))
    hold.poke()
    assert started.wait(WAIT)
    a.poke()
    b.poke()
    a.close()  # closed while queued: dropped
    assert a.closed and not a.pending and a.wait_idle(0.0)
    gate.set()
    assert b.wait_idle(WAIT)
    a.poke()
    b.poke()
    assert b.wait_idle(WAIT)
    assert runs == {"a": 0, "b": 2}
    runner.close()


def test_close_waits_for_a_run_in_progress() -> None:
    runner = Runner("bg-close-wait")
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def fn() -> None:
        started.set()
        release.wait(WAIT)
        finished.append(True)

    job = runner.job("j", fn)
    job.poke()
    assert started.wait(WAIT)
    closer = threading.Thread(target=job.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not finished  # still waiting for the run
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive() and finished == [True]
    runner.close()


def test_a_stopped_runner_ignores_pokes() -> None:
    runner = Runner("bg-stopped")
    ran = threading.Event()
    job = runner.job("j", ran.set)
    runner.close()
    job.poke()
    assert not job.pending and _threads("bg-stopped") == []
    assert not ran.is_set()


def test_own_job_owns_its_runner() -> None:
    ran = threading.Event()
    job = own_job("bg-own", ran.set)
    assert isinstance(job, Job) and job.runner.name == "bg-own"
    job.poke()
    assert ran.wait(WAIT) and job.wait_idle(WAIT)
    (t,) = _threads("bg-own")
    job.close()  # closes the runner too: its thread ends
    t.join(WAIT)
    assert not t.is_alive()
    job.poke()
    assert not job.pending

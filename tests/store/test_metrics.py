"""Prometheus metrics and ``Store.stats``, scraped over HTTP after real pulls.

A publisher process and a consumer here (real etcd, real transport), each with
``metrics_port=0``: after real puts and pulls, ``/metrics`` of both is fetched with urllib and its
figures are checked against what moved (bytes x pulls, one histogram observation per phase per
pull, the latest step, put bytes), against a garbage record written into etcd (bad records), and
against the typed ``Store.stats`` snapshot; the ``get_into`` progress callback reaches the total;
the Grafana dashboard only names metrics that exist.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import astate_store
from astate_store import Stats, connect, metrics
from astate_store.catalog.records import pad20
from tests._procs import CTX

pytestmark = pytest.mark.timeout(120)

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((256, 64), torch.float32),
    "b": ((1000,), torch.float32),
    "h": ((128, 32), torch.bfloat16),
}
NBYTES = sum(torch.empty(s, dtype=d).nbytes for s, d in SHAPES.values())
GARBAGE = b"\x93\xa3not a record\xff\x00"
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


def tensors(step: int) -> dict[str, torch.Tensor]:
    return {
        n: (torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) + 1000.0 * step).to(d)
        for n, (s, d) in SHAPES.items()
    }


def publisher(endpoint: str, ns: str, cmds: Any, out: Any) -> None:
    """A trainer with a metrics server: on ("put", step) publish, answer with its stats."""
    from astate_store.store import Store

    with Store(ns, endpoint=endpoint, transport="shm", session_id=f"{ns}-pub", metrics_port=0) as store:
        out.put(("ready", store.metrics_port))
        while (cmd := cmds.get())[0] == "put":
            committed = store.put(cmd[1], tensors(cmd[1]))
            out.put(("put", committed, dataclasses.asdict(store.stats)))


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``/metrics`` over HTTP: sample name -> {sorted labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(
    m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, rank: str = "0", **labels: str
) -> float:
    """The one sample of ``name`` whose labels include ``labels`` (and ``rank``)."""
    want = {("rank", rank), *labels.items()}
    hits = [v for ls, v in m.get(name, {}).items() if want <= set(ls)]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples in {sorted(m.get(name, {}))}"
    return hits[0]


class World:
    def __init__(self, endpoint: str):
        self.ns = "metrics-" + uuid.uuid4().hex[:10]
        self.endpoint = endpoint
        self.cmds, self.out = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=publisher, args=(endpoint, self.ns, self.cmds, self.out), daemon=True)
        self.proc.start()
        tag, self.pub_port = self.out.get(timeout=60)
        assert tag == "ready" and self.pub_port > 0
        self.cons = connect(self.ns, etcd=endpoint, transport="shm", metrics_port=0)
        self.bufs = {n: torch.zeros(s, dtype=d) for n, (s, d) in SHAPES.items()}
        self.pub_stats: dict[str, Any] = {}
        self.puts = self.pulls = self.step = 0  # (each test checks figures against these: no order assumed)

    def put(self, step: int) -> None:
        self.cmds.put(("put", step))
        tag, committed, self.pub_stats = self.out.get(timeout=30)
        assert tag == "put" and committed
        self.puts, self.step = self.puts + 1, step

    def pull(self, step: int, **kw: Any) -> None:
        assert self.cons.get_into(self.bufs, step=step, timeout=20, **kw) == step
        self.pulls += 1
        for n, t in tensors(step).items():
            assert torch.equal(self.bufs[n], t), n

    def close(self) -> None:
        self.cmds.put(("exit",))
        self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()
        self.cons.close()


@pytest.fixture(scope="module")
def world(etcd: Any) -> Iterator[World]:
    w = World(etcd.endpoint)
    calls: list[tuple[int, int]] = []
    w.put(1)
    w.pull(1, progress=lambda done, total: calls.append((done, total)))
    w.progress_calls = calls  # type: ignore[attr-defined]
    for step in (2, 3):
        w.put(step)
        w.pull(step)
    yield w
    w.close()


def test_consumer_metrics_after_real_pulls(world: World) -> None:
    before = world.cons.stats
    m = scrape(world.cons.metrics_port)  # type: ignore[arg-type]
    after = world.cons.stats
    ns, pulls, step = world.ns, world.pulls, world.step
    assert pulls >= 3
    assert value(m, "astate_pull_bytes_total", namespace=ns) == NBYTES * pulls
    assert value(m, "astate_pulls_total", namespace=ns, outcome="ok") == pulls
    assert value(m, "astate_pulls_total", namespace=ns, outcome="timeout") == 0
    for phase in metrics.PHASES:
        assert value(m, "astate_pull_seconds_count", namespace=ns, phase=phase) == pulls, phase
        assert value(m, "astate_pull_seconds_bucket", namespace=ns, phase=phase, le="+Inf") == pulls
        assert value(m, "astate_pull_seconds_sum", namespace=ns, phase=phase) >= 0
    assert value(m, "astate_pull_duration_seconds_count", namespace=ns) == pulls
    assert value(m, "astate_latest_step", namespace=ns) == step
    assert value(m, "astate_delivered_step", namespace=ns) == step
    assert value(m, "astate_torn_retries_total", namespace=ns) == 0
    assert value(m, "astate_failovers_total", namespace=ns) == 0
    assert value(m, "astate_stores", namespace=ns) == 1
    # The typed snapshot holds the same figures (etcd requests may run between the two reads:
    # the scrape lies between the snapshot taken before and the one after).
    assert isinstance(after, Stats) and dataclasses.is_dataclass(after)
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.pulls = 0  # type: ignore[misc]
    assert after.pulls == before.pulls == pulls and after.pull_bytes == NBYTES * pulls
    assert after.plans == value(m, "astate_plans_total", namespace=ns) >= 1
    assert after.plan_hits == value(m, "astate_plan_cache_hits_total", namespace=ns)
    assert after.reads == value(m, "astate_reads_total", namespace=ns) >= pulls
    assert (
        before.etcd_rpcs
        <= value(m, "astate_etcd_rpcs_total", namespace=ns, kind="foreground")
        <= after.etcd_rpcs
    )
    assert value(m, "astate_pull_duration_seconds_sum", namespace=ns) == pytest.approx(after.pull_seconds)
    assert after.latest_step == after.delivered_step == step
    last = after.last_pull
    assert last is not None and last.step == step and last.bytes == NBYTES and last.torn_retries == 0
    phases = sum(last.phase(p) for p in metrics.PHASES)
    assert 0 < phases <= last.seconds
    assert after.pull_seconds >= last.seconds


def test_get_into_progress_reaches_the_total(world: World) -> None:
    calls = world.progress_calls  # type: ignore[attr-defined]
    assert calls[0] == (0, NBYTES) and calls[-1] == (NBYTES, NBYTES)
    dones = [d for d, _t in calls]
    assert dones == sorted(dones) and {t for _d, t in calls} == {NBYTES}


def test_publisher_metrics_over_http(world: World) -> None:
    m = scrape(world.pub_port)
    ns, puts, st = world.ns, world.puts, world.pub_stats
    assert value(m, "astate_put_bytes_total", namespace=ns) == NBYTES * puts == st["put_bytes"]
    assert value(m, "astate_puts_total", namespace=ns, mode="copy") == puts == st["puts"]
    assert value(m, "astate_put_seconds_count", namespace=ns) == puts
    assert value(m, "astate_put_seconds_sum", namespace=ns) == pytest.approx(st["put_seconds"])
    assert value(m, "astate_commits_total", namespace=ns) == puts == st["commits"]
    assert value(m, "astate_latest_step", namespace=ns) == world.step == st["latest_step"]
    assert value(m, "astate_layouts_published_total", namespace=ns) == st["layouts_published"] == 1
    assert value(m, "astate_staging_bytes", namespace=ns, kind="snapshot") == st["snapshot_bytes"] > 0
    assert value(m, "astate_pulls_total", namespace=ns, outcome="ok") == 0  # it only publishes
    assert value(m, "astate_etcd_rpcs_total", namespace=ns, kind="foreground") >= st["etcd_rpcs"] > 0


def test_bad_record_is_counted(world: World) -> None:
    step = world.step + 1
    world.put(step)
    raw = world.cons.catalog.client.raw
    key = world.cons.catalog.client.key("versions", pad20(step), "replicas", "g", "m1")
    raw.put(key, GARBAGE)  # a garbage replica record: every consumer's begin_read meets it
    try:
        bad = world.cons.stats.bad_records
        world.pull(step)
    finally:
        raw.delete(key)
    m = scrape(world.cons.metrics_port)  # type: ignore[arg-type]
    assert world.cons.stats.bad_records == bad + 1
    assert value(m, "astate_bad_records_total", namespace=world.ns) == bad + 1
    assert value(m, "astate_latest_step", namespace=world.ns) == step


def test_stores_in_one_process_keep_apart_add_up_and_keep_counters(world: World) -> None:
    """Stores of other labels (here rank 7) are series of their own; two of the same labels add
    up; a closed store's counters stay (they never go backwards) and its gauges leave."""
    ns, port = world.ns, world.cons.metrics_port
    assert port is not None
    mine = value(scrape(port), "astate_pull_bytes_total", namespace=ns)
    others = [connect(ns, etcd=world.endpoint, transport="shm", rank=7, metrics_port=0) for _ in range(2)]
    try:
        assert {s.metrics_port for s in others} == {port}  # one server per process
        for s in others:
            bufs = {n: torch.zeros(sh, dtype=d) for n, (sh, d) in SHAPES.items()}
            got = s.get_into(bufs, timeout=20)
            assert s.stats.pull_bytes == NBYTES and s.stats.delivered_step == got
        m = scrape(port)
        assert value(m, "astate_stores", rank="7", namespace=ns) == 2
        assert value(m, "astate_pull_bytes_total", rank="7", namespace=ns) == 2 * NBYTES
        assert value(m, "astate_pulls_total", rank="7", namespace=ns, outcome="ok") == 2
        assert value(m, "astate_pull_bytes_total", namespace=ns) == mine  # rank 0's series untouched
    finally:
        for s in others:
            s.close()
    m = scrape(port)
    assert not [ls for ls in m["astate_stores"] if ("rank", "7") in ls and ("namespace", ns) in ls]
    assert value(m, "astate_pull_bytes_total", rank="7", namespace=ns) == 2 * NBYTES
    assert value(m, "astate_pull_seconds_count", rank="7", namespace=ns, phase="transfer") == 2


def test_bad_metrics_port_is_refused_before_connecting(etcd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        connect("metrics-bad", etcd=etcd.endpoint, metrics_port=70000)
    monkeypatch.setenv("ASTATE_METRICS_PORT", "http")
    with pytest.raises(ValueError, match="ASTATE_METRICS_PORT"):
        connect("metrics-bad", etcd=etcd.endpoint)


def test_a_taken_metrics_port_does_not_stop_the_store(
    etcd: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("ASTATE_METRICS_PORT", str(port))  # as a second rank on the host would get it
        with caplog.at_level(logging.WARNING, logger="astate_store"):
            with connect("metrics-taken", etcd=etcd.endpoint) as store:
                assert store.metrics_port is None and store.latest() is None
    assert any(
        f":{port}" in r.getMessage() and "cannot serve metrics" in r.getMessage() for r in caplog.records
    )


def test_grafana_dashboard_names_only_served_metrics(world: World) -> None:
    dash = json.loads(DASHBOARD.read_text())
    served = set(scrape(world.cons.metrics_port)) | set(scrape(world.pub_port))  # type: ignore[arg-type]
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [
        v["query"]["query"] if isinstance(v.get("query"), dict) else v.get("query", "")
        for v in dash.get("templating", {}).get("list", ())
    ]
    named = {n for e in exprs for n in re.findall(r"\bastate_[a-z_]+", e)}
    assert len(named) >= 10 and named <= served, sorted(named - served)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert dash["uid"] and dash["title"] and os.path.basename(DASHBOARD) == "grafana-dashboard.json"
    assert astate_store.Stats is Stats


def test_etcd_retries_are_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """An etcd that does not answer (nothing listens on the port): every retry is counted, and the
    outage is logged at WARNING once, not once per retry."""
    import socket

    from astate_store.catalog import Catalog
    from astate_store.errors import CatalogUnavailable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    cat = Catalog(f"127.0.0.1:{port}", "metrics-down", op_timeout=0.2, retry_deadline=1.0)
    try:
        with caplog.at_level(logging.DEBUG, logger="astate_store.catalog"):
            with pytest.raises(CatalogUnavailable):
                cat.versions.latest()
        warnings = [
            r for r in caplog.records if r.levelno == logging.WARNING and "did not answer" in r.getMessage()
        ]
        assert cat.client.retries >= 3 and len(warnings) == 1
        assert f"127.0.0.1:{port}" in warnings[0].getMessage()
    finally:
        cat.close(revoke=False)


def test_bad_records_log_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    from astate_store.catalog.records import Skips

    skips = Skips("metrics-ns", "bad")
    with caplog.at_level(logging.WARNING, logger="astate_store"):
        for i in range(25):
            skips(f"/astate/metrics-ns/junk/{i}", "garbage", revision=i)
        skips("/astate/metrics-ns/junk/0", "garbage", revision=0)  # the same record again: counted only
    lines = [r.getMessage() for r in caplog.records if "skipping bad record" in r.getMessage()]
    assert skips.count == 26 and len(lines) == Skips._BURST

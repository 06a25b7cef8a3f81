"""What a store counts, the typed snapshot of it (``Store.stats``), and its Prometheus exposition.

Every store keeps its figures in one :class:`StoreMetrics` (plain integers and fixed-bucket
histograms, updated once per pull and once per put — never per tensor). Nothing is pushed
anywhere: the process-wide :data:`REGISTRY` holds one collector that reads the live stores'
figures when ``/metrics`` is scraped, labelled ``namespace`` and ``rank``. Several stores with
the same labels in one process add up, and a closed store's counters are kept (folded into the
totals of its labels), so counters never go backwards while the process lives.

``connect(..., metrics_port=PORT)`` (or ``$ASTATE_METRICS_PORT``) starts the process's one HTTP
server (:func:`serve`), bound to 127.0.0.1 unless ``metrics_addr`` says otherwise. See
docs/metrics.md for each metric and what to alert on.
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from astate_store.model.progress import Progress, ProgressCounter

__all__ = [
    "PHASES",
    "PULL_OUTCOMES",
    "PUT_MODES",
    "BUCKETS",
    "PullStats",
    "Stats",
    "PullTimes",
    "StoreMetrics",
    "REGISTRY",
    "register",
    "serve",
    "served_port",
]

log = logging.getLogger("astate_store.metrics")

PHASES = ("wait", "metadata", "plan", "transfer", "convert")
PULL_OUTCOMES = ("ok", "timeout", "torn", "unreachable", "corrupted", "error")
PUT_MODES = ("copy", "in_place", "streamed")
# Seconds: a steady pull's phases take tens of microseconds (cached plan) to seconds (a large
# transfer); waits and first pulls of a big model take minutes.
BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class Histogram:
    """A fixed-bucket histogram: one bisect and two additions per observation (no lock: the GIL
    keeps each addition whole; a scrape racing an observation may see it half counted)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add(self, other: Histogram) -> None:
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.sum += other.sum

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, as Prometheus exposes them."""
        out, total = [], 0
        for bound, n in zip((*map(repr, BUCKETS), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass(frozen=True)
class PullStats:
    """One ``get_into``: the step delivered, what moved, and seconds per phase.

    Phases: ``wait`` (for a commit >= the step asked for), ``metadata`` (begin_read, layouts,
    end_read), ``plan`` (source choice, connections and planning, or the cached batch),
    ``transfer`` (the batched same-dtype reads), ``convert`` (reads through staging and dtype
    conversion on this side). A pull that was torn and retried adds its attempts up.
    """

    step: int
    bytes: int  # read over the transport (= the buffers' bytes for same-dtype buffers)
    reads: int  # transport read operations (runs)
    local_conversions: int  # buffers converted on this side
    torn_retries: int
    failovers: int
    wait_s: float
    metadata_s: float
    plan_s: float
    transfer_s: float
    convert_s: float
    seconds: float  # the whole call

    def phase(self, name: str) -> float:
        """Seconds of one phase of :data:`PHASES`."""
        return float(getattr(self, f"{name}_s"))


@dataclass(frozen=True)
class Stats:
    """A store's figures at one moment (``Store.stats``): cumulative counters since the store
    was opened, current gauges, and the last pull. The same figures ``/metrics`` serves (there
    summed over the stores of one ``namespace`` and ``rank`` in the process).

    Consumer side: ``pulls`` (successful ``get_into`` calls), ``pull_errors`` (failed ones),
    ``pull_bytes``, ``pull_seconds`` (their whole duration), ``torn_retries`` (reads discarded
    because a source retired the memory under them), ``failovers`` (a source set failed, another
    was tried), ``plans`` and ``plan_hits`` (planner runs and cache hits), ``reads`` (transport
    read operations), ``local_conversions`` (buffers converted on this side), ``delta_pulls``
    (pulls served as deltas: only the changes since the buffers' step moved, docs/delta.md),
    ``delta_elements`` (the elements those pulls wrote into the buffers), ``delta_declined`` (pulls
    that could have gone through changes and went whole, measured faster: ``delta_choice="time"``),
    ``verified_tiles`` and
    ``unverified_tiles`` (``verify=True``: tiles checked against their digests, and tiles of the
    buffers that could not be: held in part, converted, on a device, or without a digest),
    ``delivered_step`` and ``last_pull``.

    Publisher side: ``puts``, ``put_bytes`` (this rank's bytes published), ``put_seconds``,
    ``put_errors`` (puts that raised, e.g. fenced by a newer session), ``commits`` (puts that
    completed their version), ``streamed_puts`` (larger than the staging cap), ``layouts_published``,
    ``registrations`` (caller memory registered now: in-place puts
    and ``serve``), ``snapshot_bytes`` and ``conversion_bytes`` (staging held now).

    Catalog: ``bad_records`` (records read from etcd that failed their checks and were skipped),
    ``etcd_rpcs`` and ``etcd_background_rpcs`` (request attempts on callers' paths and on
    background threads), ``etcd_retries`` (attempts etcd did not answer, retried), and
    ``latest_step`` (the newest committed step this store has seen).
    """

    pulls: int = 0
    pull_errors: int = 0
    pull_bytes: int = 0
    pull_seconds: float = 0.0
    torn_retries: int = 0
    failovers: int = 0
    plans: int = 0
    plan_hits: int = 0
    reads: int = 0
    local_conversions: int = 0
    delta_pulls: int = 0
    delta_elements: int = 0
    delta_declined: int = 0
    verified_tiles: int = 0
    unverified_tiles: int = 0
    puts: int = 0
    put_bytes: int = 0
    put_seconds: float = 0.0
    put_errors: int = 0
    commits: int = 0
    streamed_puts: int = 0
    layouts_published: int = 0
    registrations: int = 0
    snapshot_bytes: int = 0
    conversion_bytes: int = 0
    bad_records: int = 0
    etcd_rpcs: int = 0
    etcd_background_rpcs: int = 0
    etcd_retries: int = 0
    latest_step: int | None = None
    delivered_step: int | None = None
    last_pull: PullStats | None = field(default=None)


class PullTimes:
    """Seconds per phase of one pull in progress (attempts add up), and its progress callback
    (``progress``; ``counter`` reports to it once the pull's size is known)."""

    __slots__ = (
        "wait",
        "metadata",
        "plan",
        "transfer",
        "convert",
        "torn",
        "failovers",
        "progress",
        "counter",
    )

    def __init__(self, progress: Progress | None):
        self.wait = self.metadata = self.plan = self.transfer = self.convert = 0.0
        self.torn = self.failovers = 0
        self.progress = progress
        self.counter: ProgressCounter | None = None


# Counters a store adds to (also kept for closed stores, per label set).
_COUNTERS = (
    "pull_bytes",
    "torn_retries",
    "failovers",
    "plans",
    "plan_hits",
    "reads",
    "local_conversions",
    "delta_pulls",
    "delta_elements",
    "delta_declined",
    "verified_tiles",
    "unverified_tiles",
    "put_bytes",
    "put_errors",
    "commits",
    "streamed_puts",
    "layouts_published",
)


class StoreMetrics:
    """One store's figures: what the data path adds to, and what :class:`Stats` and the
    collector read. ``live`` gives the figures owned elsewhere (catalog counters, staging)."""

    def __init__(self, namespace: str, rank: int, live: Callable[[], dict[str, int]] | None = None):
        self.labels = (namespace, str(rank))
        self.live = live or (lambda: {})
        for name in _COUNTERS:
            setattr(self, name, 0)
        self.registrations = 0
        self.pulls_by = dict.fromkeys(PULL_OUTCOMES, 0)
        self.puts_by = dict.fromkeys(PUT_MODES, 0)
        self.pull_phase = {p: Histogram() for p in PHASES}
        self.pull_total = Histogram()
        self.put_total = Histogram()
        self.latest_step: int | None = None
        self.delivered_step: int | None = None
        self.last_pull: PullStats | None = None
        with _LOCK:
            _LIVE.add(self)

    # ---- the data path ---------------------------------------------------------------------

    def saw_step(self, step: int) -> None:
        """A committed step this store learned of (a commit it made, or a wait that returned)."""
        if self.latest_step is None or step > self.latest_step:
            self.latest_step = step

    def pulled(
        self, t: PullTimes, step: int, nbytes: int, reads: int, conversions: int, seconds: float
    ) -> None:
        """A good pull: once per ``get_into``, whatever the number of tensors."""
        self.pulls_by["ok"] += 1
        self.pull_bytes += nbytes
        self.reads += reads
        self.local_conversions += conversions
        ph = self.pull_phase
        ph["wait"].observe(t.wait)
        ph["metadata"].observe(t.metadata)
        ph["plan"].observe(t.plan)
        ph["transfer"].observe(t.transfer)
        ph["convert"].observe(t.convert)
        self.pull_total.observe(seconds)
        self.delivered_step = step
        self.saw_step(step)
        self.last_pull = PullStats(
            step,
            nbytes,
            reads,
            conversions,
            t.torn,
            t.failovers,
            t.wait,
            t.metadata,
            t.plan,
            t.transfer,
            t.convert,
            seconds,
        )

    def delta_pulled(self, elements: int) -> None:
        """A pull served as a delta (counted in ``pulled`` too), which wrote ``elements``."""
        self.delta_pulls += 1
        self.delta_elements += elements

    def pull_failed(self, outcome: str) -> None:
        self.pulls_by[outcome if outcome in self.pulls_by else "error"] += 1

    def put_done(self, mode: str, nbytes: int, seconds: float, step: int, committed: bool) -> None:
        """A put this rank completed (committed or not: the other ranks may commit it)."""
        self.puts_by[mode] += 1
        self.put_bytes += nbytes
        self.put_total.observe(seconds)
        if committed:
            self.commits += 1
            self.saw_step(step)

    # ---- reading ---------------------------------------------------------------------------

    @property
    def puts(self) -> int:
        return sum(self.puts_by.values())

    @property
    def pulls(self) -> int:
        return self.pulls_by["ok"]

    def snapshot(self) -> Stats:
        live = self.live()
        errors = sum(n for k, n in self.pulls_by.items() if k != "ok")
        known = {f.name for f in fields(Stats)}
        base = {name: getattr(self, name) for name in _COUNTERS}
        return Stats(
            **base,
            pulls=self.pulls,
            puts=self.puts,
            pull_errors=errors,
            pull_seconds=self.pull_total.sum,
            put_seconds=self.put_total.sum,
            registrations=self.registrations,
            latest_step=self.latest_step,
            delivered_step=self.delivered_step,
            last_pull=self.last_pull,
            **{k: v for k, v in live.items() if k in known},
        )

    def close(self) -> None:
        """The store closed: its figures stay in the totals of its labels, and it leaves the
        live set (its gauges go with it)."""
        with _LOCK:
            if self in _LIVE:
                _LIVE.discard(self)
                _retired(self.labels).absorb(self, self.live())


class _Retired:
    """The figures of closed stores of one label set, so their counters never go backwards."""

    def __init__(self) -> None:
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.live = dict.fromkeys(_LIVE_COUNTERS, 0)
        self.pulls_by = dict.fromkeys(PULL_OUTCOMES, 0)
        self.puts_by = dict.fromkeys(PUT_MODES, 0)
        self.pull_phase = {p: Histogram() for p in PHASES}
        self.pull_total, self.put_total = Histogram(), Histogram()

    def absorb(self, m: StoreMetrics, live: dict[str, int]) -> None:
        for name in _COUNTERS:
            self.counters[name] += getattr(m, name)
        for name in _LIVE_COUNTERS:
            self.live[name] += int(live.get(name, 0))
        for k, n in m.pulls_by.items():
            self.pulls_by[k] += n
        for k, n in m.puts_by.items():
            self.puts_by[k] += n
        for p in PHASES:
            self.pull_phase[p].add(m.pull_phase[p])
        self.pull_total.add(m.pull_total)
        self.put_total.add(m.put_total)


# Counters owned by the catalog (read through ``live``), kept for closed stores too.
_LIVE_COUNTERS = ("bad_records", "etcd_rpcs", "etcd_background_rpcs", "etcd_retries")

_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[StoreMetrics] = weakref.WeakSet()  # a store dropped unclosed just leaves
_RETIRED: dict[tuple[str, str], _Retired] = {}


def _retired(labels: tuple[str, str]) -> _Retired:
    r = _RETIRED.get(labels)
    if r is None:
        r = _RETIRED[labels] = _Retired()
    return r


# ---- exposition --------------------------------------------------------------------------------

_LABELS = ["namespace", "rank"]

# name -> (help, attribute of StoreMetrics / key of the live figures)
_COUNTER_HELP = {
    "pull_bytes": "Bytes read over the transport into get_into buffers.",
    "torn_retries": "Pulls discarded because a source retired the memory during the read (then retried).",
    "failovers": "Pull attempts whose source set failed, so another set was tried.",
    "plans": "Planner runs (plan cache misses).",
    "plan_hits": "Pulls served by a cached plan or ready-made batch.",
    "reads": "Transport read operations (runs) issued by pulls.",
    "local_conversions": "Buffers converted to another dtype on the consumer.",
    "delta_pulls": "Pulls served as deltas: only the changes since the buffers' version were read.",
    "delta_elements": "Elements delta pulls wrote into buffers.",
    "delta_declined": "Pulls that could go as deltas and went whole, measured faster (delta_choice=time).",
    "verified_tiles": "Tiles of pulled buffers checked against their publishers' digests (verify=True).",
    "unverified_tiles": "Tiles verify could not check (held in part, converted, no digest).",
    "put_bytes": "Bytes this rank published with put.",
    "put_errors": "put calls that raised (a fenced session, etcd unreachable, a bad input past validation).",
    "commits": "Puts of this rank that completed (committed) their version.",
    "streamed_puts": "Puts larger than the staging cap, streamed from the caller's tensors.",
    "layouts_published": "Layout records written (a changed shard layout or staging).",
}
_LIVE_HELP = {
    "bad_records": "Records read from etcd that failed their schema or key checks and were skipped.",
    "etcd_retries": "etcd request attempts that got no answer and were retried with backoff.",
}
_METRIC_NAME = {"plan_hits": "plan_cache_hits", "local_conversions": "local_conversions"}


class _Collector(Collector):
    """Reads every live store's figures (and closed stores' totals) at scrape time."""

    def collect(self) -> Iterator[Metric]:
        with _LOCK:
            groups: dict[tuple[str, str], list[tuple[StoreMetrics, dict[str, int]]]] = {}
            for m in list(_LIVE):
                groups.setdefault(m.labels, []).append((m, m.live()))
            for labels in _RETIRED:
                groups.setdefault(labels, [])
            retired = dict(_RETIRED)
        yield from _families(groups, retired)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected on demand; nothing to check at registration


def _families(
    groups: dict[tuple[str, str], list[tuple[StoreMetrics, dict[str, int]]]],
    retired: dict[tuple[str, str], _Retired],
) -> Iterator[Metric]:
    def total(labels: tuple[str, str], name: str, live: bool = False) -> float:
        r = retired.get(labels)
        base = (r.live if live else r.counters).get(name, 0) if r is not None else 0
        if live:
            return base + sum(int(lv.get(name, 0)) for _m, lv in groups[labels])
        return base + sum(getattr(m, name) for m, _lv in groups[labels])

    def by(labels: tuple[str, str], attr: str, key: str) -> int:
        r = retired.get(labels)
        return (getattr(r, attr)[key] if r is not None else 0) + sum(
            getattr(m, attr)[key] for m, _ in groups[labels]
        )

    def hist(labels: tuple[str, str], pick: Callable[[Any], Histogram]) -> Histogram:
        h = Histogram()
        r = retired.get(labels)
        if r is not None:
            h.add(pick(r))
        for m, _ in groups[labels]:
            h.add(pick(m))
        return h

    pulls = CounterMetricFamily("astate_pulls", "get_into calls by outcome.", labels=[*_LABELS, "outcome"])
    puts = CounterMetricFamily("astate_puts", "put calls completed, by mode.", labels=[*_LABELS, "mode"])
    rpcs = CounterMetricFamily(
        "astate_etcd_rpcs", "etcd request attempts (foreground: callers' paths).", labels=[*_LABELS, "kind"]
    )
    for labels in groups:
        for o in PULL_OUTCOMES:
            pulls.add_metric([*labels, o], by(labels, "pulls_by", o))
        for mode in PUT_MODES:
            puts.add_metric([*labels, mode], by(labels, "puts_by", mode))
        rpcs.add_metric([*labels, "foreground"], total(labels, "etcd_rpcs", live=True))
        rpcs.add_metric([*labels, "background"], total(labels, "etcd_background_rpcs", live=True))
    yield pulls
    yield puts
    yield rpcs
    for name, doc in _COUNTER_HELP.items():
        fam = CounterMetricFamily(f"astate_{_METRIC_NAME.get(name, name)}", doc, labels=_LABELS)
        for labels in groups:
            fam.add_metric(list(labels), total(labels, name))
        yield fam
    for name, doc in _LIVE_HELP.items():
        fam = CounterMetricFamily(f"astate_{name}", doc, labels=_LABELS)
        for labels in groups:
            fam.add_metric(list(labels), total(labels, name, live=True))
        yield fam

    phase = HistogramMetricFamily(
        "astate_pull_seconds",
        "Seconds per phase of each successful get_into "
        "(wait, metadata, plan, transfer, convert; every pull observes every phase).",
        labels=[*_LABELS, "phase"],
    )
    whole = HistogramMetricFamily(
        "astate_pull_duration_seconds", "Seconds of each successful get_into.", labels=_LABELS
    )
    put = HistogramMetricFamily("astate_put_seconds", "Seconds of each put.", labels=_LABELS)
    for labels in groups:
        for p in PHASES:
            h = hist(labels, lambda x, p=p: x.pull_phase[p])
            phase.add_metric([*labels, p], h.buckets(), h.sum)
        h = hist(labels, lambda x: x.pull_total)
        whole.add_metric(list(labels), h.buckets(), h.sum)
        h = hist(labels, lambda x: x.put_total)
        put.add_metric(list(labels), h.buckets(), h.sum)
    yield phase
    yield whole
    yield put

    yield from _gauges(groups)


def _gauges(groups: dict[tuple[str, str], list[tuple[StoreMetrics, dict[str, int]]]]) -> Iterator[Metric]:
    """Current state: only live stores count (a closed store holds nothing)."""
    latest = GaugeMetricFamily(
        "astate_latest_step", "Newest committed step this process has seen.", labels=_LABELS
    )
    delivered = GaugeMetricFamily(
        "astate_delivered_step", "Step the last get_into delivered.", labels=_LABELS
    )
    staging = GaugeMetricFamily(
        "astate_staging_bytes", "Staging memory held (snapshot slots, conversion).", labels=[*_LABELS, "kind"]
    )
    regs = GaugeMetricFamily(
        "astate_registrations", "Caller memory regions registered (in-place puts, serve).", labels=_LABELS
    )
    stores = GaugeMetricFamily("astate_stores", "Open stores.", labels=_LABELS)
    for labels, items in groups.items():
        if not items:
            continue
        steps = [m.latest_step for m, _ in items if m.latest_step is not None]
        if steps:
            latest.add_metric(list(labels), max(steps))
        got = [m.delivered_step for m, _ in items if m.delivered_step is not None]
        if got:
            delivered.add_metric(list(labels), max(got))
        staging.add_metric([*labels, "snapshot"], sum(lv.get("snapshot_bytes", 0) for _, lv in items))
        staging.add_metric([*labels, "conversion"], sum(lv.get("conversion_bytes", 0) for _, lv in items))
        regs.add_metric(list(labels), sum(m.registrations for m, _ in items))
        stores.add_metric(list(labels), len(items))
    yield from (latest, delivered, staging, regs, stores)


REGISTRY = CollectorRegistry(auto_describe=False)
_COLLECTOR = _Collector()
REGISTRY.register(_COLLECTOR)


def register(registry: CollectorRegistry) -> None:
    """Also expose the stores' metrics through another registry (e.g. ``prometheus_client.REGISTRY``
    of an exporter the process already runs)."""
    registry.register(_COLLECTOR)


# ---- the HTTP server ----------------------------------------------------------------------------

_SERVERS: dict[tuple[str, int], Any] = {}  # (addr, bound port) -> server


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Serve :data:`REGISTRY` at ``http://addr:port/metrics``; returns the bound port. One server
    per process and address: port 0 reuses a running one (or picks a free port), a port already
    served is reused.

    Raises:
        ValueError: a port outside 0..65535.
        OSError: the port is taken by something else (a store then logs it and goes on without).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be a port number 0..65535 (0: any free port), got {port!r}")
    with _LOCK:
        for a, p in _SERVERS:
            if a == addr and port in (0, p):
                return p
        server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
        bound = int(server.server_port)
        _SERVERS[(addr, bound)] = server
    log.info("serving Prometheus metrics at http://%s:%d/metrics", addr, bound)
    return bound


def served_port(addr: str = "127.0.0.1") -> int | None:
    """The port this process serves metrics on at ``addr`` (None when it serves none)."""
    with _LOCK:
        return next((p for (a, p) in _SERVERS if a == addr), None)

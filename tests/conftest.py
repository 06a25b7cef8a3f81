"""Shared fixtures: one real etcd server for the whole test session, a fresh namespace per test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from astate_store.catalog import Catalog
from astate_store.etcd.embedded import EmbeddedEtcd
from tests.support import orphans

# Every process the tests start (and what those start) carries this run's tag in its environment,
# so the session's end can tell which of them outlived it (issue 29: no orphans after make test).
_RUN_TAG = orphans.tag_children()


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    # No fsync: the session's etcd is thrown away at the end, and a write must not wait on the disk
    # that the tests' model files and checkpoints keep busy (a stalled etcd expires leases).
    server = EmbeddedEtcd(extra_args=["--unsafe-no-fsync"]).start()
    # Child processes started by tests find the same server through the environment.
    os.environ["ASTATE_ETCD"] = server.endpoint
    yield server
    os.environ.pop("ASTATE_ETCD", None)
    server.stop()


@pytest.fixture
def namespace() -> str:
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def catalog_factory(etcd: EmbeddedEtcd, namespace: str) -> Iterator[Callable[..., Catalog]]:
    made: list[Catalog] = []

    def make(ns: str | None = None, **kw: object) -> Catalog:
        c = Catalog(etcd.endpoint, ns or namespace, **kw)  # type: ignore[arg-type]
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def store_factory(etcd: EmbeddedEtcd, namespace: str) -> Iterator[Callable[..., Any]]:
    """``make(ns=None, **options)``: a ``Store`` of this test's namespace (or ``ns``) on the test
    etcd, over shared memory unless ``transport=`` says otherwise; closed after the test, newest
    first (a consumer before the publisher it reads)."""
    from astate_store.store import Store  # lazily: most tests of the suite need no store

    made: list[Any] = []

    def make(ns: str | None = None, **options: Any) -> Any:
        options.setdefault("transport", "shm")
        s = Store(ns or namespace, endpoint=etcd.endpoint, **options)
        made.append(s)
        return s

    yield make
    for s in reversed(made):
        s.close()


# The transports a behaviour that depends on the transport runs over: same-host shared memory, and
# tcp (the streamed path a consumer on another host takes).
TRANSPORTS = ("shm", "tcp")


@pytest.fixture(params=TRANSPORTS, ids=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """This test's transport: the test runs once over each of :data:`TRANSPORTS`."""
    return str(request.param)


@pytest.fixture
def transport_store_factory(store_factory: Callable[..., Any], transport: str) -> Callable[..., Any]:
    """``make(ns=None, **options)``: ``store_factory``'s store over this test's ``transport``, for the
    behaviours that depend on it (put and get_into, resharding, conversion, torn reads, failover)."""

    def make(ns: str | None = None, **options: Any) -> Any:
        return store_factory(ns, transport=transport, **options)

    return make


def pytest_configure(config: pytest.Config) -> None:
    # Next to pyproject's markers (gpu, slow); ``make test-fast`` leaves out slow, vllm and sglang.
    config.addinivalue_line("markers", "vllm: starts or imports real vLLM (minutes each)")
    config.addinivalue_line("markers", "sglang: starts a real SGLang engine from .venv-sglang (minutes each)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real-engine tests (``xdist_group("vllm")``, ``xdist_group("sglang")``) first: their files,
    minutes of engine start-up each, start while the rest of the suite is still queued, instead of
    arriving last and leaving one worker idle behind them (``make test`` hands whole files to a worker)."""

    def first(item: pytest.Item) -> int:
        engines = (("vllm",), ("sglang",))
        return 0 if any(m.args[:1] in engines for m in item.iter_markers("xdist_group")) else 1

    items.sort(key=first)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when a process the tests started (an etcd, a replica server, a worker) still
    runs after the session fixtures are torn down; end those (they carry this run's tag), so they
    do not run for hours. A shared etcd's supervisor may take its idle grace (5 s) to go."""
    left = orphans.leftovers(_RUN_TAG, wait=20.0)
    if not left:
        return
    lines = "\n".join(f"  pid {p['pid']} (parent {p['ppid']}): {p['cmd']}" for p in left)
    msg = f"ORPHANS: {len(left)} process(es) started by the tests outlived them; ending them by pid:\n{lines}"
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "processes left running", red=True, bold=True)
        reporter.write_line(msg)
    else:
        print(msg, file=sys.stderr)
    orphans.end_leftovers(left, _RUN_TAG)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED

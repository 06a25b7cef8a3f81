"""Shared fixtures: one real etcd server for the whole test session, a fresh namespace per test."""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Iterator

import pytest

from astate_store.catalog import Catalog
from astate_store.etcd.embedded import EmbeddedEtcd


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd().start()
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

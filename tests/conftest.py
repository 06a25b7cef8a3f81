"""Shared fixtures: one real etcd server for the whole test session, a fresh namespace per test."""

from __future__ import annotations

import os
import uuid
from typing import Callable, Iterator

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

"""Deleting versions and namespaces, listing namespaces: from Python and from ``astate rm``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from astate_store import CatalogError, VersionNotFound
from astate_store.catalog.namespaces import delete_namespace, namespaces
from astate_store.store import Store


def test_delete_a_version_then_the_namespace(etcd, namespace):
    pub = Store(namespace, endpoint=etcd.endpoint, transport="shm", retention=8)
    for step in (1, 2, 3):
        pub.put(step, {"x": torch.full((4,), float(step))}, meta={"s": step})
    pub.delete(2)
    with Store(namespace, endpoint=etcd.endpoint, transport="shm") as reader:
        assert reader.catalog.versions.committed_steps() == [1, 3]
        with pytest.raises(VersionNotFound):
            reader.meta(2)  # its meta went with it
        assert reader.meta(1) == {"s": 1}
        buf = torch.zeros(4)
        assert reader.get_into({"x": buf}, timeout=30) == 3 and torch.equal(buf, torch.full((4,), 3.0))
    with pytest.raises(VersionNotFound):
        pub.delete(2)
    with pytest.raises(CatalogError, match="newest committed step"):
        pub.delete(3)

    assert namespace in namespaces(etcd=etcd.endpoint)
    with pytest.raises(CatalogError, match="in use"):
        delete_namespace(namespace, etcd=etcd.endpoint)  # the publisher is live
    pub.close()
    assert delete_namespace(namespace, etcd=etcd.endpoint) > 0
    assert namespace not in namespaces(etcd=etcd.endpoint)
    with Store(namespace, endpoint=etcd.endpoint, transport="shm") as again:
        assert again.latest() is None


def test_astate_rm_deletes_a_namespace(etcd, namespace):
    with Store(namespace, endpoint=etcd.endpoint, transport="shm") as pub:
        pub.put(1, {"x": torch.ones(2)})
        pub.put(2, {"x": torch.ones(2)})
        run = [sys.executable, "-m", "astate_store.cli", "--etcd", etcd.endpoint, "rm", namespace]
        busy = subprocess.run(run, capture_output=True, text=True, timeout=120)
        assert busy.returncode == 1 and "in use" in busy.stderr
        one = subprocess.run(run + ["--step", "1"], capture_output=True, text=True, timeout=120)
        assert one.returncode == 0, one.stderr
        assert pub.catalog.versions.committed_steps() == [2]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "keys" in done.stdout, done.stderr
    assert namespace not in namespaces(etcd=etcd.endpoint)

"""Namespace administration from Python: list the namespaces of an etcd, delete one.

The same operations as ``astate ls`` and ``astate rm`` (astate_store/cli); ``Store.delete``
drops a single version of an open namespace.
"""

from __future__ import annotations

from collections.abc import Sequence

from astate_store.catalog import Catalog
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.etcd.config import EtcdConfig

__all__ = ["namespaces", "delete_namespace", "list_namespaces"]

ROOT = "/astate/"  # every namespace's keys live under ROOT + <namespace> + "/"


def _config(
    etcd: str | Sequence[str] | EtcdConfig | None,
    ca: str | None,
    cert: str | None,
    key: str | None,
    user: str | None,
    password: str | None,
) -> EtcdConfig:
    # No embedded etcd here: administering needs an existing one ($ASTATE_ETCD when not given).
    return EtcdConfig.from_args(etcd or None, ca=ca, cert=cert, key=key, user=user, password=password)


def namespaces(
    *,
    etcd: str | Sequence[str] | EtcdConfig | None = None,
    etcd_ca: str | None = None,
    etcd_cert: str | None = None,
    etcd_key: str | None = None,
    etcd_user: str | None = None,
    etcd_password: str | None = None,
) -> list[str]:
    """Every namespace with keys in this etcd, sorted (one read per namespace).

    Raises:
        CatalogError: no endpoint given nor in ``$ASTATE_ETCD``; CatalogUnavailable / CatalogAuthError.
    """
    client = EtcdClient(
        _config(etcd, etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password),
        "_admin",
        lease_ttl=10.0,
        op_timeout=5.0,
        retry_deadline=10.0,
    )
    try:
        return list_namespaces(client)
    finally:
        client.close(revoke=False)


def delete_namespace(
    namespace: str,
    *,
    force: bool = False,
    etcd: str | Sequence[str] | EtcdConfig | None = None,
    etcd_ca: str | None = None,
    etcd_cert: str | None = None,
    etcd_key: str | None = None,
    etcd_user: str | None = None,
    etcd_password: str | None = None,
) -> int:
    """Delete every catalog key of ``namespace`` (checkpoint files in storage stay); returns the
    number of keys deleted.

    Raises:
        CatalogError: a publisher or consumer of it is still live (unless ``force``), or no endpoint.
    """
    cat = Catalog(_config(etcd, etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password), namespace)
    try:
        return cat.delete_all(force=force)
    finally:
        cat.close()


def list_namespaces(client: EtcdClient) -> list[str]:
    """Every namespace with at least one key under ``/astate/``, sorted. One keys-only read of one
    key per namespace (a skip scan), whatever the number of keys each holds."""
    out: list[str] = []
    start: bytes = ROOT.encode()
    end = range_end(ROOT)
    while True:
        first = start
        resp = client.call(
            "list namespaces", lambda: client.raw.get_range_response(first, end, keys_only=True, limit=1)
        )
        if not resp.kvs:
            return out
        key = resp.kvs[0].key.decode("utf-8", "replace")
        ns = key[len(ROOT) :].split("/", 1)[0]
        if ns:
            out.append(ns)
        # Past every key of this namespace: '/' + 1 is '0'.
        start = (ROOT + ns + "0").encode()

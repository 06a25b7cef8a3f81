"""Namespace administration from Python: list the namespaces of an etcd, delete one.

The same operations as ``astate ls`` and ``astate rm`` (astate_store/cli); ``Store.delete``
drops a single version of an open namespace.
"""

from __future__ import annotations

from collections.abc import Sequence

from astate_store.catalog import Catalog
from astate_store.cli.views import list_namespaces
from astate_store.etcd.client import EtcdClient
from astate_store.etcd.config import EtcdConfig

__all__ = ["namespaces", "delete_namespace"]


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

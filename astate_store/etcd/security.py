"""etcd with TLS and authentication: test certificates, root and per-namespace users.

- :func:`make_test_certs` writes a CA, a server certificate for ``127.0.0.1`` / ``localhost`` and a
  client certificate (for tests and single-host set-ups; use your own PKI in production). It needs
  ``cryptography``, which is in the ``test`` extra, not a dependency of the store.
- :func:`enable_auth` creates etcd's ``root`` user and role and turns authentication on.
- :func:`grant_namespace` gives a user a role limited to one namespace's keys
  (``/astate/<namespace>/``), read-write or read-only.

Both admin calls speak etcd's own Auth gRPC service (``pyetcd.etcdrpc`` stubs) through
:class:`~astate_store.etcd.client.EtcdClient`, so they get the same TLS, token handling,
retries and typed errors as the store. Everything the store writes is under the namespace
prefix, so such a user can run every store operation of that namespace.

``EmbeddedEtcd(tls=make_test_certs(d), auth=True)`` (in :mod:`astate_store.etcd.embedded`) runs a
private etcd with both turned on.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pyetcd.etcdrpc as etcdrpc
from pyetcd.etcdrpc import auth_pb2

from astate_store.errors import CatalogRejected
from astate_store.etcd.client import EtcdClient, range_end
from astate_store.etcd.config import EtcdConfig, check_namespace

__all__ = ["CertPaths", "make_test_certs", "enable_auth", "grant_namespace", "namespace_role", "ROOT_USER"]

ROOT_USER = "root"
_NO_CRYPTOGRAPHY = (
    "test certificates need the 'cryptography' package, which is in astate-store's test extra: "
    "pip install 'astate-store[test]' (or pip install cryptography)"
)
# What a consumer writes (catalog/readers.py, catalog/consumers.py): a read-only user may write these.
_CONSUMER_WRITES = ("readers/", "delivered/", "consumers/")


@dataclass(frozen=True)
class CertPaths:
    """PEM files written by :func:`make_test_certs`.

    ``ca``: the CA certificate clients trust (``etcd_ca`` / ``ASTATE_ETCD_CA``); ``server_cert`` /
    ``server_key``: etcd's ``--cert-file`` / ``--key-file`` (SANs ``127.0.0.1``, ``localhost``);
    ``client_cert`` / ``client_key``: a client certificate (``etcd_cert`` / ``etcd_key``) for an
    etcd run with ``--client-cert-auth``.
    """

    directory: str
    ca: str
    ca_key: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _cert_name(cn: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "astate-store test"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _write_key(path: Path, key: Any) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: Any) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _make_ca(start: datetime.datetime, end: datetime.datetime) -> tuple[Any, Any, Any]:
    """A self-signed CA: returns (certificate, key, name)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _cert_name("astate-store test CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca, ca_key, ca_name


def _make_leaf(
    cn: str,
    usages: list[Any],
    sans: list[Any],
    *,
    ca_key: Any,
    ca_name: Any,
    start: datetime.datetime,
    end: datetime.datetime,
) -> tuple[Any, Any]:
    """A certificate for ``cn`` signed by the CA: returns (certificate, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    b = (
        x509.CertificateBuilder()
        .subject_name(_cert_name(cn))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(ca_key, hashes.SHA256()), key


def make_test_certs(
    directory: str | os.PathLike[str], *, days: int = 30, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
) -> CertPaths:
    """Write a fresh CA, a server certificate for ``hosts`` and a client certificate (ECDSA P-256)
    into ``directory`` (created, mode 0700; keys mode 0600).

    Raises:
        ModuleNotFoundError: ``cryptography`` (the ``test`` extra) is not installed.
    """
    try:
        from cryptography import x509
    except ImportError as exc:
        raise ModuleNotFoundError(_NO_CRYPTOGRAPHY, name="cryptography") from exc
    from cryptography.x509.oid import ExtendedKeyUsageOID

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca, ca_key, ca_name = _make_ca(start, end)
    signer = {"ca_key": ca_key, "ca_name": ca_name, "start": start, "end": end}

    sans: list[Any] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    # The server certificate also serves etcd's peer port, where a member is a client too.
    server, server_key = _make_leaf(
        "astate-etcd", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], sans, **signer
    )
    client, client_key = _make_leaf("astate-client", [ExtendedKeyUsageOID.CLIENT_AUTH], [], **signer)
    paths = CertPaths(
        str(d),
        str(d / "ca.pem"),
        str(d / "ca.key"),
        str(d / "server.pem"),
        str(d / "server.key"),
        str(d / "client.pem"),
        str(d / "client.key"),
    )
    _write_cert(Path(paths.ca), ca)
    _write_key(Path(paths.ca_key), ca_key)
    _write_cert(Path(paths.server_cert), server)
    _write_key(Path(paths.server_key), server_key)
    _write_cert(Path(paths.client_cert), client)
    _write_key(Path(paths.client_key), client_key)
    return paths


# ---- etcd's Auth API -------------------------------------------------------------------------


def namespace_role(namespace: str, *, read_only: bool = False) -> str:
    """The etcd role :func:`grant_namespace` uses for a namespace: ``astate-<ns>-readwrite`` / ``-read``."""
    return f"astate-{namespace}-{'read' if read_only else 'readwrite'}"


def _admin(config: EtcdConfig) -> EtcdClient:
    return EtcdClient(config, "_admin", lease_ttl=10.0, op_timeout=5.0, retry_deadline=15.0)


def _auth_rpc(c: EtcdClient, what: str, method: str, request: Any, *, ok_if: tuple[str, ...] = ()) -> Any:
    """One call of etcd's Auth service, with the client's retries, token and typed errors; an
    answer whose details contain one of ``ok_if`` (``"already exists"``) counts as done."""

    def go() -> Any:
        try:
            return getattr(c.raw.authstub, method)(request, c.op_timeout, metadata=c.raw.metadata)
        except grpc.RpcError as exc:
            details = (exc.details() or "") if callable(getattr(exc, "details", None)) else ""
            if any(word in details for word in ok_if):
                return None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # etcd said no (pyetcd would drop why)
                raise CatalogRejected(f"etcd at {c.endpoint} refused {what}: {details}") from exc
            c.raw._manage_grpc_errors(exc)  # marks a failed endpoint, re-raises

    return c.call(what, go)


def _with_admin(config: EtcdConfig, fn: Callable[[EtcdClient], Any]) -> Any:
    c = _admin(config)
    try:
        return fn(c)
    finally:
        c.close(revoke=False)


def enable_auth(admin_config: EtcdConfig, root_password: str) -> None:
    """Create etcd's ``root`` user (password ``root_password``; changed to it if root exists) and
    ``root`` role, and turn authentication on. Idempotent; once authentication is on,
    ``admin_config`` must carry root's credentials (``admin_config.with_credentials("root", pw)``).

    Raises:
        CatalogAuthError: ``admin_config`` lacks the credentials etcd now requires.
        CatalogUnavailable: etcd does not answer.
    """

    def go(c: EtcdClient) -> None:
        if (
            _auth_rpc(
                c,
                "add user root",
                "UserAdd",
                etcdrpc.AuthUserAddRequest(name=ROOT_USER, password=root_password),
                ok_if=("already exists",),
            )
            is None
        ):
            _auth_rpc(
                c,
                "set root's password",
                "UserChangePassword",
                etcdrpc.AuthUserChangePasswordRequest(name=ROOT_USER, password=root_password),
            )
        _auth_rpc(
            c,
            "add role root",
            "RoleAdd",
            etcdrpc.AuthRoleAddRequest(name=ROOT_USER),
            ok_if=("already exists",),
        )
        _auth_rpc(
            c,
            "grant role root to root",
            "UserGrantRole",
            etcdrpc.AuthUserGrantRoleRequest(user=ROOT_USER, role=ROOT_USER),
        )
        _auth_rpc(c, "enable authentication", "AuthEnable", etcdrpc.AuthEnableRequest())

    _with_admin(admin_config, go)


def _grant_role(c: EtcdClient, role: str, perms: list[tuple[Any, str]]) -> None:
    """Create ``role`` (if missing) and grant it each (permission type, key prefix) of ``perms``."""
    _auth_rpc(
        c, f"add role {role}", "RoleAdd", etcdrpc.AuthRoleAddRequest(name=role), ok_if=("already exists",)
    )
    for kind, key in perms:
        perm = auth_pb2.Permission(permType=kind, key=key.encode(), range_end=range_end(key))
        _auth_rpc(
            c,
            f"grant {key} to role {role}",
            "RoleGrantPermission",
            etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm),
        )


def _set_user_role(c: EtcdClient, user: str, password: str, role: str, other: str) -> None:
    """Create ``user`` (or set its password), grant it ``role`` and revoke ``other``."""
    if (
        _auth_rpc(
            c,
            f"add user {user}",
            "UserAdd",
            etcdrpc.AuthUserAddRequest(name=user, password=password),
            ok_if=("already exists",),
        )
        is None
    ):
        _auth_rpc(
            c,
            f"set {user}'s password",
            "UserChangePassword",
            etcdrpc.AuthUserChangePasswordRequest(name=user, password=password),
        )
    _auth_rpc(
        c,
        f"grant role {role} to {user}",
        "UserGrantRole",
        etcdrpc.AuthUserGrantRoleRequest(user=user, role=role),
    )
    _auth_rpc(
        c,
        f"revoke role {other} from {user}",
        "UserRevokeRole",
        etcdrpc.AuthUserRevokeRoleRequest(name=user, role=other),
        ok_if=("not granted", "not found"),
    )


def grant_namespace(
    admin_config: EtcdConfig, namespace: str, user: str, password: str, *, read_only: bool = False
) -> str:
    """Give ``user`` (created if missing; its password set to ``password``) access to one
    namespace's keys, ``/astate/<namespace>/``, and nothing else:

    - read-write (default): everything a publisher or consumer does (``put``, ``recover``,
      ``checkpoint``, ``get_into``, ``serve``).
    - ``read_only=True``: a consumer that cannot publish: it reads every key of the namespace and
      writes only its own reader bookkeeping (``readers/``, ``delivered/``, ``consumers/``, which
      ``get_into`` needs for the retire protocol and pre-pack requests); ``put``, ``recover``, a
      checkpoint's commit and ``serve`` raise :class:`~astate_store.errors.CatalogAuthError`.

    The other level's role of that namespace is revoked from the user, so a call sets the level;
    roles of other namespaces are kept. Idempotent.

    ``admin_config``: an etcd config with root's credentials (or any user with the root role).
    Returns the role name (:func:`namespace_role`).

    Raises:
        CatalogError: a bad namespace.
        CatalogAuthError: ``admin_config`` is not allowed to manage users and roles.
    """
    from astate_store.errors import CatalogError

    check_namespace(namespace)
    if not user or not password:
        raise CatalogError("grant_namespace needs a user name and a password")
    role = namespace_role(namespace, read_only=read_only)
    other = namespace_role(namespace, read_only=not read_only)
    prefix = f"/astate/{namespace}/"
    if read_only:
        perms = [(auth_pb2.Permission.READ, prefix)] + [
            (auth_pb2.Permission.READWRITE, prefix + sub) for sub in _CONSUMER_WRITES
        ]
    else:
        perms = [(auth_pb2.Permission.READWRITE, prefix)]

    def go(c: EtcdClient) -> None:
        _grant_role(c, role, perms)
        _set_user_role(c, user, password, role, other)

    _with_admin(admin_config, go)
    return role

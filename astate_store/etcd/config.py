"""How to reach etcd: endpoints, TLS, credentials — one frozen value carried
``connect -> Store -> Catalog -> EtcdClient``.

Endpoints are ``host:port``, ``https://host:port`` or ``http://host:port``, comma-separated or a list.
``https://`` or a CA file turns TLS on; ``http://`` is always plain. From the environment
(:meth:`EtcdConfig.from_env`), or from explicit arguments with the environment filling in what they
leave out (:meth:`EtcdConfig.from_args`: an explicit argument always wins):

==================  =======================  ===============================================
argument            environment              meaning
==================  =======================  ===============================================
``etcd``            ``ASTATE_ETCD``          endpoints
``etcd_ca``         ``ASTATE_ETCD_CA``       CA certificate (PEM) that signed etcd's server certificate
``etcd_cert``       ``ASTATE_ETCD_CERT``     client certificate (PEM), for etcd's ``--client-cert-auth``
``etcd_key``        ``ASTATE_ETCD_KEY``      its private key (PEM)
``etcd_user``       ``ASTATE_ETCD_USER``     etcd user (token authentication)
``etcd_password``   ``ASTATE_ETCD_PASSWORD`` its password
==================  =======================  ===============================================
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from astate_store.errors import CatalogError

__all__ = [
    "EtcdConfig",
    "ENV_ENDPOINT",
    "ENV_CA",
    "ENV_CERT",
    "ENV_KEY",
    "ENV_USER",
    "ENV_PASSWORD",
    "check_namespace",
]

# A namespace is one etcd key segment: every key of it lives under ``/astate/<namespace>/``.
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$").match  # the catalog's rule, as it was


def check_namespace(namespace: object) -> str:
    """``namespace`` when it is a valid namespace name.

    Raises:
        CatalogError: not a str of 1-128 characters from ``[A-Za-z0-9_.-]``.
    """
    if not isinstance(namespace, str) or not _NAMESPACE(namespace):
        raise CatalogError(f"bad namespace {namespace!r}: use 1-128 characters from [A-Za-z0-9_.-]")
    return namespace


ENV_ENDPOINT = "ASTATE_ETCD"
ENV_CA = "ASTATE_ETCD_CA"
ENV_CERT = "ASTATE_ETCD_CERT"
ENV_KEY = "ASTATE_ETCD_KEY"
ENV_USER = "ASTATE_ETCD_USER"
ENV_PASSWORD = "ASTATE_ETCD_PASSWORD"

#: option name -> environment variable (for messages that say what to check)
OPTION_ENV = {
    "etcd": ENV_ENDPOINT,
    "etcd_ca": ENV_CA,
    "etcd_cert": ENV_CERT,
    "etcd_key": ENV_KEY,
    "etcd_user": ENV_USER,
    "etcd_password": ENV_PASSWORD,
}


def option(name: str) -> str:
    """``etcd_ca`` -> ``"etcd_ca (ASTATE_ETCD_CA)"``: how messages name an option."""
    return f"{name} ({OPTION_ENV[name]})"


def _split(etcd: str | Iterable[str]) -> list[str]:
    items = [etcd] if isinstance(etcd, str) else list(etcd)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise CatalogError(f"bad etcd endpoint {item!r}: expected 'host:port' or 'https://host:port'")
        out += [i.strip() for i in item.split(",") if i.strip()]
    return out


def _parse(etcd: str | Iterable[str]) -> tuple[tuple[str, ...], bool | None]:
    """(``host:port`` endpoints, True/False when every endpoint named https/http, None when none did)."""
    hosts: list[str] = []
    schemes: set[str | None] = set()
    for item in _split(etcd):
        scheme, sep, rest = item.partition("://")
        if not sep:
            scheme, rest = None, item  # type: ignore[assignment]
        elif scheme.lower() not in ("http", "https"):
            raise CatalogError(f"bad etcd endpoint {item!r}: the scheme must be http:// or https://")
        rest = rest.rstrip("/")
        host, colon, port = rest.rpartition(":")
        if not colon or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
            raise CatalogError(f"bad etcd endpoint {item!r}: expected host:port, e.g. 127.0.0.1:2379")
        hosts.append(f"{host or '127.0.0.1'}:{int(port)}")
        schemes.add(scheme.lower() if scheme else None)
    if not hosts:
        raise CatalogError("no etcd endpoint given")
    named = schemes - {None}
    if len(named) > 1:
        raise CatalogError(f"etcd endpoints mix http:// and https://: {etcd!r}")
    return tuple(hosts), (next(iter(named)) == "https") if named else None


@dataclass(frozen=True)
class EtcdConfig:
    """Endpoints, TLS and credentials of one etcd (cluster).

    Attributes:
        endpoints: ``host:port`` of each member.
        tls: whether to speak TLS (``https://`` or a CA given, unless ``http://``).
        ca, cert, key: PEM file paths (CA to trust; client certificate and key).
        user, password: etcd user for token authentication (the password is never printed).
    """

    endpoints: tuple[str, ...]
    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise CatalogError("no etcd endpoint given")
        if (self.cert is None) != (self.key is None):
            missing = "etcd_key" if self.key is None else "etcd_cert"
            raise CatalogError(
                f"a client certificate needs both etcd_cert and etcd_key: set {option(missing)}"
            )
        if self.cert is not None and not self.tls:
            raise CatalogError(
                "etcd_cert/etcd_key given but TLS is off: use an https:// endpoint or set "
                f"{option('etcd_ca')}"
            )
        if (self.user is None) != (self.password is None):
            missing = "etcd_password" if self.password is None else "etcd_user"
            raise CatalogError(
                f"etcd authentication needs both etcd_user and etcd_password: set {option(missing)}"
            )
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise CatalogError(f"{option('etcd_' + name)} = {path!r}: no such file")

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def parse(cls, etcd: str | Iterable[str] | EtcdConfig, **security: Any) -> EtcdConfig:
        """From endpoints alone (plus the keyword fields given), no environment: what
        ``Store(endpoint=...)`` and ``Catalog(endpoint, ...)`` do with a string."""
        if isinstance(etcd, EtcdConfig):
            return dataclasses.replace(etcd, **security) if security else etcd
        endpoints, https = _parse(etcd)
        ca = security.get("ca")
        tls = https if https is not None else ca is not None
        return cls(endpoints, tls=tls, **security)

    @classmethod
    def from_args(
        cls,
        etcd: str | Iterable[str] | EtcdConfig | None = None,
        *,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        env: Mapping[str, str] | None = None,
        default_endpoint: Any = None,
    ) -> EtcdConfig:
        """Explicit arguments, each falling back to its environment variable when None.

        Args:
            default_endpoint: called (no arguments) for the endpoint when neither ``etcd`` nor
                ``ASTATE_ETCD`` gives one (``connect`` passes the shared embedded etcd's).

        Raises:
            CatalogError: no endpoint, a malformed one, half a credential, a missing file.
        """
        e = os.environ if env is None else env
        if isinstance(etcd, EtcdConfig):
            base = etcd
            over = {
                k: v
                for k, v in dict(ca=ca, cert=cert, key=key, user=user, password=password).items()
                if v is not None
            }
            if "ca" in over and not base.tls:
                over["tls"] = True
            return dataclasses.replace(base, **over) if over else base

        def pick(value: str | None, var: str) -> str | None:
            if value is not None:
                return str(value)
            got = e.get(var)
            return got if got else None

        target: Any = etcd if etcd is not None else (e.get(ENV_ENDPOINT) or None)
        if target is None:
            if default_endpoint is None:
                raise CatalogError(f"no etcd endpoint: pass etcd= or set {ENV_ENDPOINT}")
            target = default_endpoint()
        return cls.parse(
            target,
            ca=pick(ca, ENV_CA),
            cert=pick(cert, ENV_CERT),
            key=pick(key, ENV_KEY),
            user=pick(user, ENV_USER),
            password=pick(password, ENV_PASSWORD),
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, default_endpoint: Any = None) -> EtcdConfig:
        """Everything from ``ASTATE_ETCD``, ``ASTATE_ETCD_CA``, ``_CERT``, ``_KEY``, ``_USER``,
        ``_PASSWORD``."""
        return cls.from_args(None, env=env, default_endpoint=default_endpoint)

    def with_credentials(self, user: str | None, password: str | None) -> EtcdConfig:
        """The same etcd, another user (None, None: no authentication)."""
        return dataclasses.replace(self, user=user, password=password)

    # ---- how it is shown ----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``host:port[,host:port]`` (no scheme)."""
        return ",".join(self.endpoints)

    @property
    def url(self) -> str:
        """The endpoints as messages show them: ``https://`` prefixed when TLS is on."""
        return ",".join(f"https://{h}" for h in self.endpoints) if self.tls else self.endpoint

    def describe(self) -> str:
        """Endpoints and the security settings in use (no password)."""
        bits = ["TLS" if self.tls else "plain"]
        if self.tls:
            bits.append(f"CA {self.ca}" if self.ca else "system CAs")
        if self.cert:
            bits.append(f"client cert {self.cert}")
        bits.append(f"user {self.user!r}" if self.user else "no user")
        return f"{self.url} ({', '.join(bits)})"

    def channel_credentials(self) -> Any:
        """gRPC channel credentials for TLS (the CA, else the system's roots; the client certificate)."""
        import grpc

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))

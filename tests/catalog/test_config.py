"""How to reach etcd (etcd/config.py): endpoint parsing, the environment, and typed errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from astate_store.errors import CatalogError
from astate_store.etcd.config import EtcdConfig


@pytest.fixture
def pem(tmp_path: Path) -> dict[str, str]:
    """Three PEM paths that exist (the config checks files exist; it never parses them)."""
    out = {}
    for name in ("ca", "cert", "key"):
        p = tmp_path / f"{name}.pem"
        p.write_text("-----BEGIN CERTIFICATE-----\n")
        out[name] = str(p)
    return out


@pytest.mark.parametrize(
    ("given", "endpoints", "tls"),
    [
        ("127.0.0.1:2379", ("127.0.0.1:2379",), False),
        (":2379", ("127.0.0.1:2379",), False),
        ("http://10.0.0.1:2379/", ("10.0.0.1:2379",), False),
        ("HTTPS://etcd.example:443", ("etcd.example:443",), True),
        ("a:1, b:2,,c:3", ("a:1", "b:2", "c:3"), False),
        (["https://a:1", "https://b:2,https://c:3"], ("a:1", "b:2", "c:3"), True),
        ("[::1]:2379", ("[::1]:2379",), False),
        ("a:007", ("a:7",), False),
    ],
)
def test_endpoints_parse(given: object, endpoints: tuple[str, ...], tls: bool) -> None:
    cfg = EtcdConfig.parse(given)  # type: ignore[arg-type]
    assert cfg.endpoints == endpoints and cfg.tls is tls
    assert cfg.endpoint == ",".join(endpoints)
    assert cfg.url == (",".join("https://" + e for e in endpoints) if tls else cfg.endpoint)


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("", "no etcd endpoint given"),
        (" , ", "no etcd endpoint given"),
        ([], "no etcd endpoint given"),
        ("localhost", "expected host:port"),
        ("a:0", "expected host:port"),
        ("a:65536", "expected host:port"),
        ("a:x", "expected host:port"),
        ("a:1/v3", "expected host:port"),
        ("grpc://a:1", "scheme must be http:// or https://"),
        ("http://a:1,https://b:2", "mix http:// and https://"),
        ([7], "bad etcd endpoint 7"),
    ],
)
def test_bad_endpoints_are_typed_errors_naming_them(given: object, why: str) -> None:
    with pytest.raises(CatalogError, match=why.replace("(", r"\(")):
        EtcdConfig.parse(given)  # type: ignore[arg-type]


def test_a_ca_turns_tls_on_unless_the_endpoint_says_http(pem: dict[str, str]) -> None:
    assert EtcdConfig.parse("a:1", ca=pem["ca"]).tls is True
    assert EtcdConfig.parse("http://a:1", ca=pem["ca"]).tls is False
    assert EtcdConfig.parse("https://a:1").tls is True and EtcdConfig.parse("https://a:1").ca is None


def test_half_credentials_and_missing_files_name_the_option_to_set(
    pem: dict[str, str], tmp_path: Path
) -> None:
    with pytest.raises(CatalogError, match=r"set etcd_key \(ASTATE_ETCD_KEY\)"):
        EtcdConfig.parse("https://a:1", cert=pem["cert"])
    with pytest.raises(CatalogError, match=r"set etcd_cert \(ASTATE_ETCD_CERT\)"):
        EtcdConfig.parse("https://a:1", key=pem["key"])
    with pytest.raises(CatalogError, match="TLS is off"):
        EtcdConfig.parse("a:1", cert=pem["cert"], key=pem["key"])
    with pytest.raises(CatalogError, match=r"set etcd_password \(ASTATE_ETCD_PASSWORD\)"):
        EtcdConfig.parse("a:1", user="u")
    with pytest.raises(CatalogError, match=r"set etcd_user \(ASTATE_ETCD_USER\)"):
        EtcdConfig.parse("a:1", password="p")
    gone = str(tmp_path / "nope.pem")
    with pytest.raises(CatalogError, match=r"etcd_ca \(ASTATE_ETCD_CA\) = .*nope.pem.*: no such file"):
        EtcdConfig.parse("a:1", ca=gone)
    with pytest.raises(CatalogError, match="no etcd endpoint given"):
        EtcdConfig(())
    ok = EtcdConfig.parse(
        "https://a:1", ca=pem["ca"], cert=pem["cert"], key=pem["key"], user="u", password="p"
    )
    assert (ok.tls, ok.ca, ok.cert, ok.key, ok.user, ok.password) == (
        True,
        pem["ca"],
        pem["cert"],
        pem["key"],
        "u",
        "p",
    )


def test_everything_from_the_environment(pem: dict[str, str]) -> None:
    env = {
        "ASTATE_ETCD": "e1:1,e2:2",
        "ASTATE_ETCD_CA": pem["ca"],
        "ASTATE_ETCD_CERT": pem["cert"],
        "ASTATE_ETCD_KEY": pem["key"],
        "ASTATE_ETCD_USER": "alice",
        "ASTATE_ETCD_PASSWORD": "s3cret",
    }
    cfg = EtcdConfig.from_env(env)
    assert cfg == EtcdConfig(
        ("e1:1", "e2:2"),
        tls=True,
        ca=pem["ca"],
        cert=pem["cert"],
        key=pem["key"],
        user="alice",
        password="s3cret",
    )
    # The password is never shown.
    assert "s3cret" not in repr(cfg) and "s3cret" not in cfg.describe()
    assert cfg.describe() == (
        f"https://e1:1,https://e2:2 (TLS, CA {pem['ca']}, client cert {pem['cert']}, user 'alice')"
    )


def test_explicit_arguments_win_over_the_environment(pem: dict[str, str]) -> None:
    env = {"ASTATE_ETCD": "env:1", "ASTATE_ETCD_USER": "env-user", "ASTATE_ETCD_PASSWORD": "env-pw"}
    cfg = EtcdConfig.from_args("arg:2", user="arg-user", password="arg-pw", env=env)
    assert (cfg.endpoints, cfg.user, cfg.password) == (("arg:2",), "arg-user", "arg-pw")
    # What the arguments leave out comes from the environment.
    cfg = EtcdConfig.from_args("arg:2", env=env)
    assert (cfg.endpoints, cfg.user, cfg.password, cfg.tls) == (("arg:2",), "env-user", "env-pw", False)
    # An empty variable counts as unset.
    cfg = EtcdConfig.from_args(None, env={"ASTATE_ETCD": "e:1", "ASTATE_ETCD_CA": ""})
    assert (cfg.ca, cfg.tls) == (None, False)
    assert cfg.describe() == "e:1 (plain, no user)"


def test_the_endpoint_comes_from_the_default_only_when_nothing_names_one() -> None:
    with pytest.raises(CatalogError, match="no etcd endpoint: pass etcd= or set ASTATE_ETCD"):
        EtcdConfig.from_env({})
    calls: list[int] = []

    def default() -> str:
        calls.append(1)
        return "127.0.0.1:4001"

    assert EtcdConfig.from_env({}, default_endpoint=default).endpoints == ("127.0.0.1:4001",)
    assert EtcdConfig.from_env({"ASTATE_ETCD": "x:1"}, default_endpoint=default).endpoints == ("x:1",)
    assert calls == [1]


def test_a_config_given_whole_is_kept_and_amended(pem: dict[str, str]) -> None:
    base = EtcdConfig.parse("a:1")
    assert EtcdConfig.parse(base) is base
    assert (
        EtcdConfig.from_args(base, env={"ASTATE_ETCD_USER": "ignored", "ASTATE_ETCD_PASSWORD": "x"}) is base
    )
    tls = EtcdConfig.from_args(base, ca=pem["ca"])
    assert (tls.endpoints, tls.tls, tls.ca) == (("a:1",), True, pem["ca"])
    assert EtcdConfig.parse(base, user="u", password="p").user == "u"
    other = tls.with_credentials("bob", "pw")
    assert (other.user, other.password, other.ca) == ("bob", "pw", pem["ca"])
    assert other.with_credentials(None, None).user is None
    with pytest.raises(CatalogError, match="etcd_password"):
        base.with_credentials("bob", None)

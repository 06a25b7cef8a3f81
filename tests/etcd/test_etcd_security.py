"""etcd with TLS and authentication, for real: an etcd this module starts on 127.0.0.1 (free ports)
with certificates from ``make_test_certs`` and authentication on, namespace-scoped users from
``grant_namespace``; and the embedded etcd's rendezvous dir checks.

Auth tokens of that etcd expire after 2 idle seconds (etcd's default is 5 min), so the tests also
run across token expiry. Bad settings must raise ``CatalogAuthError`` at once: the catalogs get a
600 s retry budget, and the tests count the requests made (a retry loop would make many).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import astate_store
from astate_store import Shard, Store
from astate_store.catalog import Catalog
from astate_store.errors import CatalogAuthError, CatalogError, UnsafeRendezvousError
from astate_store.etcd.config import EtcdConfig
from astate_store.etcd.embedded import EmbeddedEtcd
from astate_store.etcd.security import CertPaths, grant_namespace, make_test_certs, namespace_role
from astate_store.etcd.supervisor import _home
from astate_store.etcd.tls_probe import probe_tls as _probe_tls

TOKEN_TTL = 2  # seconds an idle auth token stays valid on the test etcd
BUDGET = 600.0  # retry budget of the catalogs that must fail at once


@dataclasses.dataclass
class Secure:
    server: EmbeddedEtcd
    certs: CertPaths
    other: CertPaths  # a second CA etcd does not know

    def user(self, ns: str, *, read_only: bool = False) -> EtcdConfig:
        """A fresh user holding only ``ns``'s role (read-write or read-only)."""
        name, pw = f"u-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        grant_namespace(self.server.admin_config(), ns, name, pw, read_only=read_only)
        return self.server.config(name, pw)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    base = tmp_path_factory.mktemp("certs")
    certs, other = make_test_certs(base / "ca"), make_test_certs(base / "other")
    server = EmbeddedEtcd(tls=certs, auth=True, extra_args=["--auth-token-ttl", str(TOKEN_TTL)]).start()
    try:
        yield Secure(server, certs, other)
    finally:
        server.stop()


def _ns() -> str:
    return "sec-" + uuid.uuid4().hex[:10]


def _fails_at_once(config: EtcdConfig, ns: str, match: str) -> str:
    """A catalog with ``config`` raises CatalogAuthError matching ``match`` on its first request,
    after at most two attempts (one more after replacing a rejected token), whatever the budget."""
    cat = Catalog(config, ns, retry_deadline=BUDGET)
    try:
        with pytest.raises(CatalogAuthError, match=match) as info:
            cat.versions.latest()
        assert cat.client.rpcs <= 2, cat.client.rpcs
    finally:
        cat.close(revoke=False)
    return str(info.value)


def test_round_trip_checkpoint_and_recover_over_tls_with_a_namespace_user(
    secure: Secure, tmp_path: Path
) -> None:
    ns = _ns()
    config = secure.user(ns)
    assert (
        config.tls
        and config.endpoint.startswith("127.0.0.1:")
        and secure.server.endpoint.startswith("https://")
    )
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    norm = torch.linspace(0, 1, 32)
    with Store(ns, etcd=config, transport="shm") as pub, Store(ns, etcd=config, transport="shm") as cons:
        assert pub.put(1, {"w": w, "norm": norm})
        top, all_norm = torch.zeros(32, 32), torch.zeros(32)
        assert cons.get_into({"w": Shard(top, (0, 0), (64, 32)), "norm": all_norm}, timeout=30) == 1
        assert torch.equal(top, w[:32]) and torch.equal(all_norm, norm)
        assert pub.checkpoint(1, str(tmp_path / "ckpt")) is True
        time.sleep(TOKEN_TTL + 1)  # idle past the token's life: every client must get a fresh one
        assert pub.put(2, {"w": w + 1, "norm": norm + 1})
        full = torch.zeros(64, 32)
        assert cons.get_into({"w": full}, step=2, timeout=30) == 2 and torch.equal(full, w + 1)
        assert pub.catalog.client.authentications >= 2 and cons.catalog.client.authentications >= 2
    # A restarted trainer, same user: fences the old session and recovers (nothing live: the checkpoint).
    with (
        Store(ns, etcd=config, transport="shm", session_id="restarted") as pub2,
        Store(ns, etcd=config, transport="shm") as cons2,
    ):
        back = {"w": torch.zeros(64, 32), "norm": torch.zeros(32)}
        assert pub2.recover(back, timeout=30) == 1  # restored; older than latest (2), so not republished
        assert torch.equal(back["w"], w) and torch.equal(back["norm"], norm) and pub2.latest() == 2
        assert pub2.put(3, {"w": w + 3, "norm": norm})
        full = torch.zeros(64, 32)
        assert cons2.get_into({"w": full}, step=3, timeout=30) == 3 and torch.equal(full, w + 3)
        assert [c.step for c in pub2.catalog.checkpoints.list()] == [1]


def test_an_expired_token_is_replaced_for_requests_watches_and_lease_revokes(secure: Secure) -> None:
    ns = _ns()
    user = secure.user(ns)
    cat, holder = Catalog(user, ns, retry_deadline=BUDGET), Catalog(user, ns, retry_deadline=BUDGET)
    try:
        assert cat.versions.latest() is None and cat.client.authentications == 1
        key = cat.client.key("latest")
        cat.client.wait_change(key, 0.05)  # opens a watch stream carrying the first token
        held = holder.client.key("held")
        lease = holder.client.new_lease()
        holder.client.call("put held", lambda: holder.client.raw.put(held, b"x", lease=lease))
        time.sleep(TOKEN_TTL + 1)  # both tokens expire
        # etcd refuses a new watch on that stream now: a fresh token, a new stream
        cat.client.wait_change(key, 0.05)
        assert cat.client.authentications == 2
        # closing revokes the lease (with a fresh token): its key is gone at once, not after lease_ttl
        holder.close()
        assert holder.client.authentications == 2
        assert cat.client.call("get held", lambda: cat.client.raw.get(held))[0] is None
        assert cat.client.new_lease() and cat.versions.latest() is None
    finally:
        cat.close()
        holder.close()


@pytest.mark.parametrize(
    "case",
    ["wrong password", "no credentials", "user of another namespace", "http://", "no CA", "another CA"],
)
def test_bad_settings_raise_a_typed_error_naming_the_problem_at_once(secure: Secure, case: str) -> None:
    ns = _ns()
    good = secure.user(ns)
    config, match = {
        "wrong password": (
            dataclasses.replace(good, password="not-it"),
            "refused to authenticate user .*etcd_password",
        ),
        "no credentials": (
            good.with_credentials(None, None),
            "requires authentication.*no credentials.*ASTATE_ETCD_USER",
        ),
        "user of another namespace": (
            secure.user(_ns()),
            f"denied get latest to user .*/astate/{ns}/.*grant_namespace",
        ),
        "http://": (
            EtcdConfig.parse("http://" + good.endpoint, user=good.user, password=good.password),
            "speaks TLS.*plain text.*use https://.*ASTATE_ETCD_CA",
        ),
        "no CA": (dataclasses.replace(good, ca=None), "does not trust.*system's CAs.*ASTATE_ETCD_CA"),
        "another CA": (
            dataclasses.replace(good, ca=secure.other.ca),
            f"does not trust.*{re.escape(secure.other.ca)}",
        ),
    }[case]
    _fails_at_once(config, ns, match)


def test_https_to_a_plain_etcd_is_a_typed_error(etcd: EmbeddedEtcd, secure: Secure) -> None:
    config = EtcdConfig.parse("https://" + etcd.endpoint, ca=secure.certs.ca)
    _fails_at_once(config, _ns(), "does not speak TLS.*use http://")


def test_probing_a_plain_etcd_with_tls_names_the_scheme_every_time(etcd: EmbeddedEtcd) -> None:
    # A plain etcd answers a ClientHello by closing the connection: mostly an EOF inside the
    # handshake, sometimes a reset. Both must be read as "plain port", not as "cannot tell".
    config = EtcdConfig.parse("https://" + etcd.endpoint)
    for _ in range(60):
        answer = _probe_tls(config, etcd.endpoint)
        assert answer is not None and re.search("does not speak TLS.*use http://", answer), answer


def test_client_certificates_when_etcd_requires_them(secure: Secure) -> None:
    with EmbeddedEtcd(tls=secure.certs, client_cert_auth=True) as server:
        good = server.config()
        assert good.cert == secure.certs.client_cert
        cat = Catalog(good, "certs", retry_deadline=BUDGET)
        assert cat.versions.latest() is None
        cat.close()
        _fails_at_once(
            dataclasses.replace(good, cert=None, key=None),
            "certs",
            "requires a client certificate.*ASTATE_ETCD_CERT",
        )
        _fails_at_once(
            dataclasses.replace(good, cert=secure.other.client_cert, key=secure.other.client_key),
            "certs",
            "client certificate signed by a CA it trusts",
        )


def test_a_read_only_user_pulls_but_cannot_publish(secure: Secure) -> None:
    ns = _ns()
    w = torch.randn(128)
    ro = secure.user(ns, read_only=True)
    with Store(ns, etcd=secure.user(ns), transport="shm") as pub, Store(ns, etcd=ro, transport="shm") as cons:
        pub.put(1, {"w": w})
        got = torch.zeros(128)
        assert cons.latest() == 1
        assert cons.get_into({"w": got}, timeout=30) == 1 and torch.equal(got, w)
        with pytest.raises(CatalogAuthError, match=f"denied open session to user '{ro.user}'.*/astate/{ns}/"):
            cons.put(2, {"w": w})
        assert pub.latest() == 1
    # Granting read-write now replaces the read-only role (a call sets the level).
    grant_namespace(secure.server.admin_config(), ns, str(ro.user), str(ro.password))
    with Store(ns, etcd=ro, transport="shm", session_id="now-rw") as pub2:
        assert pub2.put(2, {"w": w})
    assert namespace_role(ns, read_only=True).endswith("-read")


def test_the_environment_configures_connect_and_explicit_arguments_win(
    secure: Secure, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = _ns()
    user = secure.user(ns)
    monkeypatch.setenv("ASTATE_ETCD", secure.server.endpoint)
    monkeypatch.setenv("ASTATE_ETCD_CA", secure.certs.ca)
    monkeypatch.setenv("ASTATE_ETCD_USER", str(user.user))
    monkeypatch.setenv("ASTATE_ETCD_PASSWORD", str(user.password))
    assert EtcdConfig.from_env() == user
    w = torch.randn(16)
    with astate_store.connect(ns, transport="shm") as store:
        assert store.catalog.etcd == user and store.put(1, {"w": w})
        got = torch.zeros(16)
        assert store.get_into({"w": got}, timeout=30) == 1 and torch.equal(got, w)
    with astate_store.connect(ns, etcd_password="explicitly-wrong", transport="shm") as store:
        with pytest.raises(CatalogAuthError, match="refused to authenticate"):
            store.latest()
    monkeypatch.delenv("ASTATE_ETCD_PASSWORD")
    with pytest.raises(CatalogError, match="needs both etcd_user and etcd_password.*ASTATE_ETCD_PASSWORD"):
        astate_store.connect(ns)


# ---- the embedded etcd's rendezvous dir --------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``ASTATE_HOME`` for the embedded etcd, no ``ASTATE_ETCD``: ``connect`` uses the shared one."""
    h = tmp_path / "home"
    monkeypatch.setenv("ASTATE_HOME", str(h))
    monkeypatch.delenv("ASTATE_ETCD", raising=False)
    return h


def test_the_rendezvous_dir_is_created_private(home: Path) -> None:
    assert _home() == home.resolve()
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700


def test_a_world_writable_rendezvous_dir_is_refused(home: Path) -> None:
    home.mkdir()
    home.chmod(0o777)
    with pytest.raises(
        UnsafeRendezvousError, match=f"{re.escape(str(home))}.*writable by group or others.*chmod 700"
    ):
        astate_store.connect("refused")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_rendezvous_dir_of_another_user_is_refused(home: Path) -> None:
    home.mkdir(mode=0o700)
    os.chown(home, 65534, 65534)
    with pytest.raises(
        UnsafeRendezvousError, match=f"{re.escape(str(home))} is owned by uid 65534.*ASTATE_HOME"
    ):
        astate_store.connect("refused")


def test_a_rendezvous_file_others_could_write_is_not_trusted(home: Path) -> None:
    _home()
    f = home / "embedded-etcd.json"
    f.write_text(json.dumps({"endpoint": "127.0.0.1:1", "pid": 1, "supervisor": 1}))
    f.chmod(0o666)
    with pytest.raises(UnsafeRendezvousError, match=f"rendezvous file {re.escape(str(f))}.*mode 0666.*rm "):
        astate_store.connect("refused")
    if os.getuid() == 0:
        f.chmod(0o600)
        os.chown(f, 65534, 65534)
        with pytest.raises(UnsafeRendezvousError, match="owner uid 65534"):
            astate_store.connect("refused")


def test_config_parsing() -> None:
    c = EtcdConfig.parse("https://h1:1, h2:2")
    assert c.endpoints == ("h1:1", "h2:2") and c.tls and c.url == "https://h1:1,https://h2:2"
    assert not EtcdConfig.parse(["http://h:1"], ca=None).tls and not EtcdConfig.parse("h:1").tls
    assert "secret" not in repr(EtcdConfig.parse("h:1", user="u", password="secret"))
    for bad, match in [
        ("https://a:1,http://b:2", "mix"),
        ("ftp://a:1", "scheme"),
        ("a", "host:port"),
        ("", "no etcd"),
    ]:
        with pytest.raises(CatalogError, match=match):
            EtcdConfig.parse(bad)
    with pytest.raises(CatalogError, match="no such file"):
        EtcdConfig.parse("h:1", ca="/nonexistent/ca.pem")
    env: dict[str, Any] = {"ASTATE_ETCD": "h:1", "ASTATE_ETCD_USER": "env-user", "ASTATE_ETCD_PASSWORD": "p"}
    assert EtcdConfig.from_args(None, user="arg-user", env=env).user == "arg-user"
    assert EtcdConfig.from_args("other:2", env=env).endpoints == ("other:2",)
    assert EtcdConfig.from_env(env).user == "env-user"

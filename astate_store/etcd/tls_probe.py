"""Telling a TLS mismatch from an etcd that does not answer: one bounded, direct probe.

gRPC reports both as UNAVAILABLE. :func:`probe_tls` opens one TCP connection and tries one TLS
handshake (3 s bounds each) to say which TLS setting is wrong, in words an operator can act on.
"""

from __future__ import annotations

import socket
import ssl
import time

import grpc

from astate_store.etcd.config import EtcdConfig, option
from astate_store.etcd.failures import grpc_status

__all__ = ["probe_tls", "tls_problem", "PROBE_INTERVAL", "HANDSHAKE_WORDS", "HANDSHAKE_TRIES"]


_PROBE_TIMEOUT = 3.0  # a busy etcd (or host) can take over a second to answer the probe's request
PROBE_INTERVAL = 0.5  # at most one probe per endpoint per this many seconds
# gRPC's words for a failed TLS handshake (what the probe cannot explain is trusted after a few tries)
HANDSHAKE_WORDS = ("handshake", "ssl", "tls", "certificate")
HANDSHAKE_TRIES = 3


def _split_host(netloc: str) -> tuple[str, int]:
    host, _, port = netloc.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _speaks_plain_http(host: str, port: int) -> bool:
    """Whether ``host:port`` answers a plain HTTP/1.1 request (etcd's client port without TLS does)."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT) as s:
            s.settimeout(_PROBE_TIMEOUT)
            s.sendall(f"GET /version HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return s.recv(16).startswith(b"HTTP/1.")
    except OSError:
        return False


def _plain_port(netloc: str, reason: str) -> str:
    return (
        f"etcd at {netloc} does not speak TLS (its client port is plain http), but this client uses "
        f"TLS (an https:// endpoint or {option('etcd_ca')}): use http://{netloc}, or start etcd with "
        f"--cert-file/--key-file and https:// client URLs ({reason})"
    )


def probe_tls(config: EtcdConfig, netloc: str) -> str | None:
    """Why this client's TLS settings cannot talk to the etcd at ``netloc``, when a direct probe
    (one TCP connection, one TLS handshake, bounded by 3 s each) shows it; None when it cannot tell
    (nothing listens, no answer in time, or the handshake works)."""
    host, port = _split_host(netloc)
    try:
        raw = socket.create_connection((host, port), timeout=_PROBE_TIMEOUT)
    except OSError:
        return None  # nothing listens (yet): etcd is down, not misconfigured
    with raw:
        raw.settimeout(_PROBE_TIMEOUT)
        if not config.tls:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            try:
                with ctx.wrap_socket(raw, server_hostname=host):
                    pass
            except (OSError, ValueError):
                return None  # not TLS either: some other failure
            return (
                f"etcd at {netloc} speaks TLS, but this client connects in plain text (an http:// or "
                f"scheme-less endpoint and no CA): use https://{netloc} in {option('etcd')} and set "
                f"{option('etcd_ca')} to the CA that signed etcd's --cert-file"
            )
        try:
            ctx = ssl.create_default_context(cafile=config.ca)
            if config.cert and config.key:
                ctx.load_cert_chain(config.cert, config.key)
        except (OSError, ValueError) as exc:
            return (
                f"the TLS files do not load ({exc}): check {option('etcd_ca')}, {option('etcd_cert')} "
                f"and {option('etcd_key')} (PEM; the key must match the certificate)"
            )
        try:
            with ctx.wrap_socket(raw, server_hostname=host) as tls:
                # A server that requires a client certificate may say so only after the handshake
                # (TLS 1.3): send one small request and read the first bytes of the answer.
                tls.sendall(f"GET /version HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                tls.recv(16)
        except ssl.SSLCertVerificationError as exc:
            which = (
                f"{option('etcd_ca')} = {config.ca}"
                if config.ca
                else f"the system's CAs (no {option('etcd_ca')} given)"
            )
            return (
                f"etcd at https://{netloc} presents a certificate this client does not trust "
                f"({exc.verify_message}; checked against {which}): set {option('etcd_ca')} to the CA "
                "that signed etcd's --cert-file, and connect by a host name or address that certificate "
                "names"
            )
        except ssl.SSLError as exc:
            reason = str(getattr(exc, "reason", "") or exc)
            if "CERTIFICATE_REQUIRED" in reason or "BAD_CERTIFICATE" in reason or "UNKNOWN_CA" in reason:
                what = (
                    "a client certificate"
                    if not config.cert
                    else f"a client certificate signed by a CA it trusts (not {config.cert})"
                )
                return (
                    f"etcd at https://{netloc} requires {what} (it runs with --client-cert-auth): set "
                    f"{option('etcd_cert')} and {option('etcd_key')} ({reason})"
                )
            return _plain_port(netloc, reason) if _speaks_plain_http(host, port) else None
        except (OSError, ValueError) as exc:
            # A plain etcd may simply close the connection on a ClientHello (a reset, not an SSL
            # alert): it is still a plain port when it answers plain HTTP.
            if _speaks_plain_http(host, port):
                return _plain_port(netloc, repr(exc))
            return None  # reset or silent mid-handshake, and not plain http: cannot tell
    return None


def tls_problem(
    config: EtcdConfig, netloc: str, probed: dict[str, float], exc: BaseException, handshake_failures: int
) -> str | None:
    """Why ``config``'s TLS settings cannot talk to ``netloc``, which just failed, when it is a TLS
    mismatch (not etcd being down): probed directly (bounded; at most once per ``PROBE_INTERVAL``
    per endpoint, ``probed`` remembering when), or, when the probe cannot tell but gRPC keeps
    reporting a failed handshake, gRPC's own words."""
    code, details = grpc_status(exc)
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    now = time.monotonic()
    # The last try before gRPC's words probes again whatever the interval: the first probe may
    # have met a busy etcd.
    if now - probed.get(netloc, -1e9) >= PROBE_INTERVAL or handshake_failures >= HANDSHAKE_TRIES:
        probed[netloc] = now
        why = probe_tls(config, netloc)
        if why is not None:
            return f"{why} [gRPC: {details}]"
    if handshake_failures >= HANDSHAKE_TRIES:
        return (
            f"etcd at {netloc}: the TLS handshake keeps failing ({details}); check the endpoint's "
            f"scheme (http:// or https://) in {option('etcd')}, {option('etcd_ca')}, "
            f"{option('etcd_cert')} and {option('etcd_key')}"
        )
    return None

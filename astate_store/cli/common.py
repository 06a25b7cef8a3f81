"""What every ``astate`` command shares: etcdctl-style connection flags, typed errors turned into
one red line and an exit code, rich output and progress bars.

Connection flags (on the command or before it, ``astate --etcd EP ls`` or ``astate ls --etcd EP``;
the command's win) fall back to the ``ASTATE_ETCD*`` environment variables
(:class:`~astate_store.etcd.config.EtcdConfig`):

==============  =======================  ==========================================
flag            environment              meaning
==============  =======================  ==========================================
``--etcd``      ``ASTATE_ETCD``          endpoints, ``host:port`` or ``https://host:port``, comma-separated
``--cacert``    ``ASTATE_ETCD_CA``       CA certificate that signed etcd's (turns TLS on)
``--cert``      ``ASTATE_ETCD_CERT``     client certificate (etcd ``--client-cert-auth``)
``--key``       ``ASTATE_ETCD_KEY``      its key
``--user``      ``ASTATE_ETCD_USER``     ``user:password``, or ``user`` (password from ``--password``,
                                         ``ASTATE_ETCD_PASSWORD`` or a prompt)
==============  =======================  ==========================================
"""

from __future__ import annotations

import datetime
import getpass
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Annotated, Any

import typer
from rich.console import Console

from astate_store.errors import AStateError, CatalogError
from astate_store.etcd.config import ENV_ENDPOINT, ENV_PASSWORD, EtcdConfig
from astate_store.model.progress import Progress

__all__ = [
    "EtcdFlags",
    "EtcdOpt",
    "CaOpt",
    "CertOpt",
    "KeyOpt",
    "UserOpt",
    "PasswordOpt",
    "out",
    "err",
    "guarded",
    "etcd_config",
    "progress_bar",
    "when",
    "human_bytes",
    "print_json",
]

# Piped output (logs, scripts) gets wide lines instead of rich's 80 columns; $COLUMNS still wins.
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
out = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_WIDTH)

EtcdOpt = Annotated[
    str | None,
    typer.Option("--etcd", "--endpoints", help=f"etcd endpoints ({ENV_ENDPOINT})", show_default=False),
]
CaOpt = Annotated[
    str | None, typer.Option("--cacert", help="CA certificate of etcd's (ASTATE_ETCD_CA)", show_default=False)
]
CertOpt = Annotated[
    str | None, typer.Option("--cert", help="client certificate (ASTATE_ETCD_CERT)", show_default=False)
]
KeyOpt = Annotated[str | None, typer.Option("--key", help="client key (ASTATE_ETCD_KEY)", show_default=False)]
UserOpt = Annotated[
    str | None, typer.Option("--user", help="user:password or user (ASTATE_ETCD_USER)", show_default=False)
]
PasswordOpt = Annotated[
    str | None, typer.Option("--password", help=f"password ({ENV_PASSWORD})", show_default=False)
]


@dataclass(frozen=True)
class EtcdFlags:
    """The connection flags as given (None: not given)."""

    etcd: str | None = None
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    def over(self, base: EtcdFlags) -> EtcdFlags:
        """These flags, each falling back to ``base``'s (the global ones)."""
        return replace(base, **{k: v for k, v in self.__dict__.items() if v is not None})

    @property
    def given(self) -> bool:
        return self.etcd is not None or bool(os.environ.get(ENV_ENDPOINT))


def _flags(ctx: typer.Context, local: EtcdFlags) -> EtcdFlags:
    base = (
        ctx.find_root().obj if ctx is not None and isinstance(ctx.find_root().obj, EtcdFlags) else EtcdFlags()
    )
    return local.over(base)


def etcd_config(ctx: typer.Context, local: EtcdFlags) -> EtcdConfig:
    """The :class:`EtcdConfig` of the flags (command's, then global ones, then ``ASTATE_ETCD*``).

    Raises:
        CatalogError: no endpoint, half a credential, a missing file.
    """
    f = _flags(ctx, local)
    user, password = f.user, f.password
    if user is not None and ":" in user:
        user, password = user.split(":", 1)
    if user is not None and password is None:
        password = os.environ.get(ENV_PASSWORD) or None
        if password is None:
            if not sys.stdin.isatty():
                raise CatalogError(
                    f"--user {user}: no password (use --user {user}:PASSWORD, --password or {ENV_PASSWORD})"
                )
            password = getpass.getpass(f"etcd password of {user}: ")
    if f.etcd is None and not os.environ.get(ENV_ENDPOINT):
        raise CatalogError(
            f"no etcd endpoint: pass --etcd host:port or set {ENV_ENDPOINT} (`astate etcd` runs one)"
        )
    return EtcdConfig.from_args(f.etcd, ca=f.cacert, cert=f.cert, key=f.key, user=user, password=password)


def flags_given(ctx: typer.Context, local: EtcdFlags) -> bool:
    """Whether any endpoint is known (a flag or ``ASTATE_ETCD``)."""
    return _flags(ctx, local).given


@contextmanager
def guarded() -> Iterator[None]:
    """A typed error of the store becomes one red line on stderr and exit code 1; Ctrl-C, 130."""
    try:
        yield
    except AStateError as exc:
        err.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}", markup=True, highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None


@contextmanager
def progress_bar(description: str, *, enabled: bool = True) -> Iterator[Progress]:
    """A rich progress bar on stderr (stdout stays clean for ``--json``) and its
    ``progress(done, total)`` callback; hidden with ``enabled=False`` and when stderr is no terminal."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        SpinnerColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.progress import Progress as Bar

    with Bar(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        disable=not (enabled and err.is_terminal),
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def when(ts: float | None) -> str:
    """``2026-12-01 22:14:03 UTC (12s ago)``."""
    if ts is None:
        return "-"
    t = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    age = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= n:
            return f"{t} ({age / n:.0f}{unit} ago)"
    return f"{t} ({age:.0f}s ago)"


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n} B"


def print_json(data: Any) -> None:
    """JSON on stdout, one document (sorted keys: stable for scripts and diffs)."""
    import json

    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()

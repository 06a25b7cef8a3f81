"""``astate serve``: run a replica server in the foreground (docs/replicas.md)."""

from __future__ import annotations

import signal

import typer

from astate_store.cli.common import (
    CaOpt,
    CertOpt,
    EtcdFlags,
    EtcdOpt,
    KeyOpt,
    PasswordOpt,
    UserOpt,
    err,
    etcd_config,
    guarded,
)

__all__ = ["register"]


def serve(
    ctx: typer.Context,
    namespace_prefix: str = typer.Option(
        "", "--namespace-prefix", help="serve the namespaces whose names start with this (default: all)"
    ),
    memory_bytes: str = typer.Option(
        "8GiB",
        "--memory-bytes",
        help="buffer memory budget (4096, 512M, 8GiB); the most recently committed namespaces are kept",
    ),
    transport: str = typer.Option("auto", "--transport", help="auto, shm or tcp (several hosts)"),
    lease_ttl: float = typer.Option(
        10.0, "--lease-ttl", help="seconds until a killed server's offers vanish from the catalog"
    ),
    server_id: str = typer.Option(
        None, "--server-id", help="id in the replica group name (default host-pid-random)", show_default=False
    ),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """Hold and serve the newest committed version of every namespace under a prefix, so state
    outlives its writer; runs until Ctrl-C / SIGTERM."""
    from astate_store.servers.replica import ReplicaServer, parse_bytes

    with guarded():
        try:
            budget = parse_bytes(memory_bytes)
        except ValueError as exc:
            err.print(f"[bold red]error:[/] --memory-bytes: {exc}")
            raise typer.Exit(2) from None
        if transport not in ("auto", "shm", "tcp"):
            err.print(f"[bold red]error:[/] --transport must be auto, shm or tcp, got {transport!r}")
            raise typer.Exit(2)
        config = etcd_config(ctx, EtcdFlags(etcd, cacert, cert, key, user, password))
        try:
            server = ReplicaServer(
                config,
                namespace_prefix,
                budget,
                transport=transport,
                lease_ttl=lease_ttl,
                server_id=server_id,
            )
        except ValueError as exc:
            err.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(2) from None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: server.stop())
        err.print(
            f"# replica server {server.server_id}: namespaces {namespace_prefix!r}*, {budget} bytes; "
            "Ctrl-C stops it"
        )
        server.run()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)

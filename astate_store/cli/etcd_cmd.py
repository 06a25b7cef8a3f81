"""``astate etcd``: run one etcd in the foreground, the explicit form of the embedded one."""

from __future__ import annotations

import signal
import tempfile
import threading
from pathlib import Path

import typer
from rich.markup import escape

from astate_store.cli.common import err, guarded, out

__all__ = ["register"]


def run_etcd(
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="keep etcd's data here (default: a temporary directory, removed on exit)"
    ),
    port: int = typer.Option(2379, "--port", help="client port (0: any free one)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    tls: bool = typer.Option(
        False,
        "--tls",
        help="serve https with fresh certificates (a CA, a server "
        "and a client certificate) written under the data dir; needs the test extra's cryptography",
    ),
) -> None:
    """Run etcd in the foreground until Ctrl-C / SIGTERM; prints the endpoint to use (and, with
    --tls, the certificate paths) as shell exports."""
    from astate_store.etcd.embedded import EmbeddedEtcd

    with guarded():
        base = data_dir if data_dir is not None else Path(tempfile.mkdtemp(prefix="astate-etcd-"))
        base.mkdir(parents=True, exist_ok=True)
        certs = None
        if tls:
            from astate_store.etcd.security import make_test_certs

            try:
                certs = make_test_certs(
                    base / "certs", hosts=tuple(dict.fromkeys((host, "127.0.0.1", "localhost")))
                )
            except ModuleNotFoundError as exc:  # cryptography: the test extra's, not a dependency
                err.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False)
                raise typer.Exit(1) from None
        server = EmbeddedEtcd(data_dir=str(base), host=host, tls=certs, port=port)
        server._own_dir = data_dir is None  # a temporary dir goes with the server, a given one stays
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        server.start()
        try:
            assert server.proc is not None
            out.print(
                f"# etcd {server.binary} (pid {server.proc.pid}), data in {base}"
                f"{' (temporary)' if data_dir is None else ''}; Ctrl-C stops it"
            )
            out.print(f"export ASTATE_ETCD={server.endpoint}")
            if certs is not None:
                out.print(f"export ASTATE_ETCD_CA={certs.ca}")
                out.print(
                    f"# client certificate (for --client-cert-auth set-ups): {certs.client_cert} "
                    f"{certs.client_key}"
                )
            while not stop.wait(0.5):
                if server.proc.poll() is not None:
                    err.print(
                        f"[red]etcd exited with status {server.proc.returncode}[/]; its log: "
                        f"{base / 'etcd.log'}"
                    )
                    raise typer.Exit(1)
            out.print("# stopping etcd")
        finally:
            server.stop()


def register(app: typer.Typer) -> None:
    app.command("etcd")(run_etcd)

"""The ``astate`` Typer application: global connection flags, then one command per module."""

from __future__ import annotations

import logging
import os
from typing import Optional

import typer

from . import catalog_cmds, checkpoint_cmd, doctor, etcd_cmd, hf_cmds, serve_cmd
from .common import CaOpt, CertOpt, EtcdFlags, EtcdOpt, KeyOpt, PasswordOpt, UserOpt

__all__ = ["app", "main"]

app = typer.Typer(name="astate", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Operate an astate-store: run etcd, list and inspect namespaces, watch syncs, check "
                       "checkpoints, move versions to and from Hugging Face safetensors, diagnose a host.")


@app.callback()
def _root(ctx: typer.Context, etcd: EtcdOpt = None, cacert: CaOpt = None, cert: CertOpt = None, key: KeyOpt = None,
          user: UserOpt = None, password: PasswordOpt = None,
          verbose: bool = typer.Option(False, "--verbose", "-v", help="log the store's info messages to stderr"),
          ) -> None:
    """Connection flags given here apply to every command (a command's own flags win)."""
    ctx.obj = EtcdFlags(etcd, cacert, cert, key, user, password)
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


etcd_cmd.register(app)
catalog_cmds.register(app)
checkpoint_cmd.register(app)
hf_cmds.register(app)
doctor.register(app)
serve_cmd.register(app)


def main(argv: Optional[list[str]] = None) -> None:
    """The console script's entry point."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app(args=argv, prog_name="astate")

"""The ``astate`` Typer application: global connection flags, then one command per module."""

from __future__ import annotations

import atexit
import logging
import os
import sys

import typer

from astate_store.cli import catalog_cmds, checkpoint_cmd, doctor, etcd_cmd, hf_cmds, serve_cmd
from astate_store.cli.common import CaOpt, CertOpt, EtcdFlags, EtcdOpt, KeyOpt, PasswordOpt, UserOpt

__all__ = ["app", "main"]

app = typer.Typer(
    name="astate",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Operate an astate-store: run etcd, list and inspect namespaces, watch syncs, check "
    "checkpoints, move versions to and from Hugging Face safetensors, diagnose a host.",
)


@app.callback()
def _root(
    ctx: typer.Context,
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
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


def main(argv: list[str] | None = None) -> None:
    """The console script's entry point."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        app(args=argv, prog_name="astate")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    _leave(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)  # what the interpreter does with a message
    return 1


def _leave(code: int) -> None:
    """End the process once the command is done: Python's exit handlers run, output is
    flushed, and then ``os._exit``, skipping the native libraries' static destructors. One
    of them (loaded with gRPC, Arrow and torch) aborted at exit on a busy host ("terminate
    called without an active exception", exit status 134): 1 in 3 runs of ``checkpoint
    verify`` three at a time on 2 cores, after the command had finished and printed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code)

"""``astate export`` and ``astate import``: versions to and from Hugging Face safetensors."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import typer

from astate_store.cli.common import (
    CaOpt,
    CertOpt,
    EtcdFlags,
    EtcdOpt,
    KeyOpt,
    PasswordOpt,
    UserOpt,
    etcd_config,
    guarded,
    human_bytes,
    out,
    print_json,
    progress_bar,
)

__all__ = ["register"]


def export(
    ctx: typer.Context,
    namespace: str = typer.Argument(..., help="the namespace"),
    to: Path = typer.Option(..., "--to", help="directory to write the safetensors files into"),
    step: int | None = typer.Option(
        None,
        "--step",
        help="the oldest acceptable step (as get_into: the "
        "newest committed one >= it is exported; default: the newest)",
    ),
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", help="most bytes per file (5GB, 500MB, 512MiB ...)"
    ),
    timeout: float = typer.Option(60.0, "--timeout", help="seconds to wait for the version"),
    as_json: bool = typer.Option(False, "--json", help="JSON summary on stdout"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """Pull a committed version (as a consumer) and write it as HF safetensors shards
    (model-0000i-of-0000n.safetensors) plus model.safetensors.index.json."""
    from astate_store import connect
    from astate_store.integrations.hf_format import export_version, parse_size

    with guarded():
        config = etcd_config(ctx, EtcdFlags(etcd, cacert, cert, key, user, password))
        cap = parse_size(max_shard_size)
        with connect(namespace, etcd=config, rank=0, world_size=1) as store:
            with progress_bar(f"exporting {namespace}", enabled=not quiet) as progress:
                r = export_version(
                    store, to, step=step, max_shard_bytes=cap, timeout=timeout, progress=progress
                )
        if as_json:
            print_json(
                {
                    "step": r.step,
                    "directory": r.directory,
                    "files": r.files,
                    "total_size": r.total_size,
                    "tensors": r.tensors,
                }
            )
        else:
            files = f"{len(r.files)} file{'s' if len(r.files) != 1 else ''}"
            out.print(
                f"exported {namespace} step {r.step}: {r.tensors} tensors, {human_bytes(r.total_size)} in "
                f"{files} + model.safetensors.index.json under {r.directory}"
            )


def import_(
    ctx: typer.Context,
    path: Path = typer.Argument(
        ..., help="a directory with model.safetensors.index.json or *.safetensors files, or one file"
    ),
    ns: str = typer.Option(..., "--ns", help="the namespace to publish into"),
    step: int = typer.Option(..., "--step", help="the version number to publish"),
    serve_seconds: float | None = typer.Option(
        None, "--serve-seconds", help="stop serving after this many seconds (default: until Ctrl-C / SIGTERM)"
    ),
    transport: str = typer.Option("auto", "--transport", help="auto, shm or tcp (consumers on other hosts)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """Publish a HF safetensors checkpoint as version STEP of NS and serve it, in the foreground.

    The files are memory-mapped and published in place (no copy): the bytes live in this
    process, so it keeps serving until Ctrl-C / SIGTERM (or --serve-seconds); consumers pull
    while it runs. It opens a new publisher session of NS (rank 0 of 1), which fences any other
    publisher of NS: import into a namespace no trainer is publishing to."""
    from astate_store import connect
    from astate_store.integrations.hf_format import import_dir

    with guarded():
        config = etcd_config(ctx, EtcdFlags(etcd, cacert, cert, key, user, password))
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        store = connect(ns, etcd=config, rank=0, world_size=1, transport=transport)
        ck = None
        try:
            with progress_bar(f"mapping {path}", enabled=not quiet) as progress:
                ck = import_dir(store, path, step, progress=progress)
            until = "Ctrl-C / SIGTERM stops" if serve_seconds is None else f"for {serve_seconds:g}s"
            out.print(
                f"serving {ns} step {step}: {len(ck.tensors)} tensors, {human_bytes(ck.total_size)} from "
                f"{len(ck.files)} memory-mapped files (pid {os.getpid()}); {until}"
            )
            stop.wait(serve_seconds)
            out.print(f"stopping: retiring {ns} step {step}")
        finally:
            store.close()  # retires the version: readers finish (bounded) before the mappings go
            if ck is not None:
                ck.close()


def register(app: typer.Typer) -> None:
    app.command("export")(export)
    app.command("import")(import_)

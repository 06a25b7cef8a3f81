"""``astate checkpoint ls URI`` and ``astate checkpoint verify URI``: checkpoints on any
``pyarrow.fs`` storage (no etcd needed)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

import typer
from rich.table import Table

from astate_store.cli.common import err, guarded, human_bytes, out, print_json, progress_bar, when

__all__ = ["register"]

group = typer.Typer(no_args_is_help=True, help="List or verify checkpoints (a local path or a pyarrow.fs URI).")


@group.command("ls")
def ls(uri: str = typer.Argument(..., help="checkpoint root: a path, file://, s3://, gs://, hdfs://"),
       as_json: bool = typer.Option(False, "--json", help="JSON on stdout")) -> None:
    """The complete checkpoints under URI (those with a COMMIT marker), oldest first."""
    from astate_store import checkpoint as ckpt

    with guarded():
        infos = [ckpt.checkpoint_info(uri, s) for s in ckpt.list_checkpoints(uri)]
        if as_json:
            print_json([asdict(i) for i in infos])
            return
        if not infos:
            out.print(f"no complete checkpoint under {uri}")
            return
        t = Table(box=None, header_style="bold")
        for col in ("STEP", "WRITTEN", "RANKS", "TENSORS", "SHARDS", "BYTES", "FILES", "CHECKSUM"):
            t.add_column(col)
        for i in infos:
            t.add_row(str(i.step), when(i.written_at), str(i.world_size), str(i.tensors), str(i.shards),
                      human_bytes(i.bytes), str(len(i.files)), f"{i.checksum}/{human_bytes(i.block_size)}")
        out.print(t)


@group.command("verify")
def verify(uri: str = typer.Argument(..., help="checkpoint root"),
           step: Optional[int] = typer.Option(None, "--step", help="the step (default: the newest complete one)"),
           as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
           quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar")) -> None:
    """Read every block of a checkpoint and check it against the manifest's checksums; exit
    status 1 when anything is damaged (every damaged block is named)."""
    from astate_store import checkpoint as ckpt

    with guarded():
        with progress_bar(f"verifying {uri}" + ("" if step is None else f" step {step}"),
                          enabled=not quiet) as progress:
            r = ckpt.verify(uri, step, progress=progress)
        if as_json:
            print_json({**asdict(r), "ok": r.ok})
        else:
            n = len(r.problems)
            state = "[green]OK[/]" if r.ok else f"[red]CORRUPTED[/] ({n} problem{'s' if n != 1 else ''})"
            out.print(f"step {r.step} at {r.uri}: {r.files} files, {r.shards} shards, {human_bytes(r.bytes)}, "
                      f"{r.blocks} blocks checked: {state}")
            for p in r.problems:
                err.print(f"[red]damaged:[/] {p}")
        if not r.ok:
            raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="checkpoint")

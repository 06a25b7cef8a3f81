"""``astate checkpoint ls URI``, ``rm URI STEP`` and ``verify URI``: checkpoints on any ``pyarrow.fs``
storage (no etcd needed)."""

from __future__ import annotations

from dataclasses import asdict

import typer
from rich.table import Table

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
    human_bytes,
    out,
    print_json,
    progress_bar,
    when,
)

__all__ = ["register"]

group = typer.Typer(
    no_args_is_help=True, help="List, remove or verify checkpoints (a local path or a pyarrow.fs URI)."
)


@group.command("ls")
def ls(
    uri: str = typer.Argument(..., help="checkpoint root: a path, file://, s3://, gs://, hdfs://"),
    keep_last: int | None = typer.Option(None, "--keep-last", help="show what this retention keeps"),
    keep_every: int | None = typer.Option(
        None, "--keep-every", help="... with keep_every (needs --keep-last)"
    ),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
) -> None:
    """The complete checkpoints under URI (those with a COMMIT marker), oldest first, with the
    restores reading each (live reader leases) and, given a policy, what retention keeps and why."""
    from astate_store import checkpoint as ckpt
    from astate_store.checkpoint.storage import resolve

    with guarded():
        policy = ckpt.RetentionPolicy.of(keep_last, keep_every)
        loc = resolve(uri)
        infos = [ckpt.checkpoint_info(uri, s) for s in ckpt.list_checkpoints(uri)]
        readers = {i.step: len(ckpt.live_readers(loc, i.step)) for i in infos}
        view = ckpt.policy_view(uri, policy) if policy is not None else {}
        if as_json:
            print_json(
                [
                    {
                        **asdict(i),
                        "readers": readers[i.step],
                        **({"retention": view.get(i.step, "")} if policy is not None else {}),
                    }
                    for i in infos
                ]
            )
            return
        if not infos:
            out.print(f"no complete checkpoint under {uri}")
            return
        t = Table(box=None, header_style="bold")
        cols = ["STEP", "WRITTEN", "RANKS", "TENSORS", "SHARDS", "BYTES", "FILES", "CHECKSUM", "READERS"]
        for col in cols + (["RETENTION"] if policy is not None else []):
            t.add_column(col)
        for i in infos:
            row = [
                str(i.step),
                when(i.written_at),
                str(i.world_size),
                str(i.tensors),
                str(i.shards),
                human_bytes(i.bytes),
                str(len(i.files)),
                f"{i.checksum}/{human_bytes(i.block_size)}",
                str(readers[i.step]),
            ]
            if policy is not None:
                why = view.get(i.step, "")
                row.append("[red]remove[/]" if why == "remove" else f"keep ({why})")
            t.add_row(*row)
        out.print(t)


@group.command("rm")
def rm(
    ctx: typer.Context,
    uri: str = typer.Argument(..., help="checkpoint root"),
    step: int = typer.Argument(..., help="the step to remove"),
    namespace: str | None = typer.Option(
        None, "--namespace", "-n", help="also drop the namespace's catalog entry of it (needs etcd)"
    ),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """Remove one complete checkpoint by hand, under retention's rules: never the newest complete
    one, never one a restore is reading, never an incomplete one (another session may be writing
    it). With --namespace, the namespace's catalog entry naming it goes too (restores from the
    catalog skip entries whose checkpoint is gone in any case)."""
    from astate_store import checkpoint as ckpt
    from astate_store.checkpoint.storage import resolve

    with guarded():
        ckpt.remove_checkpoint(uri, step, by="astate checkpoint rm")
        forgot: list[int] = []
        if namespace is not None:
            from astate_store.catalog import Catalog

            root = resolve(uri).uri
            cat = Catalog(etcd_config(ctx, EtcdFlags(etcd, cacert, cert, key, user, password)), namespace)
            try:
                forgot = cat.checkpoints.forget([step], lambda u: resolve(u).uri == root)
            finally:
                cat.close()
        if as_json:
            print_json({"removed": step, "uri": uri, "catalog_entry_removed": bool(forgot)})
        else:
            out.print(
                f"removed checkpoint step {step} under {uri}"
                + (f" and its catalog entry in {namespace}" if forgot else "")
            )


@group.command("verify")
def verify(
    uri: str = typer.Argument(..., help="checkpoint root"),
    step: int | None = typer.Option(None, "--step", help="the step (default: the newest complete one)"),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Read every block of a checkpoint and check it against the manifest's checksums; exit
    status 1 when anything is damaged (every damaged block is named)."""
    from astate_store import checkpoint as ckpt

    with guarded():
        with progress_bar(
            f"verifying {uri}" + ("" if step is None else f" step {step}"), enabled=not quiet
        ) as progress:
            r = ckpt.verify(uri, step, progress=progress)
        if as_json:
            print_json({**asdict(r), "ok": r.ok})
        else:
            n = len(r.problems)
            state = "[green]OK[/]" if r.ok else f"[red]CORRUPTED[/] ({n} problem{'s' if n != 1 else ''})"
            out.print(
                f"step {r.step} at {r.uri}: {r.files} files, {r.shards} shards, {human_bytes(r.bytes)}, "
                f"{r.blocks} blocks checked: {state}"
            )
            for p in r.problems:
                err.print(f"[red]damaged:[/] {p}")
        if not r.ok:
            raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(group, name="checkpoint")

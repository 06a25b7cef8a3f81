"""``astate ls``, ``astate inspect NS``, ``astate watch NS``: what the catalog holds, read-only."""

from __future__ import annotations

import json
import queue
import sys
import time
from collections import deque
from typing import Any

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
    etcd_config,
    guarded,
    human_bytes,
    out,
    print_json,
    when,
)

__all__ = ["register"]


def _catalog(config: Any, namespace: str) -> Any:
    from astate_store.catalog import Catalog

    return Catalog(config, namespace)


def ls(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """Each namespace: latest step, when it was committed, live publishers and consumers."""
    from astate_store.catalog import namespaces as namespaces_admin
    from astate_store.cli import views

    with guarded():
        config = etcd_config(ctx, EtcdFlags(etcd, cacert, cert, key, user, password))
        rows = []
        for ns in namespaces_admin.namespaces(etcd=config):
            try:
                cat = _catalog(config, ns)
            except Exception as exc:  # a key under /astate/ that is no valid namespace: shown, not fatal
                rows.append(views.NamespaceSummary(ns, problems=[str(exc)]))
                continue
            try:
                rows.append(views.summarize(cat))
            finally:
                cat.close()
        if as_json:
            print_json([r.as_dict() for r in rows])
            return
        t = Table(box=None, header_style="bold")
        for col in (
            "NAMESPACE",
            "LATEST",
            "COMMITTED",
            "EPOCH",
            "PUBLISHERS",
            "CONSUMERS",
            "CHECKPOINTS",
            "NOTES",
        ):
            t.add_column(col)
        for r in rows:
            pubs = (
                "-" if r.world_size is None and not r.publishers else f"{r.publishers}/{r.world_size or '?'}"
            )
            notes = "; ".join(r.problems) + (
                f" {r.skipped_records} bad records skipped" if r.skipped_records else ""
            )
            t.add_row(
                r.namespace,
                "-" if r.latest is None else str(r.latest),
                when(r.committed_at),
                "-" if r.epoch is None else str(r.epoch),
                pubs,
                str(r.consumers),
                str(r.checkpoints),
                notes,
            )
        if not rows:
            out.print(f"no namespaces at {config.url}")
        else:
            out.print(t)


def inspect(
    ctx: typer.Context,
    namespace: str = typer.Argument(..., help="the namespace"),
    step: int | None = typer.Option(None, "--step", help="the version to describe (default: latest)"),
    as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """One namespace: versions retained (with the fraction of elements each changed, for
    ``delta=True`` publishers), session and ranks, readers, consumers, replicas, checkpoints, and
    each tensor's shape, dtype, shards (distinct boxes) and bytes."""
    from astate_store.cli import views

    with guarded():
        config = etcd_config(ctx, EtcdFlags(etcd, cacert, cert, key, user, password))
        cat = _catalog(config, namespace)
        try:
            info = views.inspect(cat, step)
        finally:
            cat.close()
        if as_json:
            print_json(info)
        else:
            _show(info)


def _show(info: dict[str, Any]) -> None:
    s = info["session"]
    out.print(f"[bold]{info['namespace']}[/]  latest {info['latest']}  versions {info['versions']}")
    if s:
        out.print(
            f"session epoch {s.get('epoch')} ({s.get('session_id')}), world size {s.get('world_size')}, "
            f"rank 0 on {s.get('host')} pid {s.get('pid')}"
        )
    if info["step"] is not None:
        out.print(f"step {info['step']} committed {when(info['committed_at'])}")
    _show_changes(info["changes"])
    ranks = Table(title="ranks", box=None, header_style="bold", title_justify="left")
    for col in ("RANK", "EPOCH", "ALIVE", "SHARDS", "BYTES", "LAYOUT"):
        ranks.add_column(col)
    for r in info["ranks"]:
        ranks.add_row(
            str(r["rank"]),
            str(r["epoch"]),
            "yes" if r["alive"] else "[red]no[/]",
            str(r["shards"]),
            human_bytes(r["bytes"]),
            r["layout_id"],
        )
    out.print(ranks)
    tensors = Table(title="tensors", box=None, header_style="bold", title_justify="left")
    for col in ("NAME", "SHAPE", "DTYPE", "SHARDS", "BYTES"):
        tensors.add_column(col)
    for name, t in info["tensors"].items():
        tensors.add_row(
            name,
            "x".join(map(str, t["shape"])) or "()",
            t["dtype"],
            str(t["shards"]),
            human_bytes(t["bytes"]),
        )
    out.print(tensors)
    out.print(f"readers {len(info['readers'])}: {', '.join(r['reader_id'] for r in info['readers']) or '-'}")
    out.print(f"consumers {len(info['consumers'])}: {', '.join(info['consumers']) or '-'}")
    out.print(
        f"replicas {len(info['replicas'])}: "
        f"{', '.join(r['member'] + ' (' + r['group'] + ')' for r in info['replicas']) or '-'}"
    )
    ck = info["checkpoints"]
    out.print(f"checkpoints {len(ck)}: " + (", ".join(f"step {c['step']} at {c['uri']}" for c in ck) or "-"))
    if info["skipped_records"]:
        out.print(f"[yellow]{info['skipped_records']} bad records skipped[/]")
    for p in info["problems"]:
        out.print(f"[red]problem:[/] {p}")


def _show_changes(changes: list[dict[str, Any]]) -> None:
    """Each retained version's changed fraction (delta versions); nothing without them."""
    if not any(c["fraction"] is not None for c in changes):
        return
    t = Table(title="changes", box=None, header_style="bold", title_justify="left")
    for col in ("STEP", "SINCE", "CHANGED", "OF", "FRACTION"):
        t.add_column(col)
    for c in changes:
        if c["fraction"] is None:
            t.add_row(str(c["step"]), "-", "-", "-", "whole")
        else:
            since = ",".join(map(str, c["bases"]))
            t.add_row(str(c["step"]), since, str(c["changed"]), str(c["elements"]), f"{c['fraction']:.4%}")
    out.print(t)


_ALL_EVENTS = ("commit", "pull started", "pulled", "retired", "torn", "re-serve", "checkpoint", "session")


def watch(
    ctx: typer.Context,
    namespace: str = typer.Argument(..., help="the namespace"),
    count: int | None = typer.Option(None, "--count", help="exit after this many events"),
    timeout: float | None = typer.Option(None, "--timeout", help="exit after this many seconds"),
    events: str = typer.Option(
        "all",
        "--events",
        help="comma-separated kinds to show: " + ", ".join(e.replace(" ", "-") for e in _ALL_EVENTS),
    ),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per event on stdout"),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """Live view of a namespace: commits, pulls (started / done), retires, torn marks, re-serves,
    checkpoints and new sessions, as they happen (an etcd watch)."""
    from astate_store.catalog.records import Skips
    from astate_store.cli import views
    from astate_store.etcd.client import range_end

    with guarded():
        kinds = (
            set(_ALL_EVENTS) if events == "all" else {e.strip().replace("-", " ") for e in events.split(",")}
        )
        unknown = kinds - set(_ALL_EVENTS)
        if unknown:
            raise typer.BadParameter(f"unknown event kinds {sorted(unknown)}", param_hint="--events")
        config = etcd_config(ctx, EtcdFlags(etcd, cacert, cert, key, user, password))
        cat = _catalog(config, namespace)
        c = cat.client
        q: queue.Queue[Any] = queue.Queue()
        pre = c.key("")
        wid = c.call(
            "watch namespace", lambda: c.raw.add_watch_callback(pre, q.put, range_end=range_end(pre))
        )
        skips = Skips(namespace, "bad")
        try:
            latest = cat.versions.latest()
            ready = {"event": "watching", "namespace": namespace, "latest": latest, "at": time.time()}
            view = _View(namespace, latest, as_json or not out.is_terminal)
            view.emit(ready, as_json)
            _loop(q, namespace, kinds, count, timeout, skips, view, as_json, views.describe_event)
        finally:
            try:
                c.raw.cancel_watch(wid)
            except Exception:  # the stream may already be gone
                pass
            cat.close()


def _loop(
    q: queue.Queue[Any],
    namespace: str,
    kinds: set[str],
    count: int | None,
    timeout: float | None,
    skips: Any,
    view: _View,
    as_json: bool,
    describe: Any,
) -> None:
    from pyetcd.events import DeleteEvent

    deadline = None if timeout is None else time.monotonic() + timeout
    seen = 0
    with view:
        while count is None or seen < count:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                resp = q.get(timeout=min(left, 1.0) if left is not None else 1.0)
            except queue.Empty:
                view.tick()
                continue
            if isinstance(resp, Exception):
                raise _stream_error(resp)
            for e in getattr(resp, "events", ()):
                ev = describe(
                    namespace, e.key.decode("utf-8", "replace"), e.value, isinstance(e, DeleteEvent), skips
                )
                if ev is None or ev["event"] not in kinds:
                    continue
                ev.setdefault("at", time.time())
                view.emit(ev, as_json)
                seen += 1
                if count is not None and seen >= count:
                    break


def _stream_error(exc: Exception) -> Exception:
    from astate_store.errors import CatalogUnavailable

    return CatalogUnavailable(f"the etcd watch stream ended: {exc}")


class _View:
    """Events as lines (JSON or text), or, on a terminal, a rich Live table of the latest ones."""

    def __init__(self, namespace: str, latest: int | None, plain: bool):
        self.namespace, self.latest, self.plain = namespace, latest, plain
        self.rows: deque[dict[str, Any]] = deque(maxlen=20)
        self.counts: dict[str, int] = {}
        self.last_commit: float | None = None
        self._live: Any = None

    def __enter__(self) -> _View:
        if not self.plain:
            from rich.live import Live

            self._live = Live(self._table(), console=out, refresh_per_second=4)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def emit(self, ev: dict[str, Any], as_json: bool) -> None:
        if ev["event"] == "commit":
            self.latest, self.last_commit = ev["step"], time.time()
        if ev["event"] != "watching":
            self.counts[ev["event"]] = self.counts.get(ev["event"], 0) + 1
            self.rows.append(ev)
        if as_json:
            sys.stdout.write(json.dumps(ev, sort_keys=True, default=str) + "\n")
            sys.stdout.flush()
        elif self.plain:
            out.print(_line(ev))
        elif self._live is not None:
            self._live.update(self._table())

    def tick(self) -> None:
        if self._live is not None:
            self._live.update(self._table())

    def _table(self) -> Table:
        since = "" if self.last_commit is None else f", last commit {time.time() - self.last_commit:.0f}s ago"
        totals = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())) or "no events yet"
        t = Table(
            title=f"{self.namespace}: latest {self.latest}{since} | {totals}",
            title_justify="left",
            header_style="bold",
        )
        for col in ("TIME", "EVENT", "STEP", "WHO", "DETAIL"):
            t.add_column(col)
        for ev in self.rows:
            t.add_row(*_cells(ev))
        return t


def _cells(ev: dict[str, Any]) -> tuple[str, str, str, str, str]:
    ts = time.strftime("%H:%M:%S", time.gmtime(ev.get("at", time.time())))
    detail = {k: v for k, v in ev.items() if k not in ("event", "step", "who", "at")}
    return (
        ts,
        ev["event"],
        "" if ev.get("step") is None else str(ev["step"]),
        str(ev.get("who", "")),
        " ".join(f"{k}={v}" for k, v in sorted(detail.items())),
    )


def _line(ev: dict[str, Any]) -> str:
    if ev["event"] == "watching":
        return f"watching {ev['namespace']} (latest step {ev['latest']}); Ctrl-C stops"
    ts, kind, step, who, detail = _cells(ev)
    return f"{ts}  {kind:<12}  {step:>6}  {who:<18}  {detail}".rstrip()


def rm(
    ctx: typer.Context,
    namespace: str = typer.Argument(..., help="the namespace"),
    step: int | None = typer.Option(None, "--step", help="delete only this version (not the newest)"),
    force: bool = typer.Option(False, "--force", help="delete even while publishers or consumers are live"),
    etcd: EtcdOpt = None,
    cacert: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    user: UserOpt = None,
    password: PasswordOpt = None,
) -> None:
    """Delete a namespace's catalog keys (every version, session and record; checkpoint files in
    storage stay), or with --step one retained version. Refused while the namespace is in use."""
    with guarded():
        config = etcd_config(ctx, EtcdFlags(etcd, cacert, cert, key, user, password))
        cat = _catalog(config, namespace)
        try:
            if step is not None:
                cat.versions.delete_step(step)
                out.print(f"deleted step {step} of {namespace}")
            else:
                out.print(f"deleted {namespace}: {cat.delete_all(force=force)} keys")
        finally:
            cat.close()


def register(app: typer.Typer) -> None:
    app.command("rm")(rm)
    app.command("ls")(ls)
    app.command("inspect")(inspect)
    app.command("watch")(watch)

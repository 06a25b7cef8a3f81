"""Read-only views of the catalog for operators (``astate ls``, ``astate inspect``, ``astate watch``).

Everything here reads through the roles' validated readers (``versions``, ``readers``,
``consumers``, ``checkpoints``, ``sessions``): a record that fails its schema or key check is
skipped and counted (``skipped_records``), and a bad authority record (``latest``, a commit, a
piece) becomes a line in ``problems`` instead of an exception, so a damaged namespace can still
be looked at. Nothing here writes to etcd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from astate_store.catalog import Catalog
from astate_store.catalog.namespaces import ROOT
from astate_store.catalog.records import Skips, Version, pad20, parse_pad20
from astate_store.catalog.shard_tables import Manifest
from astate_store.errors import CatalogError, CatalogUnavailable, CodecError, VersionNotFound
from astate_store.model import codec
from astate_store.model.dtypes import itemsize

__all__ = ["NamespaceSummary", "summarize", "inspect", "commit_time", "readers_of", "describe_event", "ROOT"]


T = TypeVar("T")


@dataclass
class NamespaceSummary:
    """One row of ``astate ls``."""

    namespace: str
    latest: int | None = None
    committed_at: float | None = None
    epoch: int | None = None
    world_size: int | None = None
    publishers: int = 0  #: live publisher ranks of the newest session
    consumers: int = 0  #: live consumers (registered on their lease)
    checkpoints: int = 0
    skipped_records: int = 0
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _guard(problems: list[str], what: str, fn: Callable[[], T], default: T) -> T:
    """``fn()``, or ``default`` with a line in ``problems`` when the catalog refuses to trust a
    record (etcd being unreachable is not a record problem: it is raised)."""
    try:
        return fn()
    except CatalogUnavailable:
        raise
    except (CatalogError, CodecError) as exc:
        problems.append(f"{what}: {exc}")
        return default


def commit_time(catalog: Catalog, step: int) -> float | None:
    """When ``step`` was committed (its commit record), or None when it is not (any more)."""
    c = catalog.client
    key = c.key("versions", pad20(step), "commit")
    value, _ = c.call("get commit", lambda: c.raw.get(key))
    if value is None:
        return None
    return float(codec.decode("commit", value)["committed_at"])


def summarize(catalog: Catalog) -> NamespaceSummary:
    """Latest step, commit time, session, live publishers and consumers of one namespace."""
    s = NamespaceSummary(catalog.namespace)
    p = s.problems
    s.latest = _guard(p, "latest", catalog.versions.latest, None)
    if s.latest is not None:
        s.committed_at = _guard(p, f"commit of step {s.latest}", lambda: commit_time(catalog, s.latest), None)
    s.epoch = _guard(p, "epoch", catalog.sessions.epoch, None)
    session = _guard(p, "session", catalog.sessions.record, None)
    if session is not None:
        s.world_size = int(session["world_size"])
    if s.epoch is not None:
        s.publishers = len(_guard(p, "members", lambda: catalog.sessions.live_ranks(s.epoch), set()))
    s.consumers = len(_guard(p, "consumers", catalog.consumers.ids, set()))
    s.checkpoints = len(_guard(p, "checkpoints", catalog.checkpoints.list, []))
    s.skipped_records = catalog.skipped_records
    return s


def readers_of(catalog: Catalog, step: int, skips: Skips) -> list[dict[str, Any]]:
    """The readers registered on ``step`` right now (consumers mid-pull): id, host, pid."""
    c = catalog.client
    pre = c.key("readers", pad20(step)) + "/"
    kvs = c.call("get readers", lambda: list(c.raw.get_prefix(pre)))
    out = []
    for value, meta in kvs:
        key = meta.key.decode("utf-8", "replace")
        try:
            d = codec.decode("reader", value)
        except CodecError as exc:
            skips(key, str(exc), meta.mod_revision)
            continue
        if (d["step"], d["reader_id"]) != (step, key[len(pre) :]):
            skips(
                key,
                f"reader record of step {d['step']} reader {d['reader_id']!r} under this key",
                meta.mod_revision,
            )
            continue
        out.append({"reader_id": d["reader_id"], "host": d["host"], "pid": d["pid"]})
    return sorted(out, key=lambda r: r["reader_id"])


def _tensors(manifests: dict[int, Manifest]) -> dict[str, dict[str, Any]]:
    """name -> {shape, dtype, shards (distinct boxes over every rank), bytes (of the global tensor)}."""
    boxes: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    out: dict[str, dict[str, Any]] = {}
    for rank in sorted(manifests):
        for rec in manifests[rank].records(rank):
            boxes.setdefault(rec.name, set()).add((rec.box.offsets, rec.box.sizes))
            if rec.name not in out:
                n = 1
                for d in rec.global_shape:
                    n *= d
                out[rec.name] = {
                    "shape": list(rec.global_shape),
                    "dtype": rec.dtype,
                    "shards": 0,
                    "bytes": n * itemsize(rec.dtype),
                }
    for name, b in boxes.items():
        out[name]["shards"] = len(b)
    return dict(sorted(out.items()))


def _ranks(version: Version, manifests: dict[int, Manifest], live: set[int]) -> list[dict[str, Any]]:
    out = []
    for r in sorted(version.pieces):
        p = version.pieces[r]
        recs = manifests[r].records(r) if r in manifests else ()
        out.append(
            {
                "rank": r,
                "epoch": p.epoch,
                "alive": r in live,
                "layout_id": p.layout_id,
                "manifest_id": p.manifest_id,
                "shards": len(recs),
                "bytes": sum(x.nbytes for x in recs),
            }
        )
    return out


_SESSION_FIELDS = ("epoch", "session_id", "world_size", "host", "pid", "started")


def inspect(catalog: Catalog, step: int | None = None) -> dict[str, Any]:
    """Everything ``astate inspect`` shows of one namespace, JSON-ready: ``namespace``, ``latest``,
    ``step`` (the one described: ``step`` or the newest), ``committed_at``, ``versions`` (the steps
    retained), ``session``, ``ranks``, ``readers``, ``consumers``, ``replicas``, ``checkpoints``,
    ``tensors`` (name -> {shape, dtype, shards, bytes}), ``changes`` (per version retained, what its
    delta records say changed since each rank's previous put: ``step``, ``bases``, ``changed``,
    ``elements``, ``fraction``; None where a rank has none), ``skipped_records`` and ``problems``.

    Raises:
        VersionNotFound: ``step`` was given and is not committed (or no longer retained).
        CatalogUnavailable: etcd does not answer.
    """
    problems: list[str] = []
    skips = Skips(catalog.namespace, "bad")
    latest = _guard(problems, "latest", catalog.versions.latest, None)
    versions = _guard(problems, "versions", catalog.versions.committed_steps, [])
    session = _guard(problems, "session", catalog.sessions.record, None)
    shown = step if step is not None else latest
    out: dict[str, Any] = {
        "namespace": catalog.namespace,
        "latest": latest,
        "step": shown,
        "committed_at": None,
        "versions": versions,
        "session": None if session is None else {k: session[k] for k in _SESSION_FIELDS if k in session},
        "ranks": [],
        "readers": [],
        "consumers": sorted(_guard(problems, "consumers", catalog.consumers.ids, set())),
        "replicas": [],
        "checkpoints": [],
        "tensors": {},
    }
    out["checkpoints"] = [asdict(c) for c in _guard(problems, "checkpoints", catalog.checkpoints.list, [])]
    out["changes"] = [_changes(catalog, s, problems) for s in versions]
    if shown is not None:
        version = _read(catalog, shown, step is not None, problems)
        if version is not None:
            _describe_version(catalog, version, out, skips, problems)
    out["skipped_records"] = catalog.skipped_records + skips.count
    out["problems"] = problems
    return out


def _changes(catalog: Catalog, step: int, problems: list[str]) -> dict[str, Any]:
    """What one version's delta records say (docs/delta.md): elements changed since each rank's
    previous put, of how many; ``fraction`` None when some rank recorded none (a whole version)."""
    row: dict[str, Any] = {"step": step, "bases": [], "changed": None, "elements": None, "fraction": None}
    version = _guard(problems, f"step {step}", lambda: catalog.versions.read_version(step), None)
    if version is None:
        return row
    deltas = [p.delta for _r, p in sorted(version.pieces.items())]
    if not deltas or any(d is None or d.base is None for d in deltas):
        return row
    changed, elements = sum(d.changed for d in deltas), sum(d.elements for d in deltas)
    row.update(
        bases=sorted({d.base for d in deltas}),
        changed=changed,
        elements=elements,
        fraction=changed / elements if elements else 0.0,
    )
    return row


def _read(catalog: Catalog, step: int, asked: bool, problems: list[str]) -> Version | None:
    try:
        return catalog.versions.read_version(step)
    except VersionNotFound:
        if asked:
            raise
        problems.append(f"step {step}: the newest step is no longer committed (dropped meanwhile)")
        return None
    except CatalogUnavailable:
        raise
    except CatalogError as exc:
        problems.append(f"step {step}: {exc}")
        return None


def _describe_version(
    catalog: Catalog, version: Version, out: dict[str, Any], skips: Skips, problems: list[str]
) -> None:
    out["committed_at"] = _guard(problems, "commit", lambda: commit_time(catalog, version.step), None)
    manifests = _guard(
        problems, f"step {version.step} manifests", lambda: catalog.versions.manifests_of(version), {}
    )
    live = _guard(problems, "members", lambda: catalog.sessions.live_ranks(version.epoch), set())
    out["ranks"] = _ranks(version, manifests, live)
    out["tensors"] = _tensors(manifests)
    out["readers"] = _guard(problems, "readers", lambda: readers_of(catalog, version.step, skips), [])
    out["replicas"] = [
        {"member": m, "group": r.group, "layout_id": r.layout_id} for m, r in sorted(version.replicas.items())
    ]


# ---- watch -----------------------------------------------------------------------------------

# key family under a namespace -> (event kind, record schema) that ``astate watch`` reports.
_FAMILIES = {
    "readers": ("pull started", "reader"),
    "delivered": ("pulled", None),
    "retired": ("retired", "retired"),
    "torn": ("torn", "retired"),
    "checkpoints": ("checkpoint", "checkpoint"),
    "session": ("session", "session"),
}


def describe_event(
    namespace: str, key: str, value: bytes, deleted: bool, skips: Skips
) -> dict[str, Any] | None:
    """A watch event under ``/astate/<namespace>/`` as an operator's event, or None when it is
    not one ``astate watch`` shows (layout chunks, manifests, counters, deletions ...). A record
    that fails its schema is skipped (counted in ``skips``), never shown as if it were good."""
    pre = f"{ROOT}{namespace}/"
    if deleted or not key.startswith(pre):
        return None
    parts = key[len(pre) :].split("/")
    try:
        if parts[0] == "versions" and len(parts) == 3 and parts[2] == "commit":
            d = codec.decode("commit", value)
            return {
                "event": "commit",
                "step": d["step"],
                "epoch": d["epoch"],
                "world_size": d["world_size"],
                "at": d["committed_at"],
            }
        if parts[0] == "versions" and len(parts) == 5 and parts[2] == "replicas":
            d = codec.decode("replica", value)
            return {"event": "re-serve", "step": d["step"], "who": d["member"], "group": d["group"]}
        kind = _FAMILIES.get(parts[0])
        if kind is None:
            return None
        name, schema = kind
        if parts[0] == "session":
            d = codec.decode("session", value)
            return {"event": name, "epoch": d["epoch"], "world_size": d["world_size"]}
        step = parse_pad20(parts[1]) if len(parts) > 1 else None
        if step is None:
            return None
        ev: dict[str, Any] = {"event": name, "step": step}
        if schema == "reader":
            d = codec.decode("reader", value)
            ev.update(who=d["reader_id"], host=d["host"], pid=d["pid"])
        elif schema == "retired":
            d = codec.decode("retired", value)
            ev.update(who=f"rank {d['rank']}", epoch=d["epoch"])
        elif schema == "checkpoint":
            d = codec.decode("checkpoint", value)
            ev.update(uri=d["uri"], bytes=d["bytes"])
        elif len(parts) > 2:
            ev["who"] = parts[2]
        return ev
    except CodecError as exc:
        skips(key, str(exc))
        return None

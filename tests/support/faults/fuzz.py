"""Records fuzzed through every decoder (hypothesis), run inside an actor (``op_fuzz``): each
example decodes, raises a typed error, or is counted as a crash with its input.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def fuzz_targets() -> tuple[str, ...]:
    from astate_store.model import codec

    return tuple(f"codec:{k}" for k in codec.KINDS) + (
        "counter",
        "blob_from_kvs",
        "manifest_from_record",
        "layout_from_record",
        "version_from_kvs",
    )


class _Meta:
    """What the catalog reads of an etcd key-value's metadata: its key (bytes)."""

    def __init__(self, key: bytes):
        self.key = key

    def __repr__(self) -> str:
        return f"meta(key={self.key!r})"


def _schema_strategy(node: Mapping[str, Any], defs: Mapping[str, Any], st: Any) -> Any:
    """Records that (mostly) satisfy a JSON schema node of the subset ``codec`` reads."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    typ = node.get("type")
    if typ == "string" and node.get("contentEncoding") == "base64":
        return st.binary(max_size=48)
    if typ == "string":
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True)
        return st.text(max_size=16)
    if typ == "integer":
        lo = node.get("minimum", -(2**63))
        return st.integers(min_value=lo, max_value=min(node.get("maximum", 2**64 - 1), 2**64 - 1))
    if typ == "number":
        return st.one_of(st.floats(allow_nan=True), st.integers(min_value=-(2**63), max_value=2**63 - 1))
    if typ == "boolean":
        return st.booleans()
    if typ == "null":
        return st.none()
    if typ == "array":
        return st.lists(_schema_strategy(node.get("items", {}), defs, st), max_size=4)
    if typ == "object":
        props = node.get("properties", {})
        req = set(node.get("required", ()))
        return st.fixed_dictionaries(
            {k: _schema_strategy(v, defs, st) for k, v in props.items() if k in req},
            optional={k: _schema_strategy(v, defs, st) for k, v in props.items() if k not in req},
        )
    return _any_value(st)


def _any_value(st: Any) -> Any:
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(),
        st.text(max_size=12),
        st.binary(max_size=24),
    )
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)
        ),
        max_leaves=12,
    )


def _record_bytes(kind: str, st: Any) -> Any:
    """msgpack bytes of ``kind`` records: valid ones, ones with a field dropped, added or
    replaced, a wrong schema tag, truncated, bit-flipped, with trailing bytes, or random."""
    import msgpack

    from astate_store.model import codec

    sch = codec.schema_of(kind)
    rec = _schema_strategy(sch, sch.get("$defs", {}), st)

    @st.composite
    def mutated(draw: Any) -> bytes:
        r = dict(draw(rec))
        how = draw(
            st.sampled_from(
                ["valid", "drop", "add", "replace", "tag", "truncate", "flip", "trail", "not_map"]
            )
        )
        if how == "drop" and r:
            r.pop(draw(st.sampled_from(sorted(r))))
        elif how == "add":
            r[draw(st.text(max_size=8))] = draw(_any_value(st))
        elif how == "replace" and r:
            r[draw(st.sampled_from(sorted(r)))] = draw(_any_value(st))
        elif how == "tag":
            r["schema"] = draw(
                st.one_of(
                    st.sampled_from([f"{k}/1" for k in codec.KINDS] + [f"{kind}/2", kind, "/"]),
                    _any_value(st),
                )
            )
        if how == "not_map":
            data = msgpack.packb(draw(_any_value(st)), use_bin_type=True)
        else:
            data = msgpack.packb(r, use_bin_type=True)
        if how == "truncate" and data:
            data = data[: draw(st.integers(0, len(data) - 1))]
        elif how == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
        elif how == "trail":
            data += draw(st.binary(min_size=1, max_size=8))
        return data

    return st.one_of(mutated(), st.binary(max_size=64))


def _i64s(values: Sequence[int]) -> bytes:
    import numpy as np

    return np.asarray(values, dtype="<i8").tobytes()


def _manifest_columns(st: Any) -> Any:
    """Manifest-like column dicts whose lengths and values (mostly) fit together, so the checks
    past the schema run: dtype codes, box bounds, column lengths."""

    @st.composite
    def cols(draw: Any) -> dict[str, Any]:
        n = draw(st.integers(0, 4))
        nd = [draw(st.integers(0, 3)) for _ in range(n)]
        total = sum(nd)
        small = st.integers(-3, 40) if draw(st.booleans()) else st.integers(-(2**63), 2**63 - 1)
        gs = [draw(st.integers(0, 40)) for _ in range(total)]
        of = [draw(st.integers(0, g)) for g in gs]
        sz = [draw(st.integers(0, g - o)) for g, o in zip(gs, of)]
        if draw(st.booleans()):  # break one thing
            which = draw(st.sampled_from(["gs", "of", "sz", "nd", "dt", "len"]))
            if which == "gs" and gs:
                gs[draw(st.integers(0, len(gs) - 1))] = draw(small)
            elif which == "of" and of:
                of[draw(st.integers(0, len(of) - 1))] = draw(small)
            elif which == "sz" and sz:
                sz[draw(st.integers(0, len(sz) - 1))] = draw(small)
            elif which == "nd" and nd:
                nd[draw(st.integers(0, len(nd) - 1))] = draw(st.integers(0, 255))
            elif which == "len":
                gs = gs + [draw(st.integers(0, 9))]
        dts = bytes(draw(st.integers(0, 11 if draw(st.booleans()) else 255)) for _ in range(n))
        return {
            "names": [draw(st.from_regex(r"[a-z][a-z0-9_.]{0,6}", fullmatch=True)) for _ in range(n)],
            "dtypes": dts,
            "ndims": bytes(min(255, x) for x in nd),
            "global_shapes": _i64s(gs),
            "offsets": _i64s(of),
            "sizes": _i64s(sz),
        }

    return cols()


def _fuzz_call(target: str, data: Any, st: Any) -> Callable[[], Any]:
    """The decoder call for one drawn example (``data`` is hypothesis' interactive draw)."""
    import msgpack

    from astate_store.catalog import blobs, records, shard_tables
    from astate_store.model import codec
    from astate_store.model.layout import Box, ShardRecord

    if target.startswith("codec:"):
        kind = target.split(":", 1)[1]
        raw = data.draw(_record_bytes(kind, st))
        return lambda: codec.decode(kind, raw)
    if target == "counter":
        raw = data.draw(st.one_of(st.binary(max_size=24), st.from_regex(rb"[0-9]{18,22}", fullmatch=True)))
        return lambda: codec.decode_counter(raw)
    if target == "blob_from_kvs":
        key = "/astate/fz/manifests/" + "a" * 24
        payload = data.draw(st.binary(max_size=64))
        how = data.draw(st.sampled_from(["none", "zlib", "bad"]))
        import zlib

        stored = zlib.compress(payload) if how == "zlib" else payload
        chunked = data.draw(st.booleans())
        head: dict[str, Any] = {
            "size": data.draw(st.sampled_from([len(payload), len(payload) + 1, 0])),
            "codec": "zlib" if how in ("zlib", "bad") else "none",
            "digest": blobs._digest(stored) if data.draw(st.booleans()) else "0" * 16,
        }
        kvs: list[tuple[bytes, Any]] = []
        if chunked:
            parts = [stored[i : i + 8] for i in range(0, len(stored), 8)] or [b""]
            head["chunks"] = data.draw(st.sampled_from([len(parts), len(parts) + 1, max(0, len(parts) - 1)]))
            for i, part in enumerate(parts):
                if data.draw(st.integers(0, 9)) == 0:
                    continue  # a lost chunk
                kvs.append((part, _Meta(f"{key}/{i:06d}".encode())))
        else:
            head["chunks"] = 0
            head["data"] = stored
        if data.draw(st.booleans()):
            head_raw = (
                codec.encode("blob", head)
                if data.draw(st.integers(0, 4))
                else data.draw(_record_bytes("blob", st))
            )
            kvs.append((head_raw, _Meta(key.encode())))
        for _ in range(data.draw(st.integers(0, 2))):  # stray keys under the blob's range
            suffix = data.draw(st.one_of(st.text(max_size=8).map(str.encode), st.binary(max_size=8)))
            kvs.append((data.draw(st.binary(max_size=16)), _Meta(key.encode() + b"/" + suffix)))
        order = data.draw(st.permutations(list(range(len(kvs)))))
        kvs = [kvs[i] for i in order]
        return lambda: blobs.blob_from_kvs(key, kvs)
    if target == "manifest_from_record":
        cols = data.draw(_manifest_columns(st))
        try:
            mid = shard_tables.manifest_id_of(cols)
        except Exception:
            mid = "0" * 24
        if data.draw(st.integers(0, 9)) == 0:
            mid = data.draw(st.from_regex(r"[0-9a-f]{24}", fullmatch=True))
        raw = msgpack.packb({"schema": "manifest/1", "manifest_id": mid, **cols}, use_bin_type=True)

        def go() -> Any:
            m = shard_tables.manifest_from_record(codec.decode("manifest", raw), mid)
            return m.records(0)

        return go
    if target == "layout_from_record":
        shards = [
            ShardRecord("w", "float32", (8, 6), Box((0, 0), (4, 6)), (6, 1), 0, 0, 0),
            ShardRecord("b", "bfloat16", (6,), Box((0,), (6,)), (1,), 0, 0, 96),
            ShardRecord("n", "int64", (), Box((), ()), (), 0, 1, 0),
        ]
        man_rec = shard_tables.manifest_record(shards)
        manifest = shard_tables.manifest_from_record(man_rec, man_rec["manifest_id"])
        good = shard_tables.layout_record(3, 1, manifest, shards, b"\x80")
        rec = dict(good)
        for field in data.draw(
            st.lists(
                st.sampled_from(
                    [
                        "strides",
                        "regions",
                        "byte_offsets",
                        "epoch",
                        "rank",
                        "transport",
                        "manifest_id",
                        "packed",
                    ]
                ),
                max_size=3,
            )
        ):
            if field in ("strides", "regions", "byte_offsets"):
                rec[field] = _i64s(data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6)))
            elif field in ("epoch", "rank"):
                rec[field] = data.draw(st.integers(0, 5))
            elif field == "transport":
                rec[field] = data.draw(st.binary(max_size=16))
            elif field == "manifest_id":
                rec[field] = data.draw(st.from_regex(r"[0-9a-f]{24}", fullmatch=True))
            else:
                p = data.draw(_manifest_columns(st))
                m = len(p["names"])
                p["regions"] = _i64s(data.draw(st.lists(st.integers(-2, 3), min_size=m, max_size=m + 1)))
                p["byte_offsets"] = _i64s(
                    data.draw(st.lists(st.integers(-2, 2**40), min_size=m, max_size=m + 1))
                )
                rec["packed"] = p
        rec.pop("layout_id", None)
        lid = shard_tables.layout_id_of(rec) if data.draw(st.integers(0, 9)) else good["layout_id"]
        rec["layout_id"] = lid
        epoch, rank = data.draw(st.sampled_from([(3, 1), (None, None), (rec["epoch"], rec["rank"]), (0, 0)]))
        raw = msgpack.packb({"schema": "layout/1", **rec}, use_bin_type=True)

        def go_layout() -> Any:
            lay = shard_tables.layout_from_record(
                codec.decode("layout", raw), manifest, key_id=lid, epoch=epoch, rank=rank
            )
            return (lay.shards, lay.packed)

        return go_layout
    if target == "version_from_kvs":
        ns, step = "fz", data.draw(st.integers(0, 3))
        pre = f"/astate/{ns}/versions/{records.pad20(step)}/"
        epoch, world = data.draw(st.integers(0, 2)), data.draw(st.integers(1, 2))
        good = {"commit": {"step": step, "epoch": epoch, "world_size": world, "committed_at": 1.0}}
        kvs = [(codec.encode("commit", good["commit"]), _Meta((pre + "commit").encode()))]
        for r in range(world):
            kvs.append(
                (
                    codec.encode(
                        "piece",
                        {
                            "step": step,
                            "epoch": epoch,
                            "rank": r,
                            "world_size": world,
                            "layout_id": "b" * 24,
                            "base_offset": 0,
                            "manifest_id": "a" * 24,
                        },
                    ),
                    _Meta((pre + f"pieces/{records.pad20(epoch)}/{records.pad20(r)}").encode()),
                )
            )
        if data.draw(st.booleans()):
            kvs.append(
                (
                    codec.encode(
                        "replica",
                        {
                            "step": step,
                            "group": "g",
                            "member": "m",
                            "layout_id": "b" * 24,
                            "manifest_id": "a" * 24,
                        },
                    ),
                    _Meta((pre + "replicas/g/m").encode()),
                )
            )
        for _ in range(data.draw(st.integers(0, 2))):  # what a hostile writer adds or overwrites
            e, r = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
            kind, suffix = data.draw(
                st.sampled_from(
                    [
                        ("commit", "commit"),
                        ("piece", f"pieces/{records.pad20(e)}/{records.pad20(r)}"),
                        ("replica", f"replicas/g{r}/m{e}"),
                        ("piece", "pieces/x/y"),
                        ("piece", f"pieces/{e}"),
                        ("piece", f"pieces/{e}/{r}/z"),
                        ("commit", "commit/extra"),
                        ("replica", "replicas/g"),
                        ("replica", "replicas/a/b/c"),
                        ("raw", None),
                        ("raw", ""),
                    ]
                )
            )
            if suffix is None:
                kb = pre.encode() + data.draw(st.binary(max_size=12))
            else:
                kb = (pre + suffix).encode()
            value = data.draw(st.binary(max_size=32)) if kind == "raw" else data.draw(_record_bytes(kind, st))
            kvs.append((value, _Meta(kb)))
        order = data.draw(st.permutations(list(range(len(kvs)))))
        kvs = [kvs[i] for i in order]
        return lambda: records.version_from_kvs(ns, step, kvs)
    raise ValueError(f"unknown fuzz target {target!r}")


def _closure_repr(fn: Callable[[], Any]) -> str:
    """The drawn input of a fuzz call (its closure's data, not modules or functions), for the report."""
    import types

    cells = getattr(fn, "__closure__", None) or ()
    vals = [
        c.cell_contents
        for c in cells
        if not isinstance(c.cell_contents, (types.ModuleType, types.FunctionType))
        and not callable(c.cell_contents)
    ]
    return repr(vals)[:700]


def op_fuzz(state: dict[str, Any], target: str, examples: int, seed: int) -> dict[str, Any]:
    """``examples`` hypothesis examples through one decoder. Each example is a trial: it decoded
    (``ok``), raised a typed error (``CodecError`` / ``AStateError``), or crashed (anything else:
    counted, with the first few inputs and tracebacks)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from astate_store import AStateError

    counts = {"trials": 0, "ok": 0, "typed": 0, "crashes": 0}
    crashes: list[dict[str, Any]] = []
    seen: set[str] = set()

    @hseed(seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @given(st.data())
    def run(data: Any) -> None:
        call = _fuzz_call(target, data, st)
        counts["trials"] += 1
        try:
            call()
            counts["ok"] += 1
        except AStateError:
            counts["typed"] += 1
        except Exception as exc:
            counts["crashes"] += 1
            tb = traceback.extract_tb(exc.__traceback__)
            where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno} {tb[-1].name}" if tb else "?"
            sig = f"{type(exc).__name__} at {where}"
            if sig not in seen and len(crashes) < 6:
                seen.add(sig)
                crashes.append({"signature": sig, "msg": str(exc)[:200], "input": _closure_repr(call)})

    run()
    return {**counts, "crash_examples": crashes}

"""msgpack codec for every record written to etcd or a checkpoint.

The record definitions live in ``schemas/*.json`` (JSON Schema, draft 2020-12); this module
loads them once and validates every record it encodes or decodes against them, so a
record that does not match its schema never reaches etcd and never reaches the caller.
Only the subset of JSON Schema the files use is interpreted: type, const, enum,
properties, required, additionalProperties, items, minimum, pattern, $ref into $defs,
and ``contentEncoding: base64`` meaning "msgpack bin" (bytes).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from astate_store.errors import CodecError

__all__ = ["KINDS", "encode", "decode", "encode_counter", "decode_counter", "schema_of", "schema_dir"]

SCHEMA_VERSION = 1
_COUNTER_WIDTH = 20


def schema_dir() -> Path:
    """Where the schema files are: ``schemas/`` of the source tree (linked as ``_schemas``)."""
    here = Path(__file__).resolve().parents[1]  # the package root (this file is in model/)
    for cand in (here / "_schemas", here.parent / "schemas"):
        if (cand / "commit.json").is_file():
            return cand
    raise CodecError(f"schema files not found next to {here}")


@functools.cache
def _schemas() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(schema_dir().glob("*.json")):
        out[path.stem] = json.loads(path.read_text())
    return out


def schema_of(kind: str) -> dict[str, Any]:
    try:
        return _schemas()[kind]
    except KeyError:
        raise CodecError(f"unknown record kind {kind!r}; known: {sorted(_schemas())}") from None


KINDS = (
    "session",
    "member",
    "layout",
    "piece",
    "commit",
    "reader",
    "retired",
    "replica",
    "consumer",
    "ucx_descriptor",
    "checkpoint",
    "blob",
    "manifest",
    "recovery_plan",
    "recovery_outcome",
    "meta",
    "delta",
)


def _fail(kind: str, path: str, msg: str) -> CodecError:
    return CodecError(f"{kind} record invalid at {path or '<root>'}: {msg}")


_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, (list, tuple)),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _validate(kind: str, node: dict[str, Any], value: Any, path: str, defs: dict[str, Any]) -> None:
    if "$ref" in node:
        ref = node["$ref"]
        node = defs[ref.rsplit("/", 1)[-1]]
    if "const" in node and value != node["const"]:
        raise _fail(kind, path, f"expected {node['const']!r}, got {value!r}")
    if "enum" in node and value not in node["enum"]:
        raise _fail(kind, path, f"{value!r} is not one of {node['enum']}")
    typ = node.get("type")
    if typ == "string" and node.get("contentEncoding") == "base64":
        if not isinstance(value, (bytes, bytearray)):
            raise _fail(kind, path, f"expected bytes, got {type(value).__name__}")
        return
    if typ is not None and not _TYPES[typ](value):
        raise _fail(kind, path, f"expected {typ}, got {type(value).__name__} {value!r:.80}")
    if "minimum" in node and value < node["minimum"]:
        raise _fail(kind, path, f"{value} is below the minimum {node['minimum']}")
    if "pattern" in node and not _compiled(node["pattern"]).search(value):
        raise _fail(kind, path, f"{value!r} does not match {node['pattern']}")
    if typ == "object":
        props = node.get("properties", {})
        for req in node.get("required", ()):
            if req not in value:
                raise _fail(kind, path, f"missing field {req!r}")
        for key, item in value.items():
            if key in props:
                _validate(kind, props[key], item, f"{path}.{key}" if path else key, defs)
            elif node.get("additionalProperties", True) is False:
                raise _fail(kind, path, f"unknown field {key!r}")
    elif typ == "array" and "items" in node:
        if "maxItems" in node and len(value) > node["maxItems"]:
            raise _fail(kind, path, f"{len(value)} items, at most {node['maxItems']} allowed")
        items = node["items"]
        if _all_plain(items, value):
            return
        for i, item in enumerate(value):  # finds the bad item and names it
            _validate(kind, items, item, f"{path}[{i}]", defs)


def _all_plain(items: dict[str, Any], value: Any) -> bool:
    """Whether every element passes an item schema of only ``type`` (and ``pattern``), checked
    in one pass (a manifest lists 10^4-10^5 tensor names); False also means "look closer"."""
    typ = items.get("type")
    if typ is None or typ == "object" or not items.keys() <= {"type", "pattern"}:
        return False
    if not all(map(_TYPES[typ], value)):
        return False
    pattern = items.get("pattern")
    if pattern is None:
        return True
    return typ == "string" and all(map(_compiled(pattern).search, value))


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def validate(kind: str, record: dict[str, Any]) -> None:
    """Check a record against ``schemas/<kind>.json``.

    Raises:
        CodecError: the record does not match, naming the field.
    """
    schema = schema_of(kind)
    _validate(kind, schema, record, "", schema.get("$defs", {}))


def encode(kind: str, record: dict[str, Any]) -> bytes:
    """Encode a record (without its ``schema`` field, which is added) to msgpack bytes.

    Raises:
        CodecError: the record does not match its schema.
    """
    full = {"schema": f"{kind}/{SCHEMA_VERSION}", **record}
    validate(kind, full)
    return msgpack.packb(full, use_bin_type=True)


def decode(kind: str, data: bytes) -> dict[str, Any]:
    """Decode and validate msgpack bytes of a ``kind`` record; returns it without ``schema``.

    Raises:
        CodecError: truncated or malformed bytes, a record of another kind, an unknown
            schema version, or fields that do not match the schema.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"{kind} record: expected bytes, got {type(data).__name__}")
    try:
        record = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except msgpack.ExtraData:
        raise CodecError(f"{kind} record: trailing bytes after the record") from None
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise CodecError(f"{kind} record: malformed or truncated msgpack ({exc})") from None
    if not isinstance(record, dict):
        raise CodecError(f"{kind} record: expected a map, got {type(record).__name__}")
    tag = record.get("schema")
    if not isinstance(tag, str) or "/" not in tag:
        raise CodecError(f"{kind} record: missing or bad schema tag {tag!r}")
    got_kind, _, version = tag.partition("/")
    if got_kind != kind:
        raise CodecError(f"expected a {kind} record, got a {got_kind} record")
    if version != str(SCHEMA_VERSION):
        raise CodecError(
            f"{kind} record: unknown schema version {version!r} (this build reads {SCHEMA_VERSION}); "
            "upgrade astate-store"
        )
    validate(kind, record)
    del record["schema"]
    return record


def encode_counter(value: int | None) -> bytes:
    """A counter as 20 ASCII digits (empty for None), so etcd can compare it bytewise."""
    if value is None:
        return b""
    if not isinstance(value, int) or value < 0 or value >= 10**_COUNTER_WIDTH:
        raise CodecError(f"counter out of range: {value!r}")
    return b"%020d" % value


def decode_counter(data: bytes | None) -> int | None:
    if data is None or data == b"":
        return None
    if len(data) != _COUNTER_WIDTH or not data.isdigit():
        raise CodecError(f"counter record: expected 20 ASCII digits, got {bytes(data)[:40]!r}")
    return int(data)

"""The on-disk format: constants, file names, the manifest schema, and manifest rows <-> ShardRecords.

Pure: no filesystem access (``storage``) and no checksums (``checksum``).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from astate_store.errors import LayoutError
from astate_store.model.dtypes import DTYPES, itemsize
from astate_store.model.layout import Box, ShardRecord, contiguous_strides

__all__ = [
    "FORMAT",
    "ALIGN",
    "BLOCK_SIZE",
    "COMMIT_NAME",
    "MANIFEST_SCHEMA",
    "STEP_RE",
    "DATA_RE",
    "step_dir_name",
    "data_file_name",
    "part_name",
    "manifest_name",
    "align_up",
    "manifest_table",
    "manifest_records",
    "parquet_bytes",
    "parquet_meta",
]

#: Format tag in every part manifest, merged manifest and commit marker.
FORMAT = "astate-checkpoint/1"
#: Byte alignment of every shard inside a data file.
ALIGN = 4096
#: Default checksum block: shard bytes ``[k * block_size, (k + 1) * block_size)`` are block ``k``.
BLOCK_SIZE = 4 << 20
COMMIT_NAME = "COMMIT"
#: Parquet key-value metadata key of part and merged manifests.
META_KEY = "astate.checkpoint"

STEP_RE = re.compile(r"^step-(\d{20})$")
#: A data file, or a temporary one a crashed writer left (``storage.temp_path``).
DATA_RE = re.compile(r"^rank-\d{5}-[0-9a-f]+\.bin(\.tmp-[0-9a-f]+)?$")

#: One row per shard. ``offsets``/``sizes``/``global_shape`` in elements; ``byte_offset``/``length`` in
#: bytes of ``file`` (relative to the step directory); ``checksums[k]`` covers shard bytes
#: ``[k * block_size, min((k + 1) * block_size, length))``.
MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("global_shape", pa.list_(pa.int64()), nullable=False),
        pa.field("offsets", pa.list_(pa.int64()), nullable=False),
        pa.field("sizes", pa.list_(pa.int64()), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("file", pa.string(), nullable=False),
        pa.field("byte_offset", pa.int64(), nullable=False),
        pa.field("length", pa.int64(), nullable=False),
        pa.field("block_size", pa.int64(), nullable=False),
        pa.field("checksums", pa.list_(pa.uint64()), nullable=False),
    ]
)


def step_dir_name(step: int) -> str:
    return f"step-{step:020d}"


def data_file_name(rank: int) -> str:
    """A fresh data file name: the random token keeps a rewrite off files another part refers to."""
    return f"rank-{rank:05d}-{uuid.uuid4().hex[:16]}.bin"


def part_name(rank: int) -> str:
    return f"rank-{rank:05d}.part.parquet"


def manifest_name(crc32: int) -> str:
    """Content-named, so that concurrent committers write the same file."""
    return f"manifest-{crc32:08x}.parquet"


def align_up(pos: int) -> int:
    return -(-pos // ALIGN) * ALIGN


def manifest_table(
    rows: Sequence[ShardRecord],
    rank_of: Sequence[int],
    files: Sequence[str],
    offsets: Sequence[int],
    sums: Sequence[Sequence[int]],
    block_size: int,
) -> pa.Table:
    """Manifest rows of ``rows`` (a record's own rank/byte_offset are not used: ``rank_of``, ``offsets``)."""
    return pa.table(
        {
            "name": [r.name for r in rows],
            "dtype": [r.dtype for r in rows],
            "global_shape": [list(r.global_shape) for r in rows],
            "offsets": [list(r.box.offsets) for r in rows],
            "sizes": [list(r.box.sizes) for r in rows],
            "rank": list(rank_of),
            "file": list(files),
            "byte_offset": list(offsets),
            "length": [r.nbytes for r in rows],
            "block_size": [block_size] * len(rows),
            "checksums": [list(s) for s in sums],
        },
        schema=MANIFEST_SCHEMA,
    )


def manifest_records(table: pa.Table, file_index: Mapping[str, int] | None = None) -> list[ShardRecord]:
    """Manifest rows as dense ShardRecords at their byte offsets; ``rank`` is the row's rank, or with
    ``file_index`` the index of its data file (the planner's source id when restoring).

    Raises:
        LayoutError: an unknown dtype, or a length that does not match the sizes.
    """
    cols = table.to_pydict()
    files = cols["file"]
    out = []
    for i in range(table.num_rows):
        sizes = tuple(cols["sizes"][i])
        dt = cols["dtype"][i]
        if dt not in DTYPES:
            raise LayoutError(f"tensor {cols['name'][i]!r}: unknown dtype {dt!r}")
        if cols["length"][i] != math.prod(sizes) * itemsize(dt):
            raise LayoutError(
                f"tensor {cols['name'][i]!r}: length {cols['length'][i]} does not match sizes {sizes}"
            )
        out.append(
            ShardRecord(
                cols["name"][i],
                dt,
                tuple(cols["global_shape"][i]),
                Box(tuple(cols["offsets"][i]), sizes),
                contiguous_strides(sizes),
                file_index[files[i]] if file_index is not None else int(cols["rank"][i]),
                0,
                int(cols["byte_offset"][i]),
            )
        )
    return out


def parquet_bytes(table: pa.Table, meta: dict[str, Any]) -> bytes:
    """``table`` as zstd Parquet bytes, with ``meta`` as its JSON key-value metadata."""
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()  # type: ignore[no-any-return]


def parquet_meta(table: pa.Table) -> dict[str, Any]:
    """The metadata ``parquet_bytes`` stored.

    Raises:
        ValueError: none, or of another format.
    """
    raw = (table.schema.metadata or {}).get(META_KEY.encode())
    if raw is None:
        raise ValueError("no astate.checkpoint metadata")
    meta = json.loads(raw)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else meta!r} is not {FORMAT}")
    return meta

"""Checkpoints of a sharded state on any ``pyarrow.fs`` filesystem: write per rank, commit, restore resharded.

Storage only: no etcd, no transport. ``Store.checkpoint`` / ``Store.restore`` call into this package.

On-disk format (``docs/checkpoint.md``, ``schemas/checkpoint_manifest.json``)::

    <uri>/step-<step:020d>/
        rank-<rank:05d>-<token>.bin      shard bytes of one rank, row-major, each shard 4096-aligned
        rank-<rank:05d>.part.parquet     that rank's part manifest (written after its data file)
        manifest-<crc32:08x>.parquet     merged manifest: one row per shard (written by try_commit)
        COMMIT                           JSON commit marker, written LAST; only steps with one exist

Every file is written to a temporary name and renamed into place on filesystems with an atomic
rename (local, HDFS); on object stores (S3, GCS) an object becomes visible whole when its upload
completes. A reader accepts a step only when ``COMMIT`` exists, and ``COMMIT`` names the manifest
(with its size and crc32) and the size of every data file, so a crash at any point leaves either the
previous complete checkpoint or the new complete one.

Checksums: the bytes of each shard are cut into ``block_size`` blocks (4 MiB) counted from the
shard's first byte; the manifest keeps one checksum per block (``xxh3_64`` from the ``xxhash``
package by default when it is installed, else ``zlib.crc32``). A restore verifies exactly the
blocks it reads.

Modules: ``format`` (names, manifest schema), ``storage`` (URIs, atomic writes, the crash-test hook),
``checksum``, ``writer`` (``write_part``), ``retention`` (the keep_last / keep_every policy, pure),
``leases`` (reader leases, the ``REMOVING`` tombstone, ``apply_retention``,
``remove_checkpoint``), ``async_writer`` (``AsyncCheckpointer``), ``commit`` (``try_commit``), ``index``
(what is committed), ``restore`` and ``reads`` (its read side), ``verify``
(every block checked without restoring).
"""

from __future__ import annotations

from collections.abc import Callable

from astate_store.checkpoint.async_writer import AsyncCheckpointer
from astate_store.checkpoint.checksum import CHECKSUMS, DEFAULT_CHECKSUM
from astate_store.checkpoint.commit import try_commit
from astate_store.checkpoint.format import ALIGN, BLOCK_SIZE, COMMIT_NAME, FORMAT, MANIFEST_SCHEMA  # noqa: F401  (COMMIT_NAME: as before)
from astate_store.checkpoint.index import (
    CheckpointInfo,
    checkpoint_info,
    list_checkpoints,
    read_manifest,
    read_meta,
)
from astate_store.checkpoint.leases import (
    LEASE_TTL,
    ReaderLease,
    RetentionResult,
    apply_retention,
    live_readers,
    policy_view,
    remove_checkpoint,
)
from astate_store.checkpoint.restore import restore
from astate_store.checkpoint.retention import RetentionPolicy, keep_reasons
from astate_store.checkpoint.storage import URI  # noqa: F401  (the uri type, importable as before)
from astate_store.checkpoint.verify import VerifyResult, verify
from astate_store.checkpoint.writer import PartInfo, local_shards, owned_shards, write_part

__all__ = [
    "FORMAT",
    "ALIGN",
    "BLOCK_SIZE",
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "MANIFEST_SCHEMA",
    "PartInfo",
    "CheckpointInfo",
    "AsyncCheckpointer",
    "local_shards",
    "owned_shards",
    "write_part",
    "try_commit",
    "list_checkpoints",
    "checkpoint_info",
    "read_meta",
    "read_manifest",
    "restore",
    "verify",
    "VerifyResult",
    "LEASE_TTL",
    "ReaderLease",
    "RetentionPolicy",
    "RetentionResult",
    "keep_reasons",
    "apply_retention",
    "policy_view",
    "live_readers",
    "remove_checkpoint",
]

#: Crash-test hook: tests set this in a child process to pause or die at a named point
#: ("data_started", "data_written", "part_written", "manifest_written", "committed").
#: ``storage.hook`` reads it from here at each point, so setting it on the package is enough.
_TEST_HOOK: Callable[[str], None] | None = None

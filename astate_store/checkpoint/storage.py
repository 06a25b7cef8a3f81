"""Filesystem access: checkpoint URIs resolved to a ``pyarrow.fs`` location, atomic small-file
writes, fsync, and the crash-test hook that marks each step of a write.
"""

from __future__ import annotations

import os
import posixpath
import sys
import uuid
from dataclasses import dataclass
from typing import Union

import pyarrow as pa
import pyarrow.fs as pafs

from astate_store.checkpoint.format import step_dir_name
from astate_store.errors import CheckpointError

__all__ = ["URI", "Location", "resolve", "read_all", "fsync_path", "temp_path", "put_atomic", "hook"]

URI = Union[str, "os.PathLike[str]", tuple]


@dataclass(frozen=True)
class Location:
    """A checkpoint root: the filesystem, the root path on it, and the URI as the user wrote it."""

    fs: pafs.FileSystem
    root: str
    uri: str

    @property
    def local(self) -> bool:
        return self.fs.type_name == "local"

    @property
    def renames(self) -> bool:
        """Whether ``move`` is an atomic rename (else each object appears whole on close)."""
        return self.fs.type_name in ("local", "hdfs")

    def step_dir(self, step: int) -> str:
        return posixpath.join(self.root, step_dir_name(step)) if self.root else step_dir_name(step)


def resolve(uri: URI) -> Location:
    """``uri``: a local path, a URI pyarrow understands (file://, s3://, gs://, hdfs://, ...), or a
    ``(pyarrow.fs.FileSystem, path)`` pair for a filesystem configured by the caller.

    Raises:
        CheckpointError: a bad URI, or one pyarrow cannot open.
    """
    if isinstance(uri, tuple):
        fs, path = uri
        if not isinstance(fs, pafs.FileSystem):
            raise CheckpointError(f"uri pair must be (pyarrow.fs.FileSystem, path), got {type(fs).__name__}")
        return Location(fs, str(path).rstrip("/"), f"{fs.type_name}:{path}")
    text = os.fspath(uri)
    if not isinstance(text, str) or not text:
        raise CheckpointError(f"bad checkpoint uri {uri!r}")
    if "://" not in text:
        text = os.path.abspath(text)
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot open checkpoint uri {text!r}: {exc}") from exc
    return Location(fs, path.rstrip("/") if path != "/" else path, text)


def read_all(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path, compression=None) as f:
        return f.read()  # type: ignore[no-any-return]


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(loc: Location, path: str) -> str:
    """Where to write ``path`` first: a temporary name to rename from where renames are atomic, else
    ``path`` itself (an object store publishes an object whole when its upload completes)."""
    return f"{path}.tmp-{uuid.uuid4().hex[:12]}" if loc.renames else path


def put_atomic(loc: Location, path: str, data: bytes, *, fsync: bool, sync_dir: bool = True) -> None:
    """Write a small file so that readers see either nothing / the old content or all of it.

    With ``fsync`` (local filesystems) the content is flushed before the rename, so after a machine
    crash the name never points at a short file; ``sync_dir`` also flushes the directory entry."""
    target = temp_path(loc, path)
    with loc.fs.open_output_stream(target, compression=None) as out:
        out.write(data)
    if loc.local and fsync:
        fsync_path(target)
    if target != path:
        loc.fs.move(target, path)
    if loc.local and fsync and sync_dir:
        fsync_path(posixpath.dirname(path), directory=True)


def hook(point: str) -> None:
    """Call the package's crash-test hook ``_TEST_HOOK`` at ``point`` ("data_started", "data_written",
    "part_written", "manifest_written", "committed"); tests set it in a child process to pause or die there.

    Looked up on the package at each call, so ``astate_store.checkpoint._TEST_HOOK = f`` takes effect
    in every module of it."""
    fn = getattr(sys.modules.get(__package__ or ""), "_TEST_HOOK", None)
    if fn is not None:
        fn(point)

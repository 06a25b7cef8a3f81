"""Hugging Face safetensors in and out of a store: ``astate export`` / ``astate import``.

- :func:`export_version` pulls one committed version into freshly allocated whole tensors (global
  shapes and dtypes from the version's manifests, filled by the ordinary ``get_into``) and writes
  them as HF safetensors shards of at most ``max_shard_bytes`` each,
  ``model-00001-of-0000N.safetensors``, plus ``model.safetensors.index.json`` (``weight_map`` and
  ``metadata.total_size``), the layout ``transformers`` loads.
- :func:`import_dir` publishes a HF safetensors checkpoint (one file, a directory of files, or an
  index) as a version **without copying it**: ``safetensors.safe_open`` maps each file (a private
  memory map), every tensor is a view into that mapping, and ``put(..., copy=False)`` registers and
  publishes those views in place. The bytes live in the importing process, so it must keep
  running (and keep the returned :class:`ImportedCheckpoint` alive) while consumers pull.

The safetensors file format (an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}`` plus ``__metadata__``, then the raw bytes) is written
here directly, streaming each tensor's bytes, so an export never holds a second copy of a shard.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from astate_store.errors import LayoutError
from astate_store.model.dtypes import dtype_name, itemsize
from astate_store.model.layout import validate_name
from astate_store.model.progress import Progress, ProgressCounter

if TYPE_CHECKING:
    from astate_store.store import Store

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "ExportResult",
    "ImportedCheckpoint",
    "parse_size",
    "shard_names",
    "export_version",
    "write_safetensors",
    "safetensors_files",
    "load_dir",
    "import_dir",
]

log = logging.getLogger("astate_store")

#: transformers' default ``max_shard_size`` ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
INDEX_NAME = "model.safetensors.index.json"
_WRITE_CHUNK = 16 << 20

# astate dtype name <-> safetensors dtype code
_TO_ST = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KI": 2**10,
    "KIB": 2**10,
    "MI": 2**20,
    "MIB": 2**20,
    "GI": 2**30,
    "GIB": 2**30,
    "TI": 2**40,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """``"5GB"`` (10^9, as transformers counts), ``"500MiB"`` (2^20), ``"4096"`` -> bytes.

    Raises:
        LayoutError: not a positive size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise LayoutError(f"bad size {text!r}: use e.g. 5GB, 500MB, 512MiB or a number of bytes")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n <= 0:
        raise LayoutError(f"bad size {text!r}: must be > 0 bytes")
    return n


def shard_names(n: int) -> list[str]:
    """HF's shard file names: ``model-00001-of-00003.safetensors`` ..."""
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _groups(sizes: Sequence[tuple[str, int]], cap: int) -> list[list[str]]:
    """Tensors in order, cut into files of at most ``cap`` bytes (a tensor larger than the cap
    gets a file of its own, as transformers does)."""
    out: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if out[-1] and used + n > cap:
            out.append([])
            used = 0
        out[-1].append(name)
        used += n
    return out if out[0] else []


# ---- writing -----------------------------------------------------------------------------------


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    head: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        head[name] = {
            "dtype": _TO_ST[dtype_name(t.dtype, tensor=name)],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-aligned, as the format's own writer does


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    counter: ProgressCounter | None = None,
) -> int:
    """Write one safetensors file (to a temporary name, renamed into place); returns its size.
    Tensors are written from their own memory (CPU, contiguous ones without a copy)."""
    path = Path(path)
    head = _header(tensors, metadata or {})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for t in tensors.values():
                flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                for i in range(0, len(flat), _WRITE_CHUNK):
                    part = flat[i : i + _WRITE_CHUNK]
                    f.write(memoryview(part))
                    if counter is not None:
                        counter.add(len(part))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_version` wrote."""

    step: int
    directory: str
    files: list[str]
    total_size: int
    tensors: int


def export_version(
    store: Store,
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    timeout: float | None = 60.0,
    progress: Progress | None = None,
) -> ExportResult:
    """Write a committed version of ``store``'s namespace as HF safetensors files in ``directory``.

    Args:
        step: the oldest acceptable step, as in ``get_into``: the newest committed version >= it
            is exported (None: the newest). The step exported is in the result, in every file's
            ``__metadata__`` (``astate_step``) and in the index's ``metadata``.
        max_shard_bytes: the most tensor bytes per file.
        timeout: seconds to wait for the version.
        progress: ``progress(done, total)`` over twice the version's bytes: the pull, then the
            writing (:mod:`astate_store.model.progress`).

    Raises:
        WaitTimeout: no such version within ``timeout``.
        LayoutError: a dtype safetensors cannot hold.
        CatalogError, TransportError: from the pull.
    """
    cap = parse_size(max_shard_bytes)
    want = store.wait(step, timeout=timeout)  # the newest >= step: checked before any byte moves
    for name, info in store.keys(want).items():
        if info.dtype not in _TO_ST:
            raise LayoutError(f"tensor {name!r}: dtype {info.dtype} has no safetensors code")
    # The pull is the first half of the progress, the writing the second.
    pull = None if progress is None else (lambda done, total: progress(done, 2 * total))
    got, buffers = store.get(step=want, timeout=timeout, progress=pull)
    total = sum(t.numel() * t.element_size() for t in buffers.values())
    counter = ProgressCounter(progress, 2 * total, done=total)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    groups = _groups([(n, t.numel() * t.element_size()) for n, t in buffers.items()], cap)
    names = shard_names(len(groups))
    meta = {"format": "pt", "astate_namespace": store.namespace, "astate_step": str(got)}
    weight_map: dict[str, str] = {}
    for fname, group in zip(names, groups):
        write_safetensors(out / fname, {n: buffers[n] for n in group}, meta, counter)
        weight_map.update({n: fname for n in group})
    index = {
        "metadata": {"total_size": total, "astate_namespace": store.namespace, "astate_step": got},
        "weight_map": weight_map,
    }
    tmp = out / f".{INDEX_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / INDEX_NAME)
    counter.finish()
    log.info(
        "exported %s step %d: %d tensors, %d bytes in %d files under %s",
        store.namespace,
        got,
        len(buffers),
        total,
        len(names),
        out,
    )
    return ExportResult(got, str(out), names, total, len(buffers))


# ---- reading -----------------------------------------------------------------------------------


def safetensors_files(path: str | os.PathLike[str]) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and its index's ``weight_map`` (None without one):
    ``path`` is a ``.safetensors`` file, an index file, or a directory holding an index or
    ``*.safetensors`` files.

    Raises:
        LayoutError: nothing to import there, or an index that is not a safetensors index.
    """
    p = Path(path)
    index = p if p.is_file() and p.name.endswith(".json") else (p / INDEX_NAME if p.is_dir() else None)
    if index is not None and index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("weight_map is not a mapping of names to files")
        except (ValueError, KeyError, TypeError) as exc:
            raise LayoutError(f"{index}: not a safetensors index ({exc})") from None
        files = sorted({index.parent / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise LayoutError(f"{index}: its weight_map names files that do not exist: {missing[:4]}")
        return files, weight_map
    if p.is_file():
        return [p], None
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise LayoutError(f"{path}: no {INDEX_NAME} and no *.safetensors files to import")
    return files, None


@dataclass
class ImportedCheckpoint:
    """Tensors mapped from safetensors files (views into private memory maps, no copy), and the
    open files they come from; keep it alive while they are published."""

    files: list[Path]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    total_size: int = 0
    step: int | None = None
    _handles: list[Any] = field(default_factory=list, repr=False)

    def close(self) -> None:
        """Drop the tensors and the files (the mappings go once nothing else holds the tensors)."""
        self.tensors.clear()
        self._handles.clear()


def load_dir(path: str | os.PathLike[str], *, progress: Progress | None = None) -> ImportedCheckpoint:
    """Map a safetensors checkpoint: every tensor a view into its file's private memory map.

    Raises:
        LayoutError: a bad or unsupported tensor (dtype, name), a name in two files, or an index
            that disagrees with the files — naming the tensor, before anything is published.
    """
    from safetensors import safe_open

    files, weight_map = safetensors_files(path)
    ck = ImportedCheckpoint(files)
    handles = []
    where: dict[str, Path] = {}
    for f in files:
        try:
            h = safe_open(str(f), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError on a malformed header
            raise LayoutError(f"{f}: not a safetensors file ({exc})") from None
        handles.append((f, h))
        for name in h.keys():
            validate_name(name)
            if name in where:
                raise LayoutError(f"tensor {name!r} is in both {where[name].name} and {f.name}")
            where[name] = f
    if weight_map is not None:
        for name, fname in weight_map.items():
            if where.get(name) is None or where[name].name != Path(fname).name:
                raise LayoutError(
                    f"tensor {name!r}: the index places it in {fname}, "
                    f"{'it is in ' + where[name].name if name in where else 'no file holds it'}"
                )
    sizes = {}
    for f, h in handles:
        for name in h.keys():
            sl = h.get_slice(name)
            dt = sl.get_dtype()
            if dt not in _TO_ST.values():
                raise LayoutError(
                    f"tensor {name!r} in {f.name}: safetensors dtype {dt} is not supported "
                    f"({', '.join(sorted(_TO_ST.values()))})"
                )
            sizes[name] = itemsize(next(k for k, v in _TO_ST.items() if v == dt)) * _numel(sl.get_shape())
    counter = ProgressCounter(progress, sum(sizes.values()))
    for f, h in handles:
        for name in sorted(h.keys()):
            ck.tensors[name] = h.get_tensor(name)  # a view into the file's mapping: nothing is read yet
            counter.add(sizes[name])
    ck.total_size = sum(sizes.values())
    ck._handles = [h for _f, h in handles]
    counter.finish()
    return ck


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def import_dir(
    store: Store, path: str | os.PathLike[str], step: int, *, progress: Progress | None = None
) -> ImportedCheckpoint:
    """Publish a HF safetensors checkpoint as version ``step`` of ``store``'s namespace, in place
    (memory-mapped, ``put(copy=False)``). The store must be a single-rank publisher (world size 1).
    Keep the result alive, and this process running, while consumers pull; to stop serving,
    ``store.close()`` (which retires the version) and then ``result.close()``.

    Raises:
        LayoutError: see :func:`load_dir`.
        StaleStepError: ``step`` is older than the namespace's newest committed step.
    """
    ck = load_dir(path, progress=progress)
    if not ck.tensors:
        raise LayoutError(f"{path}: the checkpoint holds no tensors")
    store.put(step, ck.tensors, copy=False)
    ck.step = step
    log.info(
        "imported %s as %s step %d: %d tensors, %d bytes, served from memory-mapped files",
        path,
        store.namespace,
        step,
        len(ck.tensors),
        ck.total_size,
    )
    return ck

"""``verify``: check every block of a committed checkpoint against its manifest, without restoring it.

What ``astate checkpoint verify`` runs: the commit marker and the manifest are checked as a restore
checks them (size and crc32), then every data file's size, then the checksum of every block of
every shard. Damage is collected, not raised at the first bad block, so one run names all of it.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs

from astate_store.checkpoint.checksum import CHECKSUMS
from astate_store.checkpoint.index import load_manifest, load_marker
from astate_store.checkpoint.leases import ReaderLease
from astate_store.checkpoint.restore import checksum_arrays
from astate_store.checkpoint.storage import URI, Location, resolve
from astate_store.errors import CheckpointCorrupted, CheckpointError
from astate_store.model.layout import check_step
from astate_store.model.progress import Progress, ProgressCounter

__all__ = ["VerifyResult", "verify"]


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify` checked and what it found wrong (``problems`` empty: intact)."""

    step: int
    uri: str
    files: int
    shards: int
    bytes: int
    blocks: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(uri: URI, step: int | None = None, *, progress: Progress | None = None) -> VerifyResult:
    """Read every shard byte of checkpoint ``step`` (default: the newest complete one) and compare
    each block's checksum with the manifest's.

    Raises:
        CheckpointNotFound: no complete checkpoint (of that step).
        CheckpointCorrupted: the marker or the manifest itself is malformed or fails its check
            (nothing else can be checked then).
    """
    loc = resolve(uri)
    step = load_marker(loc, None)[0] if step is None else check_step(step, CheckpointError)
    with ReaderLease(loc, step):  # retention leaves the step alone while it is read
        return _verify(loc, step, progress)


def _verify(loc: Location, step: int, progress: Progress | None) -> VerifyResult:
    step, marker = load_marker(loc, step)
    table = load_manifest(loc, step, marker)
    if marker["checksum"] not in CHECKSUMS:
        raise CheckpointCorrupted(
            f"step {step}: unknown checksum {marker['checksum']!r} in the commit marker"
        )
    algo = CHECKSUMS[marker["checksum"]]()
    block = int(marker["block_size"])
    cols = table.select(["name", "offsets", "file", "byte_offset", "length"]).to_pydict()
    sums, sum_off = checksum_arrays(table)
    sdir = loc.step_dir(step)
    problems: list[str] = []
    usable = _check_files(loc.fs, sdir, dict(marker["files"]), problems)
    counter = ProgressCounter(progress, sum(cols["length"]))
    blocks = 0
    for fname in sorted(set(cols["file"])):
        rows = [r for r, f in enumerate(cols["file"]) if f == fname]
        if fname not in usable:
            problems += [
                f"tensor {cols['name'][r]!r} (shard at {tuple(cols['offsets'][r])}): its data file "
                f"{fname} is unusable"
                for r in rows
                if fname in marker["files"]
            ]
            if fname not in marker["files"]:
                problems.append(f"data file {fname} is named by the manifest but not by the commit marker")
            counter.add(sum(cols["length"][r] for r in rows))
            continue
        with loc.fs.open_input_file(posixpath.join(sdir, fname)) as f:
            for r in rows:
                name, offs, base, length = (
                    cols["name"][r],
                    tuple(cols["offsets"][r]),
                    cols["byte_offset"][r],
                    cols["length"][r],
                )
                want = sums[int(sum_off[r]) : int(sum_off[r + 1])]
                nblocks = -(-length // block)
                if len(want) != nblocks:
                    problems.append(
                        f"tensor {name!r} (shard at {offs}): the manifest lists {len(want)} checksums, "
                        f"its {length} bytes need {nblocks}"
                    )
                    counter.add(length)
                    continue
                for k in range(nblocks):
                    a = base + k * block
                    n = min(block, length - k * block)
                    got = algo.digest(memoryview(f.read_at(n, a)))
                    blocks += 1
                    if got != int(want[k]):
                        problems.append(
                            f"tensor {name!r} (shard at {offs}) in {fname}: block {k} (file bytes "
                            f"[{a}, {a + n})) fails its checksum (stored {int(want[k]):#x}, read {got:#x})"
                        )
                    counter.add(n)
    if not problems:
        counter.finish()
    return VerifyResult(
        step, loc.uri, len(marker["files"]), table.num_rows, int(sum(cols["length"])), blocks, problems
    )


def _check_files(fs: pafs.FileSystem, sdir: str, files: dict[str, int], problems: list[str]) -> set[str]:
    """The data files that exist with the size the commit marker gives; a problem for each other."""
    names = sorted(files)
    try:
        infos = fs.get_file_info([posixpath.join(sdir, n) for n in names])
    except (OSError, pa.ArrowException) as exc:
        problems.append(f"cannot list the data files under {sdir}: {exc}")
        return set()
    ok = set()
    for n, inf in zip(names, infos):
        if inf.type != pafs.FileType.File:
            problems.append(f"data file {posixpath.join(sdir, n)} is missing")
        elif inf.size != int(files[n]):
            problems.append(
                f"data file {posixpath.join(sdir, n)} has {inf.size} bytes, the commit marker says {files[n]}"
            )
        else:
            ok.add(n)
    return ok

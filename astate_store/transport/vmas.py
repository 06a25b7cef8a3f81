"""Which mapping of another process holds an address: ``/proc/<pid>/maps``, one query at a time.

The same-host path asks two questions of a peer's memory map before it reads that peer's memory
directly: is its proof page private anonymous memory (``same_host``), and which memfd offset backs
a region (``memfd``). Reading the whole text of ``/proc/<pid>/maps`` answers them, but a replica
server that holds a thousand sessions has thousands of mappings: the kernel then writes ~300 KB
of text and Python splits ~3,000 lines per question, once per session a reader opens (a good part
of a session's read-back). Linux 6.11's ``PROCMAP_QUERY`` ioctl on
the same file returns the one mapping that covers an address, so the cost no longer grows with
the peer's mappings; older kernels get the text scan (``ENOTTY``), with the same answers.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from dataclasses import dataclass

__all__ = ["Vma", "MapsReader"]

# struct procmap_query of <linux/fs.h> (Linux 6.11)
_READABLE, _WRITABLE, _SHARED = 0x1, 0x2, 0x8
_NAME_MAX = 256


class _Query(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint64),  # in: sizeof(struct procmap_query)
        ("query_flags", ctypes.c_uint64),  # in: 0 = the mapping covering query_addr
        ("query_addr", ctypes.c_uint64),  # in
        ("vma_start", ctypes.c_uint64),  # out: [vma_start, vma_end)
        ("vma_end", ctypes.c_uint64),
        ("vma_flags", ctypes.c_uint64),  # out: readable / writable / executable / shared bits
        ("vma_page_size", ctypes.c_uint64),
        ("vma_offset", ctypes.c_uint64),  # out: file offset of vma_start
        ("inode", ctypes.c_uint64),  # out: 0 for anonymous memory
        ("dev_major", ctypes.c_uint32),
        ("dev_minor", ctypes.c_uint32),
        ("vma_name_size", ctypes.c_uint32),  # in: buffer size; out: name length + 1, 0 = no name
        ("build_id_size", ctypes.c_uint32),  # in: 0 = not wanted
        ("vma_name_addr", ctypes.c_uint64),  # in: the name buffer
        ("build_id_addr", ctypes.c_uint64),
    ]


_PROCMAP_QUERY = (3 << 30) | (ctypes.sizeof(_Query) << 16) | (ord("f") << 8) | 17  # _IOWR('f', 17, ...)
_ioctl_works = True  # cleared for good at the first ENOTTY / EINVAL (a kernel without the query)


@dataclass(frozen=True)
class Vma:
    """One mapping of ``/proc/<pid>/maps``."""

    start: int
    end: int
    readable: bool
    writable: bool
    private: bool  # not MAP_SHARED ("p" in the text)
    offset: int  # file offset of ``start``
    dev: tuple[int, int]  # (major, minor) of the mapped file; (0, 0) for anonymous memory
    inode: int  # 0 for anonymous memory
    name: str  # the path, "[heap]", ...; "" for plain anonymous memory


class MapsReader:
    """``/proc/<pid>/maps`` opened once for a few :meth:`at` questions (a context manager).

    Raises OSError when the file cannot be opened (no such process, no permission)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.open(f"/proc/{pid}/maps", os.O_RDONLY | os.O_CLOEXEC)
        self._lines: list[str] | None = None

    def __enter__(self) -> MapsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def at(self, address: int) -> Vma | None:
        """The mapping that holds ``address``, or None."""
        global _ioctl_works
        if _ioctl_works:
            try:
                return self._query(address)
            except OSError as exc:
                if exc.errno not in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                _ioctl_works = False
        return self._scan(address)

    def _query(self, address: int) -> Vma | None:
        name = ctypes.create_string_buffer(_NAME_MAX)
        q = _Query(size=ctypes.sizeof(_Query), query_addr=address, vma_name_size=_NAME_MAX)
        q.vma_name_addr = ctypes.addressof(name)
        try:
            fcntl.ioctl(self._fd, _PROCMAP_QUERY, q)
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # no mapping covers it
                return None
            if exc.errno == errno.ENAMETOOLONG:  # a path past the buffer: the text has it whole
                return self._scan(address)
            raise
        return self._vma(q, name.value.decode(errors="replace") if q.vma_name_size else "")

    @staticmethod
    def _vma(q: _Query, name: str) -> Vma:
        return Vma(
            start=q.vma_start,
            end=q.vma_end,
            readable=bool(q.vma_flags & _READABLE),
            writable=bool(q.vma_flags & _WRITABLE),
            private=not q.vma_flags & _SHARED,
            offset=q.vma_offset,
            dev=(q.dev_major, q.dev_minor),
            inode=q.inode,
            name=name,
        )

    def _scan(self, address: int) -> Vma | None:
        if self._lines is None:
            with open(f"/proc/{self.pid}/maps") as f:
                self._lines = f.read().splitlines()
        for line in self._lines:
            parts = line.split(maxsplit=5)
            lo, _, hi = parts[0].partition("-")
            if int(lo, 16) <= address < int(hi, 16):
                major, _, minor = parts[3].partition(":")
                return Vma(
                    start=int(lo, 16),
                    end=int(hi, 16),
                    readable=parts[1][0] == "r",
                    writable=parts[1][1] == "w",
                    private=parts[1][3] == "p",
                    offset=int(parts[2], 16),
                    dev=(int(major, 16), int(minor, 16)),
                    inode=int(parts[4]),
                    name=parts[5].strip() if len(parts) > 5 else "",
                )
        return None

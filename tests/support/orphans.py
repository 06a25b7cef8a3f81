"""Which processes a test run or a benchmark started are still running: found by a tag in their environment.

A run calls :func:`tag_children` first: it puts ``ASTATE_RUN_TAG_<random>=<its pid>`` into
``os.environ``, so every process started from then on (etcd servers, replica servers, actors,
fork-server children, and whatever they start in turn) inherits it, however far it is reparented later (an
orphan is a child
of init, so parent links cannot find it). Tags nest: a benchmark's tag stays in the environment of
a test run it starts, which adds its own. At the end :func:`leftovers` lists the live processes that
carry the tag, other than the caller and its own pool helpers (multiprocessing's fork server and
resource tracker, which exit with it). Only this run's descendants carry the tag, so
:func:`end_leftovers` signals nothing it did not start.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

ENV_TAG = "ASTATE_RUN_TAG_"
# processes that belong to the caller's own lifetime, not leftovers
_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def tag_children() -> str:
    """Tag the processes this process starts from now on with a new tag; the tag (an environment
    variable name) for :func:`leftovers`. Tags nest: each run (a test session, a soak inside it)
    has its own, and a process started inside both carries both."""
    tag = ENV_TAG + uuid.uuid4().hex[:16]
    os.environ[tag] = str(os.getpid())
    return tag


def untag(tag: str) -> None:
    """Stop tagging new children with ``tag`` (processes already started keep it)."""
    os.environ.pop(tag, None)


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return any(v.startswith(needle) for v in f.read().split(b"\0"))
    except OSError:  # gone, or not ours to read
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def leftovers(tag: str, wait: float = 0.0) -> list[dict[str, Any]]:
    """Live processes carrying ``tag``, except this process and its own
    multiprocessing helpers; waits up to ``wait`` seconds for them to exit first (a shared etcd's
    supervisor stops a few seconds after its last participant)."""
    if not os.path.isdir("/proc"):
        return []
    needle = f"{tag}=".encode()
    me = os.getpid()
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            pid = int(entry)
            if not _environ_has(pid, needle):
                continue
            cmd = _cmdline(pid)
            if _ppid(pid) == me and any(h in cmd for h in _HELPERS):
                continue
            found.append({"pid": pid, "ppid": _ppid(pid), "cmd": cmd[:300]})
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.25)


def end_leftovers(procs: list[dict[str, Any]], tag: str, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace``, each listed process by pid (only tagged ones: see the
    module docstring); so a failed run does not leave them running for hours."""
    needle = f"{tag}=".encode()
    pids = [p["pid"] for p in procs if _environ_has(p["pid"], needle)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_environ_has(p, needle) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _environ_has(pid, needle):  # re-checked just now: still the tagged process
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

"""Process helpers shared by the embedded etcd and the same-host transport path."""

from __future__ import annotations

import os

__all__ = ["pid_alive", "exited"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal still counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def exited(pid: int) -> bool:
    """Whether the process has exited, counting a zombie (exited, not yet reaped) as exited: its
    files, and the flocks they held, are already closed."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return not pid_alive(pid)  # no procfs: fall back to signal 0
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")

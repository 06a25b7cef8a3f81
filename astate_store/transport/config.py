"""What each transport mode asks of UCX, and how the environment overrides it.

Precedence, lowest first: the mode's defaults, the ``UCX_*`` environment (an explicit
``UCX_TLS`` replaces the mode's transport list; a set ``UCX_TCP_*_SEG_SIZE`` keeps its
value), then ``config=`` given to the transport. See ``ucx.py`` for what each mode is for.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

__all__ = ["Mode", "MODES", "effective_config", "tls_has_shm", "direct_from_env"]

Mode = Literal["shm", "tcp", "auto"]
MODES: tuple[str, ...] = ("shm", "tcp", "auto")

_MODE_TLS = {"shm": "sm,self", "tcp": "tcp,self", "auto": "sm,tcp,self"}
# only where torch sees a CUDA device: lets registered CUDA memory be read and written
_MODE_TLS_CUDA = {"shm": ",cuda_copy,cuda_ipc", "tcp": ",cuda_copy", "auto": ",cuda_copy,cuda_ipc"}
# larger tcp segments than UCX's default: fewer fragments per byte read (ucx.py's docstring)
_TCP_TUNING = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}


def cuda_present() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch missing or broken CUDA setup
        return False


def effective_config(mode: str, config: Mapping[str, str] | None) -> dict[str, str]:
    """The UCX settings (keys without the ``UCX_`` prefix) a transport in ``mode`` passes
    to its worker, given the current environment and the caller's ``config``.

    Only settings the environment does not already make are included: UCX reads the
    ``UCX_*`` environment itself, so a value here would override it.
    """
    cfg: dict[str, str] = {}
    if not os.environ.get("UCX_TLS"):
        cfg["TLS"] = _MODE_TLS[mode] + (_MODE_TLS_CUDA[mode] if cuda_present() else "")
    tls = cfg.get("TLS") or os.environ.get("UCX_TLS", "")
    if mode in ("tcp", "auto") or "tcp" in tls:
        for k, v in _TCP_TUNING.items():
            if f"UCX_{k}" not in os.environ:
                cfg[k] = v
    for k, v in (config or {}).items():
        k = str(k)
        cfg[k[4:] if k.startswith("UCX_") else k] = str(v)
    return cfg


def tls_has_shm(tls: str) -> bool:
    """Whether a ``UCX_TLS`` value enables shared memory / CMA (``^`` negates the list)."""
    toks = [t.strip().lower().lstrip("\\") for t in tls.split(",") if t.strip()]
    if not toks:
        return False
    if toks[0].startswith("^"):
        toks[0] = toks[0][1:]
        return not ({"sm", "shm", "cma"} & set(toks))
    return bool({"sm", "shm", "cma", "all"} & set(toks))


def env_on(name: str) -> bool:
    """A switch that is on unless the variable ``name`` says off (0, false, no, off)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def direct_from_env() -> bool:
    """The same-host fast path's default: on unless ``ASTATE_SHM_DIRECT`` says off."""
    return env_on("ASTATE_SHM_DIRECT")

"""What one astate update asks of an SGLang engine, as it travels through SGLang's own update call.

SGLang's ``update_weights_from_tensor`` carries ``named_tensors`` to every TP rank and hands them to
the custom weight loader. An astate update sends one entry whose *name* is ``astate:`` followed by
the request as JSON, and whose tensor is empty: a name is plain text on every path (the offline
engine's ZMQ message, the HTTP route's base64 pickle), and an empty tensor pickles by value (no
shared-memory handle that only the sending host could resolve).

Both sides import this module: the client builds the entry, the loader parses it back and refuses a
malformed one with a :class:`~astate_store.errors.LayoutError` naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from astate_store.errors import LayoutError

__all__ = ["LOADER", "PREFIX", "Request", "UpdateError", "step_of"]

LOADER = "astate_store.integrations.sglang.loader.load"  # the custom weight loader's import path
PREFIX = "astate:"  # the name of the one entry an astate update sends
_STEP = re.compile(r"astate: step (\d+)\b")  # how a successful update reports the step it delivered


class UpdateError(LayoutError):
    """An astate update the engine refused or failed (the engine's message says why); unless the
    message says otherwise, the engine keeps serving the weights it had."""


@dataclass(frozen=True)
class Request:
    """One update, as every TP rank of the engine reads it."""

    namespace: str  # the astate namespace the trainer publishes to
    etcd: str | list[str] | None = None  # etcd endpoints (None: the engine processes' $ASTATE_ETCD*)
    step: int | None = None  # the oldest acceptable step (None: the newest committed)
    timeout: float = 60.0  # seconds to wait for that version to commit
    checkpoint: str | None = None  # cold start: fill from the newest astate checkpoint under this URI
    delta: bool = True  # pull delta versions: only what changed since the version the parameters hold
    # with delta: "bytes" (through the changes whenever they are fewer bytes) or "time" (only when this
    # rank's pulls measured that faster than a whole pull); the store checks the value
    delta_choice: str = "bytes"

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise LayoutError(
                f"astate request: 'namespace' must be a non-empty string, got {self.namespace!r}"
            )
        if self.step is not None and (
            isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0
        ):
            raise LayoutError(f"astate request: 'step' must be a non-negative int, got {self.step!r}")
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not self.timeout > 0
        ):
            raise LayoutError(f"astate request: 'timeout' must be a positive number, got {self.timeout!r}")
        etcd_ok = self.etcd is None or isinstance(self.etcd, str)
        etcd_ok = etcd_ok or (isinstance(self.etcd, list) and all(isinstance(e, str) for e in self.etcd))
        if not etcd_ok:
            raise LayoutError(
                f"astate request: 'etcd' must be endpoints (a string or strings), got {self.etcd!r}"
            )
        if not isinstance(self.delta, bool):
            raise LayoutError(f"astate request: 'delta' must be true or false, got {self.delta!r}")
        if not isinstance(self.delta_choice, str):
            raise LayoutError(f"astate request: 'delta_choice' must be a string, got {self.delta_choice!r}")
        if self.checkpoint is not None and not isinstance(self.checkpoint, str):
            raise LayoutError(f"astate request: 'checkpoint' must be a URI string, got {self.checkpoint!r}")

    def entry_name(self) -> str:
        return PREFIX + json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def parse(cls, named_tensors: Sequence[tuple[str, Any]]) -> Request:
        """The request among ``named_tensors`` (what SGLang hands the custom loader)."""
        names = [name for name, _ in named_tensors]
        ours = [n for n in names if isinstance(n, str) and n.startswith(PREFIX)]
        if len(ours) != 1 or len(names) != 1:
            raise LayoutError(
                f"astate loader: expected one entry named '{PREFIX}{{...}}' (astate_store.integrations"
                f".sglang.update / update_http send it), got {names[:3]!r}"
            )
        try:
            fields = json.loads(ours[0][len(PREFIX) :])
        except ValueError as exc:
            raise LayoutError(f"astate request: not JSON after {PREFIX!r}: {exc}") from exc
        if not isinstance(fields, dict):
            raise LayoutError(f"astate request: expected a JSON object, got {type(fields).__name__}")
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise LayoutError(f"astate request: unknown fields {unknown}")
        if "namespace" not in fields:
            raise LayoutError("astate request: 'namespace' is required")
        return cls(**fields)


def step_of(message: str) -> int | None:
    """The step a successful update's message reports (None if it reports none)."""
    m = _STEP.search(message)
    return int(m.group(1)) if m else None

"""The actor process (``python -m tests.support.faults.actor``): reads one JSON command per line on
stdin (``{"id", "op", "args", "kw"}``), runs ``op_<op>(state, *args, **kw)`` and answers one JSON
line on stdout (``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "etype", "typed",
"msg"}``; ``typed`` means an ``AStateError``). It may also print events (``{"event": ...}``) while
an op runs, e.g. "this pull is about to move bytes". It holds any number of stores by key. The same
actor runs inside a network namespace (``ip netns exec``). Its ops live in
:mod:`~tests.support.faults.stores`, :mod:`~tests.support.faults.hostile` and
:mod:`~tests.support.faults.fuzz`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any

from tests.support.faults import fuzz, hostile, stores
from tests.support.faults.model import lazy_torch
from tests.support.faults.stores import close_held, emit


def actor_main() -> None:
    # Our stdout is the protocol: anything else the store or UCX prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = proto
    import logging

    logging.basicConfig(
        level=os.environ.get("ASTATE_FAULT_LOG", "WARNING"),
        stream=sys.stderr,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # the driver asks on a hang
    lazy_torch()
    import astate_store.store  # noqa: F401  (import cost paid before "ready")
    from astate_store import AStateError

    state: dict[str, Any] = {"held": {}, "orphans": {}}
    ops = {k[3:]: v for m in (stores, hostile, fuzz) for k, v in vars(m).items() if k.startswith("op_")}
    emit({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        rid = cmd.get("id")
        try:
            fn = ops[cmd["op"]]
            result = fn(state, *cmd.get("args", []), **cmd.get("kw", {}))
            emit({"id": rid, "ok": True, "result": result})
        except AStateError as exc:
            emit({"id": rid, "ok": False, "typed": True, "etype": type(exc).__name__, "msg": str(exc)[:500]})
        except Exception as exc:
            emit(
                {
                    "id": rid,
                    "ok": False,
                    "typed": False,
                    "etype": type(exc).__name__,
                    "msg": str(exc)[:500],
                    "tb": traceback.format_exc()[-2000:],
                }
            )
    for h in list(state["held"].values()):
        close_held(h)
    if "etcd" in state:
        state["etcd"].stop()


if __name__ == "__main__":
    actor_main()

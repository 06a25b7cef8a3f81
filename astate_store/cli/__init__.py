"""The ``astate`` console script: operate a store from a shell (docs/operations.md).

One module per command group: ``etcd_cmd`` (run an etcd), ``catalog_cmds`` (``ls``, ``inspect``,
``watch``), ``checkpoint_cmd`` (``checkpoint ls|verify``), ``hf_cmds`` (``export``, ``import``),
``doctor``; ``common`` holds the etcdctl-style connection flags, errors and progress bars.
"""

from __future__ import annotations

from astate_store.cli.app import app, main

__all__ = ["app", "main"]

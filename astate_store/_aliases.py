"""Old import paths kept working after the package moved into folders by role.

Before the move every module sat at the package root (``astate_store.presets``,
``astate_store.consumer``, ...). Users may hold those paths, so a meta-path finder maps each
old name onto its new module: ``import astate_store.presets`` returns the very module object
``astate_store.integrations.presets`` (one module, not a copy, so ``mock.patch`` and
``isinstance`` see the same objects). New code imports the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

# old module (under astate_store) -> its new home (under astate_store)
MOVED: dict[str, str] = {
    "admin": "catalog.namespaces",
    "codec": "model.codec",
    "consumer": "get.consumer",
    "conversion": "get.conversion",
    "demo": "cli.demo",
    "etcd_server": "etcd.embedded",
    "hf_format": "integrations.hf_format",
    "kv": "get.kv",
    "layout": "model.layout",
    "prepack": "plan.prepack",
    "presets": "integrations.presets",
    "progress": "model.progress",
    "publisher": "put.publisher",
    "registry": "put.registry",
    "replica_server": "servers.replica",
    "security": "etcd.security",
    "serving": "put.serving",
    "sessions_hub": "hub",
    "sources": "get.sources",
    "spans": "model.spans",
    "staging": "put.staging",
    "state_dict": "model.state_dict",
    "topology": "transport.topology",
    "usermeta": "model.usermeta",
    "validated": "model.validated",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The target module ran when it was imported; nothing more to run."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str) -> None:
        self.prefix = package + "."
        self.package = package

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if not fullname.startswith(self.prefix):
            return None
        new = MOVED.get(fullname[len(self.prefix) :])
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"{self.package}.{new}"))


def install(package: str) -> None:
    """Put the finder on ``sys.meta_path`` once (idempotent across reloads)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder(package))

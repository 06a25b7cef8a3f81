"""The docs keep up with the tree.

docs/architecture.md carries a table of every module under ``astate_store/`` (one row each: its
role and the rooms it imports). These tests fail when a module is added, moved or removed without
its row, when a row names a module that is gone, when a module imports a room its row does not
list, and when any doc names a file of this repository that does not exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "astate_store"
ARCH = ROOT / "docs" / "architecture.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "schemas" / "README.md"]
# Docs that cite other projects' source files by their bare names (vLLM, SGLang, Megatron).
CITES_OTHER_PROJECTS = {"presets.md"}

MODULES = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py"))
ROOMS = sorted(p.name + "/" for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())
# Where a doc's path may start: the repository's top level and the package's rooms.
TOP = sorted({p.name for p in ROOT.iterdir() if not p.name.startswith(".")} | {".ci"})

_ROW = re.compile(r"^\|\s*`([\w/]+\.py)`\s*\|(.*)\|(.*)\|\s*$")
_TICKED = re.compile(r"`([^`\s]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)")


def _table() -> dict[str, tuple[str, set[str]]]:
    """docs/architecture.md's module rows: path -> (role, the rooms its imports cell lists)."""
    rows: dict[str, tuple[str, set[str]]] = {}
    for line in ARCH.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows"
            rows[m.group(1)] = (m.group(2).strip(), set(_TICKED.findall(m.group(3))))
    return rows


def _room(module: str) -> str | None:
    """The room of a dotted module name of the package: ``get/`` for ``astate_store.get.x``,
    ``errors.py`` for ``astate_store.errors``, ``_ucx`` for the C extension, ``astate_store`` for
    the package's own ``__init__`` (the public API); None outside the package."""
    parts = module.split(".")
    if parts[0] != "astate_store":
        return None
    if len(parts) == 1:
        return "astate_store"
    if (PKG / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] if parts[1] in NATIVE else parts[1] + ".py"


NATIVE = ("_ucx", "_delta")  # the C extensions: modules without a .py file


def _is_module(name: str) -> bool:
    return name in NATIVE or (PKG / name).is_dir() or (PKG / f"{name}.py").is_file()


def _dotted(path: str) -> str:
    parts = ["astate_store", *Path(path).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_rooms(path: str) -> set[str]:
    """The rooms a module imports at run time (``if TYPE_CHECKING:`` blocks aside), its own
    room excluded."""
    mod, file = _dotted(path), PKG / path
    out: set[str] = set()
    stack: list[ast.AST] = [ast.parse(file.read_text(), str(file))]
    while stack:
        node = stack.pop()
        stack.extend(c for c in ast.iter_child_nodes(node) if not _is_type_checking(c))
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod if file.name == "__init__.py" else mod.rsplit(".", 1)[0]
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # ``from astate_store import plan`` names the room of ``plan``; ``import connect``, the API
            names = [
                f"{base}.{a.name}" if base == "astate_store" and _is_module(a.name) else base
                for a in node.names
            ]
        else:
            continue
        out.update(r for r in map(_room, names) if r is not None)
    return out - {_room(mod)}


def _names_a_file(token: str, in_arch: bool) -> str | None:
    """The repository path a doc token names, or None when it names no file of ours (a class, an
    option, another project's file). In docs/architecture.md, bare ``x.py`` names count too."""
    if any(c in token for c in "<>*{}$") or token.startswith(("http", "/")):
        return None
    token = token.split(":", 1)[0].rstrip(".,;")  # ``path.py:name``, ``path.py::test``
    head = token.split("/", 1)[0]
    if "/" in token and (head + "/" in ROOMS or head in TOP):
        return token
    if in_arch and re.fullmatch(r"[\w]+\.py", token):
        return token
    return None


def _exists(token: str) -> bool:
    path = token.rstrip("/")
    if (ROOT / path).exists() or (PKG / path).exists():
        return True
    if "/" not in path:  # a bare module name: somewhere in the package
        return any(p.name == path for p in PKG.rglob("*.py"))
    return False


def test_every_module_has_one_row_in_the_architecture_table() -> None:
    rows = _table()
    missing = sorted(set(MODULES) - set(rows))
    gone = sorted(set(rows) - set(MODULES))
    assert not missing, f"docs/architecture.md's module table lacks {missing}"
    assert not gone, f"docs/architecture.md's module table names modules that no longer exist: {gone}"
    assert all(role for role, _ in rows.values()), "every module row says what the module is for"


@pytest.mark.parametrize("path", MODULES)
def test_a_module_imports_only_the_rooms_its_row_lists(path: str) -> None:
    rows = _table()
    if path not in rows:
        pytest.skip("no row (test_every_module_has_one_row_in_the_architecture_table)")
    listed = rows[path][1]
    unknown = sorted(
        t for t in listed if not (t in ROOMS or t in (*NATIVE, "astate_store") or (PKG / t).is_file())
    )
    assert not unknown, f"{path}: its row lists what is no room or root module of the package: {unknown}"
    undeclared = sorted(imported_rooms(path) - listed)
    assert not undeclared, f"{path} imports {undeclared}, which its row in docs/architecture.md does not list"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_file_a_doc_names_exists(doc: Path) -> None:
    in_arch = doc == ARCH
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    named = set(_TICKED.findall(text)) | {
        t for t in _LINK.findall(text) if not re.match(r"^[a-z]+:", t) and not t.endswith(".md")
    }
    if doc.name in CITES_OTHER_PROJECTS:
        named = {t for t in named if "/" in t}
    paths = {p for p in (_names_a_file(t, in_arch) for t in named) if p is not None}
    absent = sorted(p for p in paths if not _exists(p) and not (doc.parent / p).exists())
    assert not absent, f"{doc.relative_to(ROOT)} names files that do not exist: {absent}"


def test_the_checks_are_not_vacuous() -> None:
    """The parsers find what they must: rows, imports, and a file that does not exist."""
    assert len(_table()) >= 100
    assert "catalog/" in imported_rooms("get/consumer.py")
    assert imported_rooms("errors.py") == set()
    assert _names_a_file("transport/stream.py", False) == "transport/stream.py"
    assert not _exists("transport/stream.py") and _exists("transport/stream/") and _exists("hub.py")
    assert _names_a_file("sessions_hub.py", True) and not _exists("sessions_hub.py")

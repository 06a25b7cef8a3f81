"""The boundaries docs/architecture.md states, asserted on the package's imports.

Every ``import`` and ``from ... import`` in ``astate_store/`` is parsed (module level and inside
functions alike; only ``if TYPE_CHECKING:`` blocks are left out, since they never run), resolved
to the module it names, and checked against the rules below. The façade is pinned too: what
``import astate_store`` exports, and that it pulls in no integration's heavy dependency. Modules
stay readable: at most 600 lines of code each (docstrings, comments and blank lines not counted);
classes and functions have no line limit (a long class that is one thing stays one class).
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "astate_store"
NATIVE = {"astate_store._ucx", "astate_store._delta"}  # the C extensions: modules without a .py file


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}
KNOWN = set(MODULES) | NATIVE


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(tree: ast.AST, typing_too: bool):
    """Every node (except those under ``if TYPE_CHECKING:`` unless ``typing_too``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if typing_too or not _is_type_checking(c))


def _package(module: str) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return module if module in MODULES and MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _from_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` statement imports from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    parts = _package(module).split(".")
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _targets(module: str, path: Path, node: ast.AST) -> set[str]:
    """The astate_store modules (or external top-level packages) one import statement names."""
    out: set[str] = set()
    if isinstance(node, ast.Import):
        out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = _from_base(module, path, node)
        for a in node.names:
            sub = f"{base}.{a.name}"
            out.add(sub if sub in KNOWN else base)  # `from pkg import submodule` names the submodule
    return out


def _imports(typing_too: bool = False) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        for node in _walk(ast.parse(path.read_text(), str(path)), typing_too):
            edges[mod] |= _targets(mod, path, node)
    return edges


IMPORTS = _imports()


def _under(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _violations(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, ts in IMPORTS.items()
        if _under(m, *sources)
        for t in ts
        if _under(t, *forbidden)
    )


# The package's top-level units (subpackages and modules), so the rules below follow the tree.
UNITS = sorted({".".join(m.split(".")[:2]) for m in KNOWN} - {"astate_store"})
ENTRY_POINTS = ("astate_store.integrations", "astate_store.servers", "astate_store.cli")

# (rule, modules it governs, what they must not import)
BOUNDARIES = [
    (
        "the planner imports neither the catalog nor the transport",
        ("astate_store.plan",),
        ("astate_store.catalog", "astate_store.transport", "astate_store.etcd", "pyetcd"),
    ),
    (
        "the transport knows no catalog",
        ("astate_store.transport",),
        ("astate_store.catalog", "astate_store.etcd", "pyetcd"),
    ),
    (
        "checkpoints know no etcd",
        ("astate_store.checkpoint",),
        ("astate_store.catalog", "astate_store.etcd", "pyetcd"),
    ),
    (
        "the etcd client lives in etcd/ and catalog/ is above it",
        ("astate_store.etcd",),
        ("astate_store.catalog",),
    ),
    (
        "model/ imports nothing above it (errors, and the change-map kernel _delta: a C leaf)",
        ("astate_store.model",),
        tuple(
            u for u in UNITS if u not in ("astate_store.model", "astate_store.errors", "astate_store._delta")
        ),
    ),
    (
        "nothing below the façade imports integrations/, servers/ or cli/",
        tuple(u for u in UNITS if u not in ENTRY_POINTS),
        ENTRY_POINTS,
    ),
]


@pytest.mark.parametrize("rule,sources,forbidden", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_boundary(rule: str, sources: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert not _violations(sources, forbidden), rule


def test_errors_import_nothing_of_the_package() -> None:
    assert not {t for t in IMPORTS["astate_store.errors"] if _under(t, "astate_store")}


def test_the_planners_stages_are_private() -> None:
    """``plan/_planner/`` sits behind ``plan``'s façade: nothing outside ``plan/`` imports it."""
    reach = _violations(("astate_store",), ("astate_store.plan._planner",))
    assert not [v for v in reach if not _under(v.split()[0], "astate_store.plan")]


def test_the_etcd_client_is_in_etcd() -> None:
    assert "astate_store.etcd.client" in MODULES and "astate_store.catalog.client" not in MODULES


def test_no_import_circle() -> None:
    """No cycle among the package's modules (a package's ``__init__`` counts as a module), type-only
    imports included: a circle of annotations is still two modules that must be read together."""
    graph = {m: {t for t in ts if t in KNOWN and t != m} for m, ts in _imports(typing_too=True).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, f"import circles: {cycles}"


def test_the_rules_see_real_imports() -> None:
    """The parser is not vacuous: known edges are found, and a rule that must fire does."""
    assert any(
        _under(t, "astate_store.plan")
        for m, ts in IMPORTS.items()
        if _under(m, "astate_store.get")
        for t in ts
    )
    assert "astate_store.catalog" in IMPORTS["astate_store.store"]
    assert _violations(("astate_store.store",), ("astate_store.catalog",))  # a rule that must fire
    assert _violations(("astate_store.plan",), ("astate_store.plan._planner",))  # the façade's own
    src = "from astate_store.plan.contracts import _hidden, Public\nfrom .sibling import _shared\n"
    found = _private_from("astate_store.get.x", PKG / "get" / "x.py", ast.parse(src))
    assert found == ["astate_store.get.x imports astate_store.plan.contracts._hidden"]


FACADE = ["connect", "connect_many", "SessionHub", "Store", "Shard", "Stats", "PullStats"]


def test_facade_is_pinned_and_light() -> None:
    """``import astate_store`` exports the public API, and loads no integration's dependency."""
    code = (
        "import sys, astate_store as a; print(sorted(set(a.__all__))); "
        "print(sorted(m for m in ('vllm', 'ray', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    exported, heavy = out.stdout.strip().splitlines()
    import astate_store
    from astate_store import errors

    assert eval(exported) == sorted(set(FACADE) | set(errors.__all__)) == sorted(set(astate_store.__all__))
    assert eval(heavy) == []


def _private_from(mod: str, path: Path, tree: ast.AST) -> list[str]:
    """``from M import _name`` in ``mod`` where ``_name`` is a private name (not a module) of a
    module in another package: a module's private names are shared with its own package at most."""
    out = []
    for node in _walk(tree, typing_too=False):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _from_base(mod, path, node)
        if not _under(base, "astate_store") or _package(base) == _package(mod):
            continue
        out += [
            f"{mod} imports {base}.{a.name}"
            for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__") and f"{base}.{a.name}" not in KNOWN
        ]
    return out


def _private_imports() -> list[str]:
    return sorted(
        v for mod, path in MODULES.items() for v in _private_from(mod, path, ast.parse(path.read_text()))
    )


def test_no_module_imports_a_private_name_of_another_package() -> None:
    assert not _private_imports()


MODULE_CODE_LINES = 600  # lines of code a module may hold (issue 35: limits are for reading)


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(src: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    skip |= {tokenize.ENCODING, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - _docstring_lines(ast.parse(src)))


def test_code_lines_counts_code_only() -> None:
    src = '''"""A module docstring
over two lines."""

# a comment
import os  # a trailing comment


class A:
    """A class docstring."""

    x = """a string that is code,
    not a docstring"""

    def f(self) -> None:
        """A function docstring."""
        return None
'''
    assert code_lines(src) == 6  # import, class, x (two lines), def, return


def test_modules_stay_within_their_code_line_limit() -> None:
    over = {
        mod: n for mod, path in MODULES.items() if (n := code_lines(path.read_text())) > MODULE_CODE_LINES
    }
    assert not over, over

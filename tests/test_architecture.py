"""The boundaries docs/architecture.md states, asserted on the package's imports.

Every ``import`` and ``from ... import`` in ``astate_store/`` is parsed (module level and inside
functions alike; only ``if TYPE_CHECKING:`` blocks are left out, since they never run), resolved
to the module it names, and checked against the rules below. The façade is pinned too: what
``import astate_store`` exports, and that it pulls in no integration's heavy dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


def _targets(module: str, path: Path, node: ast.AST) -> set[str]:
    """The astate_store modules (or external top-level packages) one import statement names."""
    out: set[str] = set()
    if isinstance(node, ast.Import):
        out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
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
        "model/ imports nothing above it",
        ("astate_store.model",),
        (
            "astate_store.put",
            "astate_store.get",
            "astate_store.plan",
            "astate_store.catalog",
            "astate_store.etcd",
            "astate_store.transport",
            "astate_store.checkpoint",
            "astate_store.integrations",
            "astate_store.servers",
            "astate_store.cli",
            "astate_store.store",
            "astate_store.store_state",
            "astate_store.hub",
            "astate_store.recovery",
            "astate_store.checkpointing",
            "astate_store.context",
            "astate_store.metrics",
        ),
    ),
    (
        "nothing below the façade imports integrations/, servers/ or cli/",
        (
            "astate_store.model",
            "astate_store.put",
            "astate_store.get",
            "astate_store.plan",
            "astate_store.catalog",
            "astate_store.etcd",
            "astate_store.transport",
            "astate_store.checkpoint",
            "astate_store.store",
            "astate_store.store_state",
            "astate_store.hub",
            "astate_store.recovery",
            "astate_store.checkpointing",
            "astate_store.context",
            "astate_store.metrics",
            "astate_store.errors",
            "astate_store.process",
        ),
        ("astate_store.integrations", "astate_store.servers", "astate_store.cli"),
    ),
]


@pytest.mark.parametrize("rule,sources,forbidden", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_boundary(rule: str, sources: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert not _violations(sources, forbidden), rule


def test_errors_import_nothing_of_the_package() -> None:
    assert not {t for t in IMPORTS["astate_store.errors"] if _under(t, "astate_store")}


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


# Units small enough to read at once (issue 27's limits): lines of a module, a class, a function.
LIMITS = {"module": 600, "class": 350, "function": 80}


def test_units_stay_within_their_size_limits() -> None:
    over = []
    for mod, path in MODULES.items():
        src = path.read_text()
        if len(src.splitlines()) > LIMITS["module"]:
            over.append(f"module {mod}: {len(src.splitlines())} lines")
        for node in ast.walk(ast.parse(src)):
            kind = (
                "class"
                if isinstance(node, ast.ClassDef)
                else "function"
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else None
            )
            if kind and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
                over.append(f"{kind} {mod}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not over, over

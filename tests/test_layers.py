"""The import layering of python/compcomm, read from the source with ``ast`` (nothing is imported).

Every ``.py`` file under ``python/compcomm`` is a module (``pkg/__init__.py`` is ``pkg``). Every
``import``/``from ... import`` in it is an edge to the compcomm module it names -- at module level
and inside functions alike, since a deferred import only hides a cycle until the function runs.
Imports under ``if TYPE_CHECKING:`` are not edges (they never run). ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module, else to ``pkg`` (whose ``__init__`` defines ``name``).

Two rules:

1. **No cycle** among compcomm modules. A module importing a sibling from its own package
   (``from . import adam``) is not an edge to the package ``__init__`` (Python has started it
   already); ``import compcomm`` or ``from .. import name`` is an edge to ``compcomm/__init__``,
   which imports nearly everything, so it closes a cycle from any module the root imports.

2. **No reach into another module's private names.** A private name starts with one underscore
   (dunders such as ``__version__`` are public). It is a violation to
   ``from M import _name`` or to read/write ``M._name`` through a name bound to module ``M``, when
   ``M`` is another compcomm module and ``_name`` is not a module. Private *modules*
   (``_comm.py``, ``optim/_state.py``) are private to their package: any module inside that
   package (subpackages included) may import them and their public names, no module outside may.
   So the root's ``_buffers``/``_comm``/``_checkpoint`` serve all of compcomm, while
   ``optim/_state.py`` serves only ``compcomm.optim``. The compiled extension ``_C`` is the one
   exception: it is the package's private core, imported everywhere.

:data:`ALLOWED` lists today's exceptions, each with its reason; it may only shrink (an entry
that no longer occurs fails the test, so it is removed when the code is fixed).
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python", "compcomm")
EXTENSION = "_C"

#: (importing module, target module, private name or None for an edge of a cycle) -> reason.
ALLOWED: Dict[Tuple[str, str, Optional[str]], str] = {
}


def _modules() -> Dict[str, str]:
    """Dotted module name -> file path, for every module of the package."""
    out = {}
    root = os.path.normpath(ROOT)
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(root))
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, "").endswith("__init__.py")


def _resolve(module: str, level: int, target: Optional[str]) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != EXTENSION


def _module_visible(target: str, importer: str) -> bool:
    """A private module is visible inside its parent package only."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            parent = ".".join(parts[:i])
            if not (importer == parent or importer.startswith(parent + ".")):
                return False
    return True


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    skip: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def scan() -> Tuple[Dict[str, Set[str]], List[Tuple[str, str, Optional[str], int]]]:
    """(import graph, private reaches as (module, target, name or None, line))."""
    graph: Dict[str, Set[str]] = {m: set() for m in MODULES}
    reaches: List[Tuple[str, str, Optional[str], int]] = []
    for mod, path in MODULES.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        skip = _type_checking_nodes(tree)
        bound: Dict[str, str] = {}  # local name -> compcomm module it is bound to

        def edge(target: str, line: int) -> None:
            if target in MODULES and target != mod:
                graph[mod].add(target)
                if not _module_visible(target, mod):
                    reaches.append((mod, target, None, line))

        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "compcomm":
                        edge(a.name, node.lineno)
                        bound[a.asname or "compcomm"] = a.name if a.asname else "compcomm"
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node.level, node.module)
                if src.split(".")[0] != "compcomm":
                    continue
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    if sub in MODULES:  # a submodule: an edge to it alone
                        edge(sub, node.lineno)
                        bound[a.asname or a.name] = sub
                    elif a.name == EXTENSION:
                        continue
                    else:  # a name defined by src (its __init__ for a package)
                        edge(src, node.lineno)
                        if _private(a.name) and src != mod:
                            reaches.append((mod, src, a.name, node.lineno))
        for node in ast.walk(tree):  # M._name through a name bound to a module
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not (isinstance(value, ast.Name) and value.id in bound):
                continue
            target = bound[value.id]
            for part in reversed(chain[1:]):
                if f"{target}.{part}" not in MODULES:
                    break
                target = f"{target}.{part}"
            else:
                if f"{target}.{node.attr}" in MODULES:
                    edge(f"{target}.{node.attr}", node.lineno)
                elif target != mod:
                    reaches.append((mod, target, node.attr, node.lineno))
    return graph, reaches


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_the_package():
    graph, _ = scan()
    assert "compcomm.optim.adam" in graph and "compcomm.compress" in graph["compcomm.optim.base"]


def test_no_import_cycle():
    graph, _ = scan()
    found = cycles(graph)
    assert not found, "import cycles (an edge per line: module -> imports):\n" + "\n".join(
        " ; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found)


def test_no_reach_into_private_names():
    _, reaches = scan()
    bad = [r for r in reaches if r[:3] not in ALLOWED]
    assert not bad, "private names used outside their module:\n" + "\n".join(
        f"{m}:{line}: {t}" + (f".{n}" if n else " (a private module)") for m, t, n, line in bad)
    stale = set(ALLOWED) - {r[:3] for r in reaches}
    assert not stale, f"ALLOWED entries that no longer occur (remove them): {sorted(stale)}"


#: modules over the ~500-line limit today -> reason; may only shrink, as ALLOWED.
LONG_ALLOWED: Dict[str, str] = {
}
MAX_LINES = 520  # "about 500"


def test_no_module_over_500_lines():
    sizes = {m: sum(1 for _ in open(path)) for m, path in MODULES.items()}
    long = {m: n for m, n in sizes.items() if n > MAX_LINES and m not in LONG_ALLOWED}
    assert not long, f"modules over ~500 lines: {long}"
    stale = [m for m in LONG_ALLOWED if sizes.get(m, 0) <= MAX_LINES]
    assert not stale, f"LONG_ALLOWED entries now short enough (remove them): {stale}"

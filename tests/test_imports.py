"""No import cycle among mla_verify's modules, and each room (subpackage) imports only the rooms its docstring names.

The imports are read from the sources, not executed: every ``import`` and ``from ... import`` a module names,
at its top or inside a function (a lazy import is still a dependency), except under ``if TYPE_CHECKING:``
(annotations only, never run). An edge goes to the module named -- ``from .backends import Backend`` depends
on the ``mla_verify.backends`` package, ``from . import metamorphic`` on that module -- and not to the packages
above it: a package's ``__init__`` that re-exports its modules would otherwise put every module on a cycle.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mla_verify"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted name -> source file, for every module of ``package`` (a package is its ``__init__``)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` itself (not ``not TYPE_CHECKING``, whose body runs)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(node: ast.AST):
    """Every node under ``node``, leaving out the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield child
        yield from _runtime_nodes(child)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (source ``path``) imports at run time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import mla_verify.x.y` names module y or its package
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def test_mla_verify_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert "mla_verify.core.cli_args" in graph["mla_verify.bench.measure"]  # the walk sees the package's real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "pkg" / name).write_text(text)
    return root / "pkg"


def test_a_lazy_import_closes_a_cycle(tmp_path: Path) -> None:
    """The shape of the cycle this test was written for: cli imports bench inside a function, bench imports cli."""
    pkg = _package(tmp_path, {"__init__.py": "", "cli.py": "def build():\n    from .bench import run\n",
                              "bench.py": "from .cli import build\n"})
    assert find_cycle(import_graph(pkg)) == ["pkg.bench", "pkg.cli", "pkg.bench"]


def test_what_is_and_is_not_an_edge(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "__init__.py": "from .a import x\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import y\nx = 1\n",
        "b.py": "from . import a\nimport pkg.sub.c\nfrom .sub import c as see\n",
        "sub/__init__.py": "", "sub/c.py": "from .. import b\n"})
    graph = import_graph(pkg)
    assert graph["pkg.a"] == set()  # annotations only
    assert graph["pkg.b"] == {"pkg.a", "pkg.sub.c"}
    assert find_cycle(graph) == ["pkg.b", "pkg.sub.c", "pkg.b"]


ROOM_RULE = re.compile(r"May import: ([^.]*)\.")


def room_of(package: Path, module: str) -> str | None:
    """``mla_verify.run.engine`` -> ``run``; a top-level module (``mla_verify.pytest_plugin``) has no room."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (package / parts[1]).is_dir() else None


def room_rules(package: Path) -> dict[str, set[str]]:
    """Room -> the rooms its ``__init__`` docstring says it may import ("nothing else in mla_verify": none)."""
    rules = {}
    for init in sorted(package.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        found = ROOM_RULE.search(" ".join(doc.split()))
        assert found, f"{init}: its docstring states no import rule ('May import: ...')"
        named = {r.strip() for r in found.group(1).split(",")}
        rules[init.parent.name] = set() if named == {"nothing else in mla_verify"} else named
    return rules


def rule_breaks(package: Path) -> list[str]:
    """Every import from one room into another that the importing room's rule does not name (top level: any)."""
    rules = room_rules(package)
    return [f"{a} imports {b}" for a, targets in import_graph(package).items() for b in sorted(targets)
            if (ra := room_of(package, a)) and ra != (rb := room_of(package, b))
            and (rb is None or rb not in rules[ra])]


def test_every_room_states_its_rule_and_keeps_it() -> None:
    rules = room_rules(PACKAGE)
    assert {"core", "problems", "backends", "judge", "draw", "kinds", "run", "records", "shadow", "cli"} <= set(rules)
    for room, allowed in rules.items():
        assert allowed <= set(rules), f"{room}'s rule names rooms that do not exist: {allowed - set(rules)}"
    broken = rule_breaks(PACKAGE)
    assert not broken, "imports against the rooms' rules:\n" + "\n".join(broken)


def test_an_import_against_a_rule_and_one_into_the_top_level_are_found(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {
        "__init__.py": "", "plugin.py": "from .high import h\n",
        "low/__init__.py": '"""Low.\n\nMay import: nothing else in mla_verify."""\n',
        "low/l.py": "from ..high import h\n",
        "high/__init__.py": '"""High.\n\nMay import: low."""\n',
        "high/h.py": "from ..low import l\nfrom .. import plugin\n"})
    assert rule_breaks(pkg) == ["pkg.high.h imports pkg.plugin", "pkg.low.l imports pkg.high.h"]


def test_rooms_stay_small() -> None:
    """A room of more than a dozen modules is two rooms (the issue that made the rooms asked for ~12)."""
    sizes = {d.name: len([p for p in d.glob("*.py") if p.name not in ("__init__.py", "__main__.py")])
             for d in PACKAGE.iterdir() if (d / "__init__.py").exists()}
    assert max(sizes.values()) <= 12, sizes
    assert len([p for p in PACKAGE.glob("*.py")]) <= 4  # __init__ and the pytest plugin's three modules

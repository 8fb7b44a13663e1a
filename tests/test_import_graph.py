"""The import graph stays a layering: no import cycle, and no import from a lower layer upwards.

The layers, bottom up: ``common`` (exit codes, atomic files, dtypes, the command-line vocabulary) < ``data_prep``
(no torch) < ``leviathan_pretrain`` < ``launchers`` (and its command table). The graph is read from the source as
text (``ast``; nothing is imported), with every import in a module, the ones inside functions included: a cycle
hidden behind a lazy import is still a cycle. An import by name is an edge too: the code imports by name only
through ``common.entry_points.resolve`` and a ``"package.module:name"`` literal, which the graph reads; a module-level
``__getattr__`` (imports the graph cannot see) is refused. A package's ``__main__`` is a door (``python -m``),
imported by nothing, so it may open onto any layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("common", "data_prep", "leviathan_pretrain", "launchers")  # bottom up
RESOLVER = "common.entry_points"  # the one place that imports by name (a "package.module:name" spec)


def module_files(root: Path = REPO, packages=LAYERS) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``packages`` (a package is its ``__init__``)."""
    out = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(module: str, node: ast.Import | ast.ImportFrom, files: dict[str, Path]) -> set[str]:
    """The project modules one import statement of ``module`` loads (the most specific: ``from p import m``
    names the module ``p.m`` when it is one, else ``p`` itself)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in files}
    if node.level:  # relative: from the module's package, one level up per dot past the first
        package = module.split(".") if files[module].name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        target = ".".join(package + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = set()
    for alias in node.names:
        if f"{target}.{alias.name}" in files:
            out.add(f"{target}.{alias.name}")
        elif target in files:
            out.add(target)
    return out


def by_name(node: ast.AST, files: dict[str, Path]) -> set[str]:
    """The project module a ``"package.module:name"`` literal names (an import by name, through the resolver)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        module, sep, name = node.value.partition(":")
        if sep and name.isidentifier() and module in files:
            return {module}
    return set()


def import_graph(root: Path = REPO, packages=LAYERS) -> dict[str, set[str]]:
    files = module_files(root, packages)
    graph = {}
    for module, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= imported(module, node, files)
            deps |= by_name(node, files)
        graph[module] = deps - {module}
    return graph


def hidden_imports(root: Path = REPO, packages=LAYERS) -> list[str]:
    """Imports the graph cannot read: ``importlib.import_module``/``__import__`` outside the resolver, and
    module-level ``__getattr__`` (lazy re-exports)."""
    found = []
    for module, path in module_files(root, packages).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and module != RESOLVER:
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in ("import_module", "__import__"):
                    found.append(f"{module}:{node.lineno}: {name}")
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [f"{module}:{n.lineno}: __getattr__" for n in tree.body if getattr(n, "name", "") == "__getattr__"]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def is_door(module: str) -> bool:
    return module.rsplit(".", 1)[-1] == "__main__"


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """Imports from a lower layer upwards (a ``__main__`` door is above every layer), and any import of a door."""

    def layer(module: str) -> int:
        return len(layers) if is_door(module) else layers.index(module.split(".")[0])

    return sorted((m, d) for m, deps in graph.items() for d in deps if layer(d) > layer(m) or is_door(d))


def test_the_project_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 250  # the graph was read, not empty
    assert cycles(graph) == []


def test_no_layer_imports_from_a_layer_above_it():
    assert upward_imports(import_graph()) == []


def test_every_import_is_one_the_graph_reads():
    assert hidden_imports() == []
    graph = import_graph()
    assert "leviathan_pretrain.model.lev" in graph["leviathan_pretrain.model.variants"]  # read from "module:Class"
    assert {"data_prep.tokenize_cli", "leviathan_pretrain.train", "launchers.slurm"} <= graph["launchers.commands"]


def test_the_package_root_holds_its_commands_only():
    """leviathan_pretrain's top level is its commands (the table's rows) and the ``python -m`` door; every library
    lives in a package named for its concern (config/, model/, data/, trainer/, evaluation/, plan/, ...)."""
    from launchers.commands import COMMANDS

    commands = {spec.partition(":")[0] for spec, _ in COMMANDS.values()}
    top = {f"leviathan_pretrain.{p.stem}" for p in (REPO / "leviathan_pretrain").glob("*.py")}
    assert top - commands == {"leviathan_pretrain.__init__", "leviathan_pretrain.__main__"}


@pytest.fixture
def toy_tree(tmp_path: Path) -> Path:
    """A tree with a lazy-import cycle (a -> b at top level, b -> a inside a function) and an upward import."""
    files = {
        "low/__init__.py": "",
        "low/a.py": "from . import b\n",
        "low/b.py": "def f():\n    from low.a import thing\n",
        "low/c.py": "import high.d\n",
        "high/__init__.py": "",
        "high/d.py": "from ..low import c\nfrom low import a as _a\n",
        "high/__main__.py": "import high.d\n",
        "low/e.py": "import importlib\nTABLE = {'x': 'high.d:main'}\n\n\ndef __getattr__(name):\n"
        "    return importlib.import_module('low.' + name)\n",
        "low/f.py": "from high import __main__\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_checks_find_a_lazy_cycle_and_an_upward_import(toy_tree: Path):
    graph = import_graph(toy_tree, ("low", "high"))
    assert graph["low.a"] == {"low.b"} and graph["low.b"] == {"low.a"}  # relative and in-function imports read
    assert graph["high.d"] == {"low.a", "low.c"}
    assert graph["low.e"] == {"high.d"}  # a "module:name" literal is an edge
    assert sorted(cycles(graph)) == [["high.d", "low.c"], ["low.a", "low.b"]]
    # the door may import upwards; importing a door is refused, as is the "module:name" edge upwards
    assert upward_imports(graph, ("low", "high")) == [
        ("low.c", "high.d"),
        ("low.e", "high.d"),
        ("low.f", "high.__main__"),
    ]
    assert hidden_imports(toy_tree, ("low", "high")) == ["low.e:6: import_module", "low.e:5: __getattr__"]

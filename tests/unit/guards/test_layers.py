"""The import layers of src/dflash_train: no import circle, and no import from a lower layer to a higher one.

Every `import` / `from ... import` of every module counts, wherever it is: at the top, inside a function or a
method, under `if TYPE_CHECKING:`. Relative imports are resolved. `from pkg import name` is an edge to the
module `pkg.name` when that is a module, else to `pkg`. The parent packages Python runs on the way to a module
are not edges (a package's `__init__` that imports its own submodule would otherwise always close a circle),
and `importlib.import_module(...)` (the architecture registry's) is not seen.

The layers, lowest first (a module may import its own layer and those below it, never one above):

0 foundation: the package root, errors, numbers, runtime (device, dtype), files (the on-disk names and what a folder
  holds, file modes, the one atomic write of a file and replace of a folder; but files.paths and files.outputs),
  trackers (run.report_to's names), architectures.registry (the drafter architectures' names). No torch at import,
  nothing of the package above them.
1 run state, inputs and the target: assets, exports.serving (how exports are served: the serve tables, the cards'
  lines), config, run (the run directory, run.procs: is a PID still that process), data, target (the frozen target)
  and accel (the compile layer, the FP8 primitives and training kernels).
2 the drafter architectures: architectures (with architectures.io, a drafter's files, and architectures.init_from_target).
3 inference: infer, exports (exports.card: a drafter's README with its evaluation table, written by train and export).
4 training: train.
5 commands: cli, commands (export, prepare, pipeline, demo, doctor, config_reference), files.outputs (what each
  command may write over: it knows every command's output), files.paths (what a folder given on the command line is,
  and which command takes it), __main__.

A new module needs a line in LAYERS, or a package above it that has one (test_every_module_has_a_layer).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src"
PACKAGE = "dflash_train"

# module or package (relative to dflash_train; "__init__" is the package root itself) -> layer. A package's line
# covers everything under it; a longer line overrides it for that subtree.
LAYERS: dict[str, int] = {
    "__init__": 0,
    "errors": 0,
    "numbers": 0,
    "runtime": 0,
    "files": 0,
    "trackers": 0,
    "architectures.registry": 0,
    "assets": 1,
    "exports.serving": 1,
    "config": 1,
    "run": 1,
    "data": 1,
    "target": 1,
    "accel": 1,
    "architectures": 2,
    "infer": 3,
    "exports": 3,
    "train": 4,
    "files.outputs": 5,
    "files.paths": 5,
    "commands": 5,
    "cli": 5,
    "__main__": 5,
}

# (importer, imported, why): an import from a lower layer to a higher one that is genuinely needed. Keep it short.
ALLOWED: tuple[tuple[str, str, str], ...] = ()


# ------------------------------------------------------------------------------------------------ the checker


def find_modules(src: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__), for every .py file under src/package."""
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_graph(src: Path, package: str) -> dict[str, dict[str, int]]:
    """importer -> {imported module of the package: line of the first such import}, over every import node."""
    modules = find_modules(src, package)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import pkg.mod.attr` style: the module it names
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or not (strongly connected, 2 or more), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def _circle_in(graph: dict[str, dict[str, int]], group: set[str], start: str) -> list[str]:
    """A shortest circle through `start` inside `group` (breadth first)."""
    came_from = {start: ""}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while came_from[path[-1]]:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in group and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")


def relative(module: str, package: str) -> str:
    return "__init__" if module == package else module.removeprefix(package + ".")


def layer_of(module: str, package: str, layers: dict[str, int]) -> int | None:
    """The layer of the longest LAYERS line that is the module or a package above it."""
    rel = relative(module, package)
    hits = [key for key in layers if rel == key or (key != "__init__" and rel.startswith(key + "."))]
    return layers[max(hits, key=len)] if hits else None


def unplaced(graph: dict[str, dict[str, int]], package: str, layers: dict[str, int]) -> list[str]:
    return sorted(m for m in graph if layer_of(m, package, layers) is None)


def stale_layers(graph: dict[str, dict[str, int]], package: str, layers: dict[str, int]) -> list[str]:
    """LAYERS lines that name no module or package any more."""
    rels = {relative(m, package) for m in graph}
    return sorted(k for k in layers if k not in rels and not any(r.startswith(k + ".") for r in rels))


def upward_imports(graph: dict[str, dict[str, int]], package: str, layers: dict[str, int],
                   allowed: tuple[tuple[str, str, str], ...]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """(the imports from a lower layer to a higher one that ALLOWED does not list, the ALLOWED lines not used)."""
    excused = {(a, b) for a, b, _ in allowed}
    used = set()
    found = []
    for importer in sorted(graph):
        low_layer = layer_of(importer, package, layers)
        for imported, line in sorted(graph[importer].items()):
            high_layer = layer_of(imported, package, layers)
            if low_layer is None or high_layer is None or high_layer <= low_layer:
                continue
            pair = (relative(importer, package), relative(imported, package))
            if pair in excused:
                used.add(pair)
                continue
            found.append(f"{importer} (layer {low_layer}) imports {imported} (layer {high_layer}) at line {line}")
    return found, [entry for entry in allowed if (entry[0], entry[1]) not in used]


def describe_cycle(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    """The group's modules, and one shortest circle among them with the line of each import."""
    circle = _circle_in(graph, set(group), group[0])
    steps = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:]))
    return f"{len(group)} modules import each other: {', '.join(group)}; e.g. {steps} -> {circle[-1]}"


# ------------------------------------------------------------------------------------------------ the package


def test_no_import_circle():
    graph = import_graph(SRC, PACKAGE)
    cycles = find_cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(describe_cycle(graph, c) for c in cycles)


def test_every_module_has_a_layer():
    graph = import_graph(SRC, PACKAGE)
    missing = unplaced(graph, PACKAGE, LAYERS)
    assert not missing, f"modules without a layer (add them to LAYERS in {Path(__file__).name}): {missing}"
    stale = stale_layers(graph, PACKAGE, LAYERS)
    assert not stale, f"LAYERS lines that name no module: {stale}"


def test_no_upward_import():
    found, unused = upward_imports(import_graph(SRC, PACKAGE), PACKAGE, LAYERS, ALLOWED)
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(found)
    assert not unused, f"ALLOWED lines no import needs any more: {unused}"


# ------------------------------------------------------------------------------------------------ the checker catches


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _fake_package(tmp_path: Path, extra: dict[str, str]) -> dict[str, dict[str, int]]:
    _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/low.py": "import os\n",
        "fake/high.py": "from . import low\nfrom .sub import deep\n",
        "fake/sub/__init__.py": "",
        "fake/sub/deep.py": "from ..low import *\nimport fake.low as low\n",
        **extra,
    })
    return import_graph(tmp_path, "fake")


FAKE_LAYERS = {"__init__": 0, "low": 0, "sub": 1, "high": 2}


def test_checker_passes_a_clean_package(tmp_path):
    graph = _fake_package(tmp_path, {})
    assert graph["fake.high"] == {"fake.low": 1, "fake.sub.deep": 2}
    assert graph["fake.sub.deep"] == {"fake.low": 1}
    assert not find_cycles(graph)
    assert upward_imports(graph, "fake", FAKE_LAYERS, ()) == ([], [])
    assert not unplaced(graph, "fake", FAKE_LAYERS)


def test_checker_finds_a_planted_cycle(tmp_path):
    # low imports high inside a function, relatively: high -> low -> high
    graph = _fake_package(tmp_path, {"fake/low.py": "def f():\n    from .high import x\n"})
    cycles = find_cycles(graph)
    assert cycles == [["fake.high", "fake.low", "fake.sub.deep"]]  # high -> sub.deep -> low too
    assert describe_cycle(graph, cycles[0]) == ("3 modules import each other: fake.high, fake.low, fake.sub.deep; "
                                                "e.g. fake.high (line 1) -> fake.low (line 2) -> fake.high")


def test_checker_finds_a_cycle_through_type_checking_and_a_subpackage(tmp_path):
    graph = _fake_package(tmp_path, {"fake/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                    "    from fake.sub.deep import y\n"})
    assert find_cycles(graph) == [["fake.low", "fake.sub.deep"]]


def test_checker_finds_a_planted_upward_import(tmp_path):
    graph = _fake_package(tmp_path, {"fake/sub/deep.py": "class A:\n    def m(self):\n        from .. import high\n",
                                     "fake/high.py": "from . import low\n"})
    found, unused = upward_imports(graph, "fake", FAKE_LAYERS, ())
    assert found == ["fake.sub.deep (layer 1) imports fake.high (layer 2) at line 3"]
    assert not find_cycles(graph)
    allowed = (("sub.deep", "high", "planted"), ("low", "high", "never imported"))
    assert upward_imports(graph, "fake", FAKE_LAYERS, allowed) == ([], [("low", "high", "never imported")])


def test_checker_finds_a_module_without_a_layer(tmp_path):
    graph = _fake_package(tmp_path, {"fake/extra.py": "", "fake/sub/new.py": ""})
    assert unplaced(graph, "fake", FAKE_LAYERS) == ["fake.extra"]  # sub/new.py: under `sub`
    assert stale_layers(graph, "fake", {**FAKE_LAYERS, "gone": 1}) == ["gone"]

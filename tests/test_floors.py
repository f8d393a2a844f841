"""The floors of the house: every module of aserve stands on one floor and imports only from its own floor or the
floors below it, and no modules import each other in a circle. Types and helpers two rooms share live on the lower
one's floor.

Imports are read from the source with `ast`, at module level and inside functions alike (a lazy import is still an
import; laziness is for start-up time, not for climbing a floor). Imports under `if TYPE_CHECKING:` are annotations
only and are skipped. Lookups by name through importlib (the model registry's families, `aserve`'s lazy public
names, plugins by entry point) are not imports and are not read.

A floor entry names a module, or a package with every module in it; the longest entry that names a module wins.
`pkg.__init__` names a package's own module alone (aserve.quantization's spec, below the kernels of its other modules).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aserve"

# Lowest first: (name, what lives there, entries).
FLOORS = [
    ("ground", "plain data, errors and facts every room may use",
     ["aserve.errors", "aserve.plugins", "aserve.hardware", "aserve.process_exit", "aserve.outputs",
      "aserve.sampling_params", "aserve.request", "aserve.structured_output.params", "aserve.lora.__init__",
      "aserve.lora.request", "aserve.lora.registry", "aserve.pooling.__init__", "aserve.pooling.params"]),
    ("settings", "engine options and the checks that read only config files and class names: no weights",
     ["aserve.config", "aserve.policy", "aserve.models.registry", "aserve.quantization.__init__",
      "aserve.spec_decode.__init__", "aserve.spec_decode.config"]),
    ("core", "scheduling, and the rules requests meet on their way in and out (admission, grammars, tool calls, "
              "proposals)",
     ["aserve.core", "aserve.inputs", "aserve.structured_output", "aserve.tool_parsers", "aserve.pooling.score",
      "aserve.spec_decode"]),
    ("kernels", "tensor ops and weight formats: tensors in, tensors out",
     ["aserve.ops", "aserve.quantization", "aserve.lora.adapter"]),
    ("layers", "what models are built from: the attention seam, linear layers, tensor-parallel pieces, the interface",
     ["aserve.attention", "aserve.models.layers", "aserve.models.parallel", "aserve.models.interface",
      "aserve.lora.layers", "aserve.lora.cache"]),
    ("models", "model families, the flat forward, loading a checkpoint (and applying a weight format to it)",
     ["aserve.models", "aserve.quantization.loading"]),
    ("worker", "one rank's device, model, KV cache and step; executors", ["aserve.worker"]),
    ("engine", "the engine core, its front ends in Python, metrics, the package's public names",
     ["aserve.engine", "aserve.llm", "aserve.metrics", "aserve.__init__"]),
    ("front", "what a user runs: the server, the benchmarks, the command line",
     ["aserve.server", "aserve.bench", "aserve.cli", "aserve.__main__"]),
]


def modules() -> dict[str, Path]:
    """Every module of the package by its import name (a package's own module by the package's name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def floor_of(module: str) -> int:
    name = module + ".__init__" if MODULES[module].name == "__init__.py" else module
    matches = [(len(entry), level) for level, (_, _, entries) in enumerate(FLOORS) for entry in entries
               if name == entry or name.startswith(entry + ".")]
    if not matches:
        pytest.fail(f"{module} stands on no floor: add it to one of FLOORS in {Path(__file__).name}")
    return max(matches)[1]


def type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The aserve modules an import statement names: `from a.b import c` is the module a.b.c where there is one,
    else a.b."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: from the module's own package upwards
            package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names]
    targets = []
    for name in names:
        while name not in MODULES and "." in name:  # `import aserve.x.y` of a name inside a module
            name = name.rpartition(".")[0]
        if name in MODULES and name != module:
            targets.append(name)
    return targets


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}."""
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = type_checking_only(tree)
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                for target in imported(module, node):
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


GRAPH = import_graph()


def test_every_module_stands_on_a_floor():
    assert len(MODULES) > 50  # the package was found
    for module in MODULES:
        floor_of(module)


def test_no_module_imports_from_a_higher_floor():
    climbs = [f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target} "
              f"({FLOORS[floor_of(module)][0]} -> {FLOORS[floor_of(target)][0]})"
              for module, edges in sorted(GRAPH.items()) for target, line in sorted(edges.items())
              if floor_of(target) > floor_of(module)]
    assert not climbs, "imports that run up a floor (move the shared type or helper down):\n" + "\n".join(climbs)


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: each strongly connected group of two or more modules (Tarjan's algorithm), as one
    circle through it."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [circle_through(graph, set(group)) for group in groups]


def circle_through(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """One circle inside a strongly connected group, from its first module back to it (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    return paths[node] + [start]
                if target in group and target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_no_import_circles():
    found = cycles(GRAPH)
    assert not found, "import circles (the shared piece belongs in the lower module):\n" + "\n".join(
        " -> ".join(circle) for circle in found)


def test_the_checks_see_a_climb_and_a_circle():
    """The graph reader and both checks on a made-up house: a lazy import counts, a TYPE_CHECKING one does not."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aserve.cli import main\n"
              "def f():\n    from aserve.llm import LLM\n")
    tree = ast.parse(source)
    skipped = type_checking_only(tree)
    found = [t for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped
             for t in imported("aserve.errors", n)]
    assert found == ["aserve.llm"] and floor_of("aserve.llm") > floor_of("aserve.errors")
    spec, kernel, loading = "aserve.quantization", "aserve.quantization.int8", "aserve.quantization.loading"
    assert floor_of(spec) < floor_of(kernel) < floor_of(loading)
    circle = cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}})
    assert circle == [["a", "b", "c", "a"]]

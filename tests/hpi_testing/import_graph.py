"""The import graph of a source tree, read with `ast` (nothing is imported), and the two rules the layout test
checks on it: no import cycle between modules, and no import from a lower layer into a higher one.

Every `import` and `from ... import` counts, also those inside functions (a lazy import is still a
dependency). Imports under `if TYPE_CHECKING:` count as dependencies for the layer rule (code typed against
a higher layer knows it) but not for cycles (Python never executes them).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    target: str  # the imported module, absolute (a module or a package)
    type_only: bool  # under `if TYPE_CHECKING:`
    line: int


Graph = Mapping[str, frozenset[Import]]  # module -> what it imports (within the prefixes asked for)


def module_names(source_root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `source_root` (a package by its name)."""
    names = {}
    for path in sorted((source_root / package).rglob("*.py")):
        parts = path.relative_to(source_root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: Iterable[str]) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.known = frozenset(known)
        self.found: list[tuple[str, bool, int]] = []
        self._type_only = False

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            outer, self._type_only = self._type_only, True
            for child in node.body:
                self.visit(child)
            self._type_only = outer
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, self._type_only, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:  # relative: `from ..worker import x` in package a.b.models is a.b.worker
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        # `from package import module` depends on the module; on the package only for a name defined there
        # (every import runs the package's __init__, which counts no more here than for `import a.b.c`).
        for alias in node.names:
            submodule = f"{module}.{alias.name}"
            target = submodule if submodule in self.known else module
            self.found.append((target, self._type_only, node.lineno))


def import_graph(modules: Mapping[str, Path], prefixes: Sequence[str]) -> dict[str, frozenset[Import]]:
    """What each module imports whose name starts with one of `prefixes` (e.g. the project's packages)."""
    graph = {}
    for module, path in modules.items():
        visitor = _Imports(module, path.name == "__init__.py", modules)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[module] = frozenset(
            Import(target, type_only, line)
            for target, type_only, line in visitor.found
            if any(target == p or target.startswith(p + ".") for p in prefixes)
        )
    return graph


def layer_of(module: str, layers: Sequence[Sequence[str]]) -> int | None:
    """The index of the layer whose longest matching name claims `module` (a name claims itself and everything
    under it), or None."""
    best: tuple[int, int] | None = None  # (length of the name, layer)
    for index, names in enumerate(layers):
        for name in names:
            claims = module == name or module.startswith(name + ".")
            if claims and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def upward_imports(graph: Graph, layers: Sequence[Sequence[str]]) -> list[str]:
    """'a (layer i) imports b (layer j > i), line n' for every import against the layer order, and
    'x: in no layer' for every module (or import target) no layer claims."""
    problems = []
    for module, imports in sorted(graph.items()):
        own = layer_of(module, layers)
        if own is None:
            problems.append(f"{module}: in no layer")
            continue
        for imp in sorted(imports, key=lambda i: (i.line, i.target)):
            target = layer_of(imp.target, layers)
            if target is None:
                problems.append(f"{module} imports {imp.target} (line {imp.line}), which is in no layer")
            elif target > own:
                problems.append(f"{module} (layer {own}) imports {imp.target} (layer {target}), line {imp.line}")
    return problems


def import_cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), over the
    imports that execute (not TYPE_CHECKING ones), each sorted; Tarjan's algorithm, iteratively."""
    edges = {m: sorted({i.target for i in imps if not i.type_only and i.target in graph}) for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, next_edge = work.pop()
            if next_edge == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if next_edge < len(edges[node]):
                work.append((node, next_edge + 1))
                child = edges[node][next_edge]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if work:  # back in the parent: carry the child's low link up
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    cycles.append(sorted(component))
    return cycles

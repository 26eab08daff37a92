"""Reading the layer map of docs/design.md and the import graph of a source tree, for the layering test
and `scripts/import_graph.py`.

The map is two markdown tables in docs/design.md, each between HTML comment markers: one row per module
or package prefix (module → layer → what it is), and one row per layer (layer → what it may import).
Nothing here holds a copy of either: a tree is checked against the text it is given.

Every `import` statement counts, wherever it is: at module level (*eager*), inside a function (*lazy*)
or under `if TYPE_CHECKING:` (*type*). A type-only import is an arrow too: it ties the two modules
together for every reader and type checker.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

MAP_BEGIN, MAP_END = "<!-- layer-map:begin -->", "<!-- layer-map:end -->"
RULES_BEGIN, RULES_END = "<!-- layer-rules:begin -->", "<!-- layer-rules:end -->"
# A module longer than this says why in a comment line of its own: `# size: <the reason>`.
MAX_LINES = 350
SIZE_MARKER = re.compile(r"^# size: \S", re.MULTILINE)


@dataclass(frozen=True)
class Edge:
    source: str   # the importing module
    target: str   # the imported module (the package itself for `from pkg import name`)
    line: int
    kind: str     # "eager", "lazy" or "type"


@dataclass(frozen=True)
class Module:
    name: str     # dotted, e.g. "cgturn.kernel.procfs" or "scripts.bench"
    path: str     # the source file (.py, or the .pyi of a C extension)


def _table(text: str, begin: str, end: str) -> list[list[str]]:
    """The body rows of the markdown table between two markers, each as its stripped cells."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no table between {begin} and {end}")
    rows = []
    for line in text[start + len(begin):stop].splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if all(set(c) <= set("-: ") for c in cells):
            continue  # the |---| separator
        rows.append(cells)
    return rows[1:]  # the first row is the header


def _name(cell: str) -> str:
    return cell.strip().strip("`").strip()


def parse_map(text: str) -> list[tuple[str, str]]:
    """(module or package prefix, layer) for every row of the layer map."""
    return [(_name(row[0]), _name(row[1])) for row in _table(text, MAP_BEGIN, MAP_END)]


def parse_rules(text: str) -> dict[str, tuple[frozenset[str], tuple[str, ...]]]:
    """layer -> (layers it may import, module prefixes it may import besides), bottom layer first."""
    out: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {}
    for row in _table(text, RULES_BEGIN, RULES_END):
        layer = _name(row[0])
        allowed = [item.strip() for item in row[1].split(",") if item.strip()]
        layers = frozenset(_name(a) for a in allowed if not a.startswith("`"))
        modules = tuple(_name(a) for a in allowed if a.startswith("`"))
        out[layer] = (layers, modules)
    return out


def covers(prefix: str, module: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def modules_of(top: str, package: str, extra: dict[str, str] | None = None) -> list[Module]:
    """Every module of `package` (a directory under `top`), and of each `extra` folder
    (dotted name -> directory; its *.py files only, not its subfolders)."""
    out: list[Module] = []
    pkg_dir = os.path.join(top, package)
    for folder, dirs, files in os.walk(pkg_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, top).replace(os.sep, ".")
        py = {f[:-3] for f in files if f.endswith(".py")}
        stubs = {f[:-4] for f in files if f.endswith(".pyi")} - py   # a C extension's stub
        for stem in sorted(py | stubs):
            name = rel if stem == "__init__" else f"{rel}.{stem}"
            out.append(Module(name, os.path.join(folder, stem + (".py" if stem in py else ".pyi"))))
    for dotted, folder in (extra or {}).items():
        for f in sorted(os.listdir(folder)):
            if f.endswith(".py"):
                out.append(Module(f"{dotted}.{f[:-3]}", os.path.join(folder, f)))
    return sorted(out, key=lambda m: m.name)


def _is_type_checking(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "TYPE_CHECKING"
               or isinstance(n, ast.Attribute) and n.attr == "TYPE_CHECKING" for n in ast.walk(test))


def _imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import node with its kind; a TYPE_CHECKING block inside a function is "type"."""
    out: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, kind))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "type" if kind == "type" else "lazy")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                negated = isinstance(child.test, ast.UnaryOp) and isinstance(child.test.op, ast.Not)
                for stmt in child.body:
                    visit_stmt(stmt, kind if negated else "type")
                for stmt in child.orelse:
                    visit_stmt(stmt, "type" if negated else kind)
            else:
                visit(child, kind)

    def visit_stmt(stmt: ast.stmt, kind: str) -> None:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            out.append((stmt, kind))
        else:
            visit(stmt, kind)

    visit(tree, "eager")
    return out


def edges_of(module: Module, known: set[str], roots: tuple[str, ...]) -> list[Edge]:
    """The imports of `module` that name a module of `known` or below one of `roots`
    (a name below a root that is no module of `known` is kept: the caller reports it as unknown).

    `from pkg import name` points at `pkg.name` when that is a module, else at `pkg`. An absolute
    import of a bare name that is a sibling in an extra folder (scripts import `bench`) is that
    sibling.
    """
    if module.path.endswith(".pyi"):
        return []
    tree = ast.parse(open(module.path, encoding="utf-8").read(), module.path)
    is_init = os.path.basename(module.path) == "__init__.py"
    package = module.name if is_init else module.name.rpartition(".")[0]
    siblings_of = module.name.rpartition(".")[0]

    def resolve(name: str) -> str | None:
        if name.split(".")[0] in roots:
            return name
        sibling = f"{siblings_of}.{name}"
        if not siblings_of.split(".")[0] in roots and sibling in known:
            return sibling
        return None

    out: list[Edge] = []
    for node, kind in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name)
                if target:
                    out.append(Edge(module.name, target, node.lineno, kind))
            continue
        if node.level:
            base = package.split(".")
            base = base[:len(base) - node.level + 1]
            origin: str | None = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = resolve(node.module or "")
        if not origin:
            continue
        for alias in node.names:
            sub = f"{origin}.{alias.name}"
            out.append(Edge(module.name, sub if sub in known else origin, node.lineno, kind))
    return list(dict.fromkeys(out))  # `from m import a, b` is one edge


@dataclass
class Graph:
    """A tree's modules, their layers and their import edges, checked against one map."""
    modules: list[Module]
    rows: list[tuple[str, str]]
    rules: dict[str, tuple[frozenset[str], tuple[str, ...]]]
    edges: list[Edge]
    outside: frozenset[str]   # modules outside the layers (the package root)

    @classmethod
    def load(cls, top: str, package: str, design_text: str, extra: dict[str, str] | None = None) -> Graph:
        modules = modules_of(top, package, extra)
        known = {m.name for m in modules}
        roots = (package,)
        edges = [e for m in modules for e in edges_of(m, known, roots)]
        return cls(modules, parse_map(design_text), parse_rules(design_text), edges, frozenset({package}))

    def layer_of(self, module: str) -> str | None:
        hits = [layer for prefix, layer in self.rows if covers(prefix, module)]
        return hits[0] if len(hits) == 1 else None

    def map_problems(self) -> list[str]:
        """Modules the map misses or maps twice, rows that match nothing, layers without a rule."""
        out = []
        names = [m.name for m in self.modules]
        for name in names:
            if name in self.outside:
                continue
            hits = [prefix for prefix, _ in self.rows if covers(prefix, name)]
            if not hits:
                out.append(f"{name}: missing from the layer map")
            elif len(hits) > 1:
                out.append(f"{name}: mapped twice ({', '.join(hits)})")
        for prefix, layer in self.rows:
            if not any(covers(prefix, name) for name in names):
                out.append(f"{prefix}: a row of the layer map that matches no module")
            if layer not in self.rules:
                out.append(f"{prefix}: layer {layer!r} has no row in the rules table")
        return out

    def allowed(self, source_layer: str, target: str) -> bool:
        layers, modules = self.rules[source_layer]
        if any(covers(p, target) if p not in self.outside else p == target for p in modules):
            return True
        return self.layer_of(target) in layers

    def import_problems(self) -> list[tuple[Edge, str]]:
        """(edge, why) for every import the rules forbid. The package root imports lazily, but for a
        leaf that imports nothing of the package (the version string): `import cgturn` stays free."""
        known = {m.name for m in self.modules}
        importers = {e.source for e in self.edges}
        out = []
        for e in self.edges:
            if e.target not in known:
                out.append((e, "imports a module that does not exist"))
            elif e.source in self.outside:
                bare_leaf = self.layer_of(e.target) == "leaves" and e.target not in importers
                if e.kind == "eager" and not bare_leaf:
                    out.append((e, "the package root imports eagerly (its names resolve lazily)"))
            else:
                mine = self.layer_of(e.source)
                if mine is None or mine not in self.rules:
                    continue  # reported by map_problems
                if not self.allowed(mine, e.target):
                    theirs = "the package root" if e.target in self.outside else self.layer_of(e.target)
                    out.append((e, f"{mine} may not import {theirs}"))
        return out

    def sccs(self) -> list[list[str]]:
        """The strongly connected components of more than one module (or one importing itself) among
        the layered modules (Tarjan), each sorted, over every kind of import."""
        graph: dict[str, set[str]] = {m.name: set() for m in self.modules if m.name not in self.outside}
        for e in self.edges:
            if e.source in graph and e.target in graph:
                graph[e.source].add(e.target)
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        out: list[list[str]] = []
        counter = 0
        for start in sorted(graph):
            if start in index:
                continue
            # Iterative Tarjan: (node, iterator over its successors) frames, no recursion limit.
            index[start] = low[start] = counter
            counter += 1
            stack.append(start)
            on_stack.add(start)
            work = [(start, iter(sorted(graph[start])))]
            while work:
                node, successors = work[-1]
                for nxt in successors:
                    if nxt not in index:
                        index[nxt] = low[nxt] = counter
                        counter += 1
                        stack.append(nxt)
                        on_stack.add(nxt)
                        work.append((nxt, iter(sorted(graph[nxt]))))
                        break
                    if nxt in on_stack:
                        low[node] = min(low[node], index[nxt])
                else:
                    work.pop()
                    if work:
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
                        if len(component) > 1 or node in graph[node]:
                            out.append(sorted(component))
        return sorted(out)

    def edges_within(self, component: list[str]) -> list[Edge]:
        members = set(component)
        return [e for e in self.edges if e.source in members and e.target in members]

    def size_problems(self) -> list[str]:
        """Modules over MAX_LINES lines without a `# size:` line saying why."""
        out = []
        for m in self.modules:
            text = open(m.path, encoding="utf-8").read()
            lines = text.count("\n")
            if lines > MAX_LINES and not SIZE_MARKER.search(text):
                out.append(f"{m.name}: {lines} lines and no `# size:` line saying why")
        return out

"""The import graph of cgturn and scripts/, as the layering test sees it: every edge, its kind (eager,
lazy, type), and the cycles (strongly connected components), as text or Graphviz DOT.

    python3 scripts/import_graph.py            # edges by module, then the cycles
    python3 scripts/import_graph.py --dot      # a drawing: python3 scripts/import_graph.py --dot | dot -Tsvg
    python3 scripts/import_graph.py --cycles   # only the cycles and the edges inside each

Exit status 1 when the graph has a cycle, 0 otherwise. The layer map and rules are read from
docs/design.md, the graph code from tests/layermap.py (the test's own reader).
"""
from __future__ import annotations

import argparse
import os
import sys

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TOP, "tests"))

from layermap import Graph  # noqa: E402

# Layer colours for the drawing, bottom to top.
COLOURS = {"leaves": "#e8f5e9", "kernel": "#eceff1", "state": "#fff8e1", "backends": "#e3f2fd",
           "ownership": "#ede7f6", "supervision": "#fce4ec", "faces": "#fff3e0"}


def dot(graph: Graph) -> str:
    knotted = {m for c in graph.sccs() for m in c}
    lines = ["digraph cgturn {", "  rankdir=BT; node [shape=box, style=filled, fontname=monospace];"]
    for m in graph.modules:
        layer = graph.layer_of(m.name)
        colour = "#ef9a9a" if m.name in knotted else COLOURS.get(layer or "", "white")
        lines.append(f'  "{m.name}" [fillcolor="{colour}", tooltip="{layer or "outside the layers"}"];')
    styles = {"eager": "solid", "lazy": "dashed", "type": "dotted"}
    for e in sorted(set((e.source, e.target, e.kind) for e in graph.edges)):
        lines.append(f'  "{e[0]}" -> "{e[1]}" [style={styles[e[2]]}];')
    lines.append("}")
    return "\n".join(lines)


def text(graph: Graph) -> str:
    out = []
    for m in graph.modules:
        mine = sorted({(e.target, e.kind) for e in graph.edges if e.source == m.name})
        out.append(f"{m.name} [{graph.layer_of(m.name) or 'outside the layers'}]")
        out.extend(f"    -> {target} ({kind})" for target, kind in mine)
    return "\n".join(out + ["", cycles(graph)])


def cycles(graph: Graph) -> str:
    components = graph.sccs()
    if not components:
        return "no cycles"
    out = [f"{len(components)} cycle(s):"]
    for c in components:
        out.append(f"  {len(c)} modules: {', '.join(c)}")
        out.extend(f"    {e.source}:{e.line} ({e.kind}) -> {e.target}" for e in graph.edges_within(c))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--dot", action="store_true", help="print Graphviz DOT")
    how.add_argument("--cycles", action="store_true", help="print only the cycles")
    args = parser.parse_args(argv)
    with open(os.path.join(TOP, "docs", "design.md"), encoding="utf-8") as f:
        graph = Graph.load(TOP, "cgturn", f.read(), extra={"scripts": os.path.join(TOP, "scripts")})
    print(dot(graph) if args.dot else cycles(graph) if args.cycles else text(graph))
    return 1 if graph.sccs() else 0


if __name__ == "__main__":
    sys.exit(main())

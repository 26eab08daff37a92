"""The package's shape, checked by reading its source against the one layer map in docs/design.md.

Every import counts — at module level, inside a function, under `if TYPE_CHECKING:` — and the test
fails on a module the map misses or maps twice, an import the importing layer's row does not allow,
any import cycle, and a module over 350 lines that does not say why. Each check is shown able to fail
on a small package made in tmp_path. Then: every cgroupfs, /proc and ctypes access stays in the
kernel I/O layer.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from layermap import Graph

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(TOP, "cgturn")
DESIGN = os.path.join(TOP, "docs", "design.md")
SCRIPTS = os.path.join(TOP, "scripts")

def cases(check: str) -> list:
    """Every module as a parameter of `check` (one test id per module, so a failure names it)."""
    return list(MODULES)


def load() -> Graph:
    return Graph.load(TOP, "cgturn", open(DESIGN, encoding="utf-8").read(), extra={"scripts": SCRIPTS})


GRAPH = load()
MODULES = [m.name for m in GRAPH.modules]


def test_the_map_names_every_module_once():
    assert GRAPH.map_problems() == []


def _problems_of(module: str) -> list[str]:
    return [f"line {e.line} ({e.kind}): imports {e.target}: {why}"
            for e, why in GRAPH.import_problems() if e.source == module]


@pytest.mark.parametrize("module", cases("imports"))
def test_imports_follow_the_layer_rules(module):
    assert _problems_of(module) == []


@pytest.mark.parametrize("module", cases("cycles"))
def test_no_module_is_in_an_import_cycle(module):
    knots = [c for c in GRAPH.sccs() if module in c]
    assert [(c, [f"{e.source}:{e.line} ({e.kind}) -> {e.target}" for e in GRAPH.edges_within(c)])
            for c in knots] == []


@pytest.mark.parametrize("module", cases("size"))
def test_a_long_module_says_why(module):
    assert [p for p in GRAPH.size_problems() if p.startswith(module + ":")] == []


def test_the_import_graph_script_prints_the_graph_and_its_cycles():
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "import_graph.py"), "--dot"],
                         capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": TOP})
    assert out.returncode in (0, 1), out.stderr
    assert out.stdout.startswith("digraph cgturn {")
    assert '"cgturn.cli.ps" -> "cgturn.cli.common" [style=solid];' in out.stdout
    # Exit 1 exactly when the graph has a cycle, so a script run can gate on it.
    assert out.returncode == (1 if GRAPH.sccs() else 0)


# --- each check can fail: a small package of our own ----------------------------------------------

FAKE_DESIGN = """
<!-- layer-map:begin -->
| module | layer | what |
|---|---|---|
| `pkg.base` | leaves | a leaf |
| `pkg.low` | kernel | kernel I/O |
| `pkg.mid` | ownership | ownership |
| `pkg.sup` | supervision | supervision |
| `pkg.twice` | leaves | mapped once |
| `pkg.twice` | kernel | and again |
| `pkg.gone` | leaves | no such module |
| `pkg.cli` | faces | a face |
| `scripts` | faces | scripts |
<!-- layer-map:end -->
<!-- layer-rules:begin -->
| layer | may import |
|---|---|
| leaves | leaves |
| kernel | kernel, `pkg.base` |
| ownership | ownership, kernel, leaves |
| supervision | supervision, ownership, leaves |
| faces | faces, leaves, `pkg` |
<!-- layer-rules:end -->
"""
FAKE_FILES = {
    "pkg/__init__.py": "from . import base\n",                        # eager: the root must be lazy
    "pkg/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import mid\n",
    "pkg/low.py": "def f():\n    from pkg import sup\n",          # lazy and upwards
    "pkg/mid.py": "from . import base, low\n",                      # closes base -> mid -> base
    "pkg/sup.py": "from .low import thing\n",                       # supervision -> kernel: never
    "pkg/twice.py": "",
    "pkg/stray.py": "",                                              # in no row
    "pkg/cli.py": "import pkg.mid\nfrom pkg import base, nothing\n" + "x = 1\n" * 360,
    "scripts/run.py": "from pkg.cli import main\nfrom pkg.low import y\nimport helper\n",
    "scripts/helper.py": "# size: a helper that is long on purpose\nfrom typing import TYPE_CHECKING\n"
                         "if not TYPE_CHECKING:\n    from pkg import base\n" + "y = 2\n" * 360,  # runs: eager
}


@pytest.fixture
def fake(tmp_path):
    for rel, text in FAKE_FILES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return Graph.load(str(tmp_path), "pkg", FAKE_DESIGN, extra={"scripts": str(tmp_path / "scripts")})


def test_the_map_check_sees_a_missing_a_doubled_and_a_stale_row(fake):
    assert sorted(fake.map_problems()) == [
        "pkg.gone: a row of the layer map that matches no module",
        "pkg.stray: missing from the layer map",
        "pkg.twice: mapped twice (pkg.twice, pkg.twice)",
    ]


def test_the_rule_check_sees_every_kind_of_forbidden_import(fake):
    found = sorted((e.source, e.line, e.kind, e.target, why) for e, why in fake.import_problems())
    assert found == [
        ("pkg", 1, "eager", "pkg.base", "the package root imports eagerly (its names resolve lazily)"),
        ("pkg.base", 3, "type", "pkg.mid", "leaves may not import ownership"),
        ("pkg.cli", 1, "eager", "pkg.mid", "faces may not import ownership"),
        ("pkg.low", 2, "lazy", "pkg.sup", "kernel may not import supervision"),
        ("pkg.sup", 1, "eager", "pkg.low", "supervision may not import kernel"),
        ("scripts.run", 2, "eager", "pkg.low", "faces may not import kernel"),
    ]
    # Allowed: a face's `from pkg import base` (a leaf), the root's names, a sibling script.
    assert {(e.source, e.target) for e in fake.edges} >= {
        ("pkg.cli", "pkg.base"), ("pkg.cli", "pkg"), ("scripts.run", "pkg.cli"), ("scripts.run", "scripts.helper")}
    assert [(e.line, e.kind) for e in fake.edges if e.source == "scripts.helper"] == [(4, "eager")]


def test_the_cycle_check_sees_knots_tied_by_type_only_and_lazy_imports(fake):
    assert fake.sccs() == [["pkg.base", "pkg.mid"], ["pkg.low", "pkg.sup"]]
    assert [(e.source, e.kind) for e in fake.edges_within(["pkg.base", "pkg.mid"])] == [
        ("pkg.base", "type"), ("pkg.mid", "eager")]


def test_the_cycle_check_sees_a_module_importing_itself_and_a_long_loop(tmp_path):
    design = FAKE_DESIGN.replace("| `pkg.gone` | leaves | no such module |\n", "")
    files = {"pkg/__init__.py": "", "pkg/base.py": "def f():\n    from . import base\n",
             "pkg/low.py": "from . import mid\n", "pkg/mid.py": "from . import sup\n",
             "pkg/sup.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import low\n",
             "pkg/twice.py": "", "pkg/cli.py": ""}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = Graph.load(str(tmp_path), "pkg", design)
    assert graph.sccs() == [["pkg.base"], ["pkg.low", "pkg.mid", "pkg.sup"]]


def test_the_size_check_sees_a_long_module_without_a_reason(fake):
    assert fake.size_problems() == ["pkg.cli: 362 lines and no `# size:` line saying why"]


def test_the_real_map_is_read_from_the_design_doc():
    """The map is the design doc's: no copy of it lives in a test."""
    assert GRAPH.layer_of("cgturn.kernel.procfs") == "kernel"
    assert GRAPH.layer_of("scripts.bench") == "faces"
    assert set(GRAPH.rules) == {"leaves", "kernel", "state", "backends", "ownership", "supervision", "faces"}


# --- the kernel I/O layer is the only place that touches cgroupfs, /proc and the C library ---------

KERNEL_DIR = os.path.join(PACKAGE_DIR, "kernel")
# What only the kernel layer may do. State files (audit log, registry, metadata fallback) are not
# kernel interfaces and are opened where they are owned.
CONFINED = {
    "ctypes": re.compile(r"\bctypes\b"),
    "/proc paths": re.compile(r"""["'f]/proc\b"""),
    "cgroup mount paths": re.compile(r"/sys/fs/cgroup"),
    "xattr calls": re.compile(r"\bos\.(set|get|remove|list)xattr\b"),
    "directory calls on cgroupfs": re.compile(r"\bos\.(mkdir|rmdir|scandir)\b"),
    "flock": re.compile(r"\bfcntl\.flock\b"),
}
# Outside kernel/: files that create directories of their own (not cgroups), each with its reason.
MKDIR_OWNERS = {
    os.path.join(PACKAGE_DIR, "backends", "registry_db.py"): "the state directory",
    os.path.join(PACKAGE_DIR, "backends", "metadata.py"): "the record files under the state directory",
    os.path.join(PACKAGE_DIR, "sentinel_locks.py"): "the sentinels' private directory under the state directory",
}


def code_lines(path: str) -> list[tuple[int, str]]:
    """Lines of code with comments and docstrings blanked, so prose may name /proc."""
    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    prose = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            prose.update(range(body[0].lineno, body[0].end_lineno + 1))
    out = []
    for number, line in enumerate(source.splitlines(), 1):
        if number in prose:
            continue
        out.append((number, line.split("#", 1)[0] if "#" in line and "'#" not in line and '"#' not in line else line))
    return out


PACKAGE_SOURCES = {m.name: m.path for m in GRAPH.modules if m.path.endswith(".py") and m.name.startswith("cgturn")}


@pytest.mark.parametrize("path", [p for p in PACKAGE_SOURCES.values() if not p.startswith(KERNEL_DIR + os.sep)],
                         ids=lambda p: next(n for n, q in PACKAGE_SOURCES.items() if q == p))
def test_kernel_interfaces_are_touched_only_in_the_kernel_layer(path):
    found = []
    for number, line in code_lines(path):
        for what, pattern in CONFINED.items():
            if pattern.search(line) and not (what.startswith("directory") and path in MKDIR_OWNERS):
                found.append(f"line {number}: {what}: {line.strip()}")
    assert found == []


def test_ctypes_lives_in_one_module():
    users = [name for name, p in PACKAGE_SOURCES.items()
             if any(CONFINED["ctypes"].search(line) for _, line in code_lines(p))]
    assert users == ["cgturn.kernel.libc"]


def test_the_confinement_check_can_fail(tmp_path):
    """The checks above must be able to see a violation (guards against a pattern that matches nothing)."""
    bad = tmp_path / "bad.py"
    bad.write_text('import ctypes\nx = open(f"/proc/{pid}/stat")\nos.rmdir(p)\nos.setxattr(p, k, v)\n')
    hits = {what for _, line in code_lines(str(bad)) for what, pattern in CONFINED.items() if pattern.search(line)}
    assert hits == {"ctypes", "/proc paths", "directory calls on cgroupfs", "xattr calls"}

"""The package's shape, checked by reading its source: layers import only downwards, faces speak only to
the package, and every cgroupfs, /proc and ctypes access stays in the kernel I/O layer.

faces → supervision → ownership → backends → kernel I/O → leaves (see docs/design.md).
"""
from __future__ import annotations

import ast
import os
import re

import pytest

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cgturn")

ORDER = ("leaves", "kernel", "backends", "ownership", "supervision", "faces")
LAYERS = {
    "leaves": ("cgturn.model", "cgturn.ids", "cgturn.errors", "cgturn.reasons", "cgturn.audit",
               "cgturn.statefiles", "cgturn.limits", "cgturn.clocks", "cgturn.leases", "cgturn.identity",
               "cgturn.outcomes", "cgturn.logfields"),
    "kernel": ("cgturn.kernel", "cgturn._spawn"),  # _spawn: the C extension (clone3 into a cgroup)
    "backends": ("cgturn.backends",),
    "ownership": ("cgturn.manager", "cgturn.governance", "cgturn.turn", "cgturn.killing", "cgturn.recovery", "cgturn.listing",
                  "cgturn.host", "cgturn.processes", "cgturn.admission", "cgturn.keys", "cgturn.control"),
    "supervision": ("cgturn.supervisor", "cgturn.watchdog", "cgturn.sentinel", "cgturn.sentinel_main",
                    "cgturn.guard"),
    "faces": ("cgturn.cli", "cgturn.pytest_plugin", "cgturn.metrics", "cgturn.__main__"),
}
# What a face may import from the package besides its own modules: the package itself (whose names
# resolve lazily) and the leaves (the vocabulary: errors, reasons, model, ids, the audit log reader).
FACE_MAY_IMPORT = ("cgturn",) + LAYERS["leaves"]


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def source_files() -> list[str]:
    out = []
    for folder, _, files in os.walk(PACKAGE_DIR):
        out.extend(os.path.join(folder, f) for f in files if f.endswith(".py"))
    return sorted(out)


def layer_of(module: str) -> str | None:
    """The layer of a cgturn module; None for the package root itself."""
    for layer, prefixes in LAYERS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    return None


def is_module(name: str) -> bool:
    path = os.path.join(os.path.dirname(PACKAGE_DIR), *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def imports_of(path: str) -> list[tuple[str, int]]:
    """(imported cgturn module, line) for every import in the file, TYPE_CHECKING blocks excepted."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    here = module_name(path)
    package = here if path.endswith("__init__.py") else here.rpartition(".")[0]
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "cgturn")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] != "cgturn":
                continue
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                out.append((sub if is_module(sub) else origin, node.lineno))
    return out


def test_every_module_has_a_layer():
    assert [module_name(p) for p in source_files() if layer_of(module_name(p)) is None] == ["cgturn"]


@pytest.mark.parametrize("path", source_files(), ids=lambda p: module_name(p))
def test_imports_point_downwards(path):
    here = module_name(path)
    mine = layer_of(here)
    bad = []
    for target, line in imports_of(path):
        theirs = layer_of(target)
        if mine is None:  # the package root: lazy, imports nothing at import time
            bad.append(f"line {line}: the package root imports {target} eagerly")
        elif mine == "faces":
            if target not in FACE_MAY_IMPORT and layer_of(target) != "faces":
                bad.append(f"line {line}: a face imports {target} (faces use the package: `from cgturn import ...`)")
        elif theirs is None or ORDER.index(theirs) > ORDER.index(mine):
            bad.append(f"line {line}: {mine} module imports {target} ({theirs or 'the package root'}): upwards")
    assert bad == []


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


@pytest.mark.parametrize("path", [p for p in source_files() if not p.startswith(KERNEL_DIR + os.sep)],
                         ids=lambda p: module_name(p))
def test_kernel_interfaces_are_touched_only_in_the_kernel_layer(path):
    found = []
    for number, line in code_lines(path):
        for what, pattern in CONFINED.items():
            if pattern.search(line) and not (what.startswith("directory") and path in MKDIR_OWNERS):
                found.append(f"line {number}: {what}: {line.strip()}")
    assert found == []


def test_ctypes_lives_in_one_module():
    users = [module_name(p) for p in source_files()
             if any(CONFINED["ctypes"].search(line) for _, line in code_lines(p))]
    assert users == ["cgturn.kernel.libc"]


def test_the_confinement_check_can_fail(tmp_path):
    """The checks above must be able to see a violation (guards against a pattern that matches nothing)."""
    bad = tmp_path / "bad.py"
    bad.write_text('import ctypes\nx = open(f"/proc/{pid}/stat")\nos.rmdir(p)\nos.setxattr(p, k, v)\n')
    hits = {what for _, line in code_lines(str(bad)) for what, pattern in CONFINED.items() if pattern.search(line)}
    assert hits == {"ctypes", "/proc paths", "directory calls on cgroupfs", "xattr calls"}

"""mkdocs hooks for the documentation site (mkdocs.yml).

1. Repository files outside docs/ that readers follow links to — README.md (the front page), CHANGELOG.md,
   SECURITY.md, LICENSE, and contrib/ and examples/ — become files of the site under `repo/`, and links to them are
   rewritten: `../README.md` in a page of docs/ becomes `repo/README.md`, `docs/design.md` in the README
   becomes `../design.md`. mkdocs then validates those links and anchors like any other (strict: a broken
   one fails the build), so a README link into docs/ is checked too. On GitHub and in an unpacked sdist the
   files keep their plain relative links.
2. `api.md` is written from `cgturn.__all__` at build time: one mkdocstrings entry per public name, so the
   reference lists exactly what the package exports, with the docstrings it has.
"""
from __future__ import annotations

import importlib
import os
import re

from mkdocs.structure.files import File, Files

REPO = os.path.dirname(os.path.abspath(__file__))
MIRRORED_FILES = ("README.md", "CHANGELOG.md", "SECURITY.md", "LICENSE")
MIRRORED_DIRS = ("contrib", "examples")
MIRROR = "repo"
# a Markdown inline link's target: ](target) — the only link form the pages use
LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s]+)\)")


def _mirrored() -> list[str]:
    paths = [p for p in MIRRORED_FILES if os.path.exists(os.path.join(REPO, p))]
    for folder in MIRRORED_DIRS:
        for base, dirs, names in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            paths += [os.path.relpath(os.path.join(base, n), REPO) for n in sorted(names)]
    return paths


def on_files(files: Files, config) -> Files:
    for rel in _mirrored():
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            files.append(File.generated(config, f"{MIRROR}/{rel}", content=f.read()))
    files.append(File.generated(config, "api.md", content=api_page()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    in_mirror = page.file.src_uri.startswith(MIRROR + "/")
    return LINK.sub(lambda m: f"]({_rewrite(m.group(1), in_mirror)})", markdown)


def _rewrite(target: str, in_mirror: bool) -> str:
    """A link of a page as the site must have it (pages of docs/ sit at its top; mirrored files keep the
    repository's layout under repo/)."""
    if in_mirror:
        # a mirrored top-level file links into docs/ as docs/X: the site has X one level up
        return "../" + target[len("docs/"):] if target.startswith("docs/") else target
    return MIRROR + "/" + target[len("../"):] if target.startswith("../") else target


API_INTRO = """# API reference

Everything `cgturn` exports (`cgturn.__all__`), generated from the docstrings when the site is built.
Names resolve lazily: `import cgturn` is cheap and each name loads its module on first use. What the names
promise and how long a deprecated one stays: [versions.md](versions.md).
"""


def api_page() -> str:
    """The reference page: the classes, then the exceptions, then functions and constants."""
    package = importlib.import_module("cgturn")
    errors = importlib.import_module("cgturn.errors")
    groups: dict[str, list[str]] = {"Classes": [], "Exceptions": [], "Functions": [], "Constants": []}
    for name in sorted(package.__all__):
        value = getattr(package, name)
        if isinstance(value, type) and issubclass(value, errors.CgturnError):
            groups["Exceptions"].append(name)
        elif isinstance(value, type):
            groups["Classes"].append(name)
        elif callable(value):
            groups["Functions"].append(name)
        else:
            groups["Constants"].append(name)
    out = [API_INTRO]
    for title, names in groups.items():
        if names:
            out.append(f"## {title}\n")
            out += [f"::: cgturn.{name}\n" for name in names]
    return "\n".join(out)

"""The test host's recipe, on this machine (no guest needed): apt sources parsing, the cache key."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.parse

import pytest

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(CHECKOUT, "scripts", "testhost"))
import image  # noqa: E402


def test_one_line_sources():
    text = ("# comment\ndeb-src http://a.example/debian bookworm main\n"
            "deb [signed-by=/k.gpg arch=amd64] http://m.example/debian bookworm main contrib # tail\n"
            "deb http://m.example/debian-security bookworm-security main\n")
    assert image.parse_one_line_sources(text) == [
        ("http://m.example/debian", "bookworm", ["main", "contrib"]),
        ("http://m.example/debian-security", "bookworm-security", ["main"]),
    ]


def test_deb822_sources():
    text = ("Types: deb deb-src\n# http://other.example/x\nURIs: http://m.example/debian\n"
            "Suites: bookworm bookworm-updates\nComponents: main\n\n"
            "Types: deb\nURIs: http://off.example/debian\nSuites: trixie\nComponents: main\nEnabled: no\n\n"
            "Types: deb-src\nURIs: http://src.example/debian\nSuites: trixie\nComponents: main\n")
    assert image.parse_deb822_sources(text) == [
        ("http://m.example/debian", "bookworm", ["main"]),
        ("http://m.example/debian", "bookworm-updates", ["main"]),
    ]


def test_mirror_is_the_first_debian_archive_with_main(tmp_path, monkeypatch):
    monkeypatch.delenv("CGTURN_TESTHOST_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "a-vendor.list").write_text("deb https://vendor.example/apt cloud-sdk main\n")
    (tmp_path / "sources.list.d" / "b-security.sources").write_text(
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: trixie-security\nComponents: main\n")
    (tmp_path / "sources.list.d" / "c-debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: trixie\nComponents: main\n")
    assert image.debian_mirror(str(tmp_path)) == "http://mirror.example/debian"


def test_no_debian_archive_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.delenv("CGTURN_TESTHOST_MIRROR", raising=False)
    (tmp_path / "sources.list").write_text("deb https://vendor.example/apt cloud-sdk main\n")
    with pytest.raises(image.BuildError, match="no Debian archive with 'main'"):
        image.debian_mirror(str(tmp_path))


def test_recipe_hash_is_stable_and_covers_the_package_list(monkeypatch):
    first = image.recipe_hash()
    assert image.recipe_hash() == first
    monkeypatch.setattr(image, "PACKAGES", [*image.PACKAGES, "strace"])
    assert image.recipe_hash() != first


def test_the_repository_names_no_mirror_of_this_machine():
    try:
        mirror = image.debian_mirror()
    except image.BuildError:
        pytest.skip("this machine's apt names no Debian archive")
    host = urllib.parse.urlsplit(mirror).hostname
    files = []
    if shutil.which("git"):
        files = subprocess.run(["git", "-C", CHECKOUT, "ls-files"], capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    hits = []
    for rel in files:
        try:
            with open(os.path.join(CHECKOUT, rel), encoding="utf-8", errors="ignore") as f:
                if host in f.read():
                    hits.append(rel)
        except OSError:
            pass
    assert hits == [], f"{host} is written in {hits}"

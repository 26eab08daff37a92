"""What a user of a release relies on besides the library: one version everywhere, `cgturn --version`,
`cgturn doctor` telling when the clone3 extension is missing, and README links that resolve. The build
itself (sdist completeness, the manylinux wheel, a turn from a fresh venv) is checked by .ci/release."""
import json
import os
import re
import subprocess
import tomllib
import pytest

import cgturn
from cgturn import _version
from conftest import PY, REPO, cgturn_argv, cgturn_env, cli

# The in-process import of the extension fails as it does where it was never built: an entry of None in
# sys.modules makes `import cgturn._spawn` raise ImportError (the import system's documented switch).
WITHOUT_EXTENSION = """
import sys
sys.modules["cgturn._spawn"] = None
from cgturn.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_version_has_one_source():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cgturn._version.__version__"}
    assert cgturn.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", cgturn.__version__)


def test_cgturn_version_prints_name_and_version():
    out = subprocess.run([PY, "-m", "cgturn", "--version"], capture_output=True, text=True, timeout=30,
                         env=cgturn_env())
    assert (out.returncode, out.stdout, out.stderr) == (0, f"cgturn {cgturn.__version__}\n", "")


def test_doctor_prints_the_spawn_paths(cgroup2_root, state_dir):
    data = json.loads(cli(cgroup2_root, state_dir, "doctor", "--json").stdout)
    text = cli(cgroup2_root, state_dir, "doctor").stdout
    assert f"spawn paths:    {' '.join(data['spawn_paths'])}\n" in text
    assert "clone3" in data["spawn_paths"]  # built for this checkout (CI builds it)
    assert not any("extension" in p for p in data["problems"])


def test_doctor_names_a_missing_extension_as_a_problem(cgroup2_root, state_dir):
    """Where the shim is what is left (glibc < 2.39 has no posix_spawn path, as here)."""
    from cgturn import testing

    if testing.spawn_path_unavailable(testing.POSIX_SPAWN) is None:
        pytest.skip("glibc 2.39+: the posix_spawn path serves where the extension is not built")
    argv = cgturn_argv(cgroup2_root, state_dir, "doctor", "--json")
    out = subprocess.run([PY, "-c", WITHOUT_EXTENSION, *argv[3:]], capture_output=True, text=True, timeout=60,
                         env=cgturn_env())
    assert out.returncode == 0, out.stderr  # a problem, not a failure: the shim works
    data = json.loads(out.stdout)
    assert "clone3" not in data["spawn_paths"] and data["spawn_paths"][-1] == "shim"
    assert [p for p in data["problems"] if "cgturn._spawn is not built" in p]
    text = subprocess.run([PY, "-c", WITHOUT_EXTENSION, *argv[3:-1]], capture_output=True, text=True,
                          timeout=60, env=cgturn_env()).stdout
    assert "problem:        the clone3 extension cgturn._spawn is not built" in text


def test_the_registry_does_not_report_the_extension(state_dir):
    """It spawns with plain Popen: the extension is no problem of its."""
    argv = cgturn_argv(None, state_dir, "doctor", "--json", backend="registry")
    out = subprocess.run([PY, "-c", WITHOUT_EXTENSION, *argv[3:]], capture_output=True, text=True, timeout=60,
                         env=cgturn_env())
    assert not any("extension" in p for p in json.loads(out.stdout)["problems"])


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(path: str) -> set[str]:
    """The anchors of a page's headings as GitHub makes them, and the site too (mkdocs.yml's slugify):
    lower case, punctuation dropped, each space a hyphen."""
    anchors = set()
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                title = line.lstrip("#").strip().lower()
                anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_readme_links_into_the_repository_resolve():
    """README is the package page's text: every relative link must name a file the sdist carries, and an
    anchor must name a heading of that page."""
    with open(os.path.join(REPO, "README.md")) as f:
        links = [m for m in LINK.findall(f.read()) if "://" not in m and not m.startswith("mailto:")]
    assert links
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        path = os.path.join(REPO, target) if target else os.path.join(REPO, "README.md")
        if not os.path.exists(path):
            broken.append(link)
        elif anchor and path.endswith(".md") and anchor not in heading_anchors(path):
            broken.append(link)
    assert broken == []


def test_sys_modules_none_really_blocks_the_extension():
    """The switch the tests above rely on: without it they would test nothing."""
    out = subprocess.run([PY, "-c", 'import sys; sys.modules["cgturn._spawn"] = None\n'
                          "from cgturn.kernel import spawn; print(spawn.clone3_built())"],
                         capture_output=True, text=True, timeout=30, env=cgturn_env())
    assert out.stdout.strip() == "False", out.stderr

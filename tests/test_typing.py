"""The package is typed (py.typed): user code type-checks against the public API with `mypy --strict`,
and the types are the documented ones (assert_type in tests/typecheck/user_code.py)."""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_CODE = os.path.join(REPO, "tests", "typecheck", "user_code.py")

pytest.importorskip("mypy", reason="mypy is in the test extras: pip install -e '.[test]'")


def mypy(tmp_path, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MYPYPATH=REPO, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental",
                           "--cache-dir", str(tmp_path / "cache"), path],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_user_code_type_checks_against_the_public_api(tmp_path):
    out = mypy(tmp_path, USER_CODE)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_wrong_use_of_the_api_is_caught(tmp_path):
    """The check above can fail: a type the API does not return is reported."""
    wrong = tmp_path / "wrong.py"
    shutil.copy(USER_CODE, wrong)
    with open(wrong, "a", encoding="utf-8") as f:
        f.write("\n\ndef wrong(info: TurnInfo) -> None:\n    assert_type(info.ports, list[dict[str, Any]])\n")
    out = mypy(tmp_path, str(wrong))
    assert out.returncode == 1 and 'Expression is of type "list[Port]"' in out.stdout, out.stdout

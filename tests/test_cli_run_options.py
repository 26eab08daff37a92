"""`cgturn run --keep-for` and `--key` on the real kernel: the lease its survivors get, one instance per key."""
import json
import os
import subprocess

from conftest import PY, alive, cgturn_env, cli, wait_until

DAEMON = "sleep 300 </dev/null >/dev/null 2>&1 & echo $!"


def test_keep_for_gives_the_survivors_a_lease(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "run", "--task", "lease", "--turn", "t", "--keep-for", "600", "--",
              "sh", "-c", DAEMON)
    assert out.returncode == 0, out.stderr
    daemon = int(out.stdout)
    rows = json.loads(cli(cgroup2_root, state_dir, "ps", "--json").stdout)
    assert [(r["turn"], r["state"], r["expires_at"] is not None) for r in rows] == [("t", "completed", True)]
    assert alive(daemon)
    assert cli(cgroup2_root, state_dir, "end", "lease").returncode == 0
    assert wait_until(lambda: not alive(daemon))


def test_a_second_run_with_the_same_key_exits_125_while_the_first_runs(cgroup2_root, state_dir):
    argv = [PY, "-m", "cgturn", "--root", cgroup2_root, "--state-dir", state_dir, "run", "--task", "keys",
            "--key", "dev-server", "--", "sleep", "300"]
    first = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=cgturn_env())
    try:
        assert wait_until(lambda: any(r["keys"] for r in json.loads(
            cli(cgroup2_root, state_dir, "ps", "--json").stdout)), timeout=20)
        second = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=cgturn_env())
        assert second.returncode == 125 and "dev-server" in second.stderr, second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
    finally:
        first.terminate()
        assert first.wait(timeout=30) == 143

"""The CLI, in process (parsing, bad input) and as a real subprocess (exit statuses, signals)."""
import json
import os
import signal

import pytest

from cgturn import TurnManager
from cgturn.cli import main
from conftest import alive, audit_records, cgturn_popen, cli, wait_until


def test_doctor_json(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "doctor", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["backend"] == "cgroup2"
    assert data["managed_root"] == cgroup2_root
    # Decided without writing: no probe directory, so unknown (null) until a cgroup exists to look at.
    assert data["cgroup_kill"] in (True, None)
    with open(os.path.join(os.path.dirname(cgroup2_root), "cgroup.controllers")) as f:
        assert data["controllers"] == f.read().split()  # the root does not exist: its parent's
    assert data["problems"] == []
    assert not os.path.exists(cgroup2_root)  # doctor leaves nothing behind
    os.mkdir(cgroup2_root)  # once the root exists, its own cgroup.kill file answers
    again = json.loads(cli(cgroup2_root, state_dir, "doctor", "--json").stdout)
    assert again["cgroup_kill"] is True


def test_doctor_reports_registry_when_asked(state_dir):
    out = cli(None, state_dir, "doctor", "--json", backend="registry")
    assert out.returncode == 0 and json.loads(out.stdout)["backend"] == "registry"
    assert os.listdir(state_dir) == []  # read-only: not even the registry database


@pytest.mark.parametrize("argv, code", [
    (["sh", "-c", "exit 3"], 3),
    (["true"], 0),
    (["sh", "-c", "kill -TERM $$"], 128 + signal.SIGTERM),
    (["cgturn-no-such-command"], 127),
    (["{noexec}"], 126),
])
def test_run_passes_the_exit_status_through(cgroup2_root, state_dir, tmp_path, argv, code):
    noexec = tmp_path / "noexec"
    noexec.write_text("#!/bin/sh\n")
    argv = [a.format(noexec=noexec) for a in argv]
    out = cli(cgroup2_root, state_dir, "run", "--", *argv)
    assert out.returncode == code, out.stderr


@pytest.mark.parametrize("args", [
    ["run"],
    ["run", "--"],
    ["run", "--task", "", "--", "true"],  # validated before a sentinel starts (nothing written)
    ["run", "--task", "   ", "--", "true"],
    ["run", "--timeout", "-1", "--", "true"],
    ["run", "--timeout", "abc", "--", "true"],
    ["run", "--grace", "nan", "--", "true"],
    ["--bogus", "doctor"],
    ["nosuchcommand"],
    [],
    ["ps", "--task", ""],
    ["ps", "--task", "  "],
    ["ps", "--bogus"],
    ["stop"],
    ["stop", "chat"],
    ["stop", "", "t"],
    ["stop", "chat", " "],
    ["stop", "chat", "t", "--grace", "-1"],
    ["stop", "chat", "t", "--grace", "inf"],
    ["stop", "chat", "t", "--reason", " "],
    ["end"],
    ["end", ""],
    ["end", "a", "b"],
    ["reap", "extra"],
    ["watch", "--interval", "0"],
    ["watch", "--interval", "x"],
    ["watch", "--task", ""],
    ["metrics"],
    ["metrics", "--listen", "9464"],
    ["metrics", "--listen", "127.0.0.1:99999"],
    ["metrics", "--listen", "::1:9464"],
    ["metrics", "--listen", ":9464"],
    ["metrics", "--listen", "127.0.0.1:1", "--once"],
    ["--backend", "bogus", "ps"],
])
def test_bad_input_exits_2_with_one_line_and_touches_nothing(cgroup2_root, state_dir, args, capsys):
    code = main(["--root", cgroup2_root, "--state-dir", state_dir, *args])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("cgturn: ") and "Traceback" not in err
    assert captured.out == ""
    assert not os.path.exists(cgroup2_root) and os.listdir(state_dir) == []


def test_existing_turn_id_exits_2(cgroup2_root, state_dir):
    p = cgturn_popen(cgroup2_root, state_dir, "run", "--task", "t", "--turn", "x", "--",
                     "sh", "-c", "echo up; exec sleep 300")
    try:
        assert p.stdout.readline().strip() == "up"
        out = cli(cgroup2_root, state_dir, "run", "--task", "t", "--turn", "x", "--", "true")
        assert out.returncode == 2 and "already exists" in out.stderr
        assert out.stderr.count("\n") == 1
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 143


def _pid_of_background(stdout) -> int:
    return int(stdout.strip().split()[-1])


def test_background_processes_survive_completion(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "run", "--task", "bg", "--", "sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!")
    assert out.returncode == 0
    pid = _pid_of_background(out.stdout)
    assert alive(pid)
    # the turn is completed and still owns its survivor: only a forced abandon or end kills it
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir) as m:
        assert [(i.state, i.pids) for i in m.turns("bg")] == [("completed", [pid])]
        m.end_task("bg")
    assert wait_until(lambda: not alive(pid))


def test_reap_on_exit_kills_what_the_command_left(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "run", "--reap-on-exit", "--grace", "0", "--",
              "sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!")
    assert out.returncode == 0
    assert wait_until(lambda: not alive(_pid_of_background(out.stdout)))


def test_timeout_abandons_the_turn_and_exits_124(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "run", "--timeout", "0.5", "--grace", "0.2", "--",
              "sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!; exec sleep 300")
    assert out.returncode == 124
    assert wait_until(lambda: not alive(_pid_of_background(out.stdout)))
    records = audit_records(state_dir)
    assert records[-1]["reason"] == "timeout" and records[-1]["signals"][0] == "SIGTERM"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_to_cgturn_run_abandons_the_turn(cgroup2_root, state_dir, sig, code):
    p = cgturn_popen(cgroup2_root, state_dir, "run", "--grace", "0.2",
                     "--", "sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!; exec sleep 300")
    daemon = int(p.stdout.readline())
    p.send_signal(sig)
    assert p.wait(timeout=30) == code
    assert wait_until(lambda: not alive(daemon))


def test_ctrl_c_that_also_ends_the_command_still_abandons(cgroup2_root, state_dir):
    """SIGINT to the whole process group: the command exits from it first, the turn is still abandoned."""
    p = cgturn_popen(cgroup2_root, state_dir, "run", "--grace", "0",
                     "--", "sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!; exec sleep 300",
                     start_new_session=True)
    daemon = int(p.stdout.readline())
    os.killpg(p.pid, signal.SIGINT)
    assert p.wait(timeout=30) == 130
    assert wait_until(lambda: not alive(daemon))


def test_global_options_work_before_and_after_the_command(cgroup2_root, state_dir, capsys):
    assert main(["ps", "--root", cgroup2_root, "--state-dir", state_dir, "--json"]) == 0
    assert main(["--root", cgroup2_root, "ps", "--state-dir", state_dir, "--json"]) == 0
    assert capsys.readouterr().out.split() == ["[]", "[]"]

"""One instance per key on both backends: a key blocks a duplicate in the same turn, in another turn of
the task (completed included) and from another process, frees once its process exits, and two
processes spawning with one key at once start exactly one."""
import json
import signal
import subprocess
import textwrap

import pytest

from cgturn import AlreadyRunning, CgturnError
from conftest import PY, cgturn_env, cli, wait_until

SLEEP = ["sleep", "300"]


def ps_keys(manager):
    out = cli(manager.root, manager.state_dir, "ps", "--json", backend=manager.backend_name)
    assert out.returncode == 0, out.stderr
    return {row["turn"]: row["keys"] for row in json.loads(out.stdout)}


def test_a_key_blocks_a_duplicate_in_the_task_until_its_process_exits(manager):
    first_turn = manager.begin_turn("dev", "first")
    server = first_turn.spawn(SLEEP, key="dev-server")
    with pytest.raises(AlreadyRunning) as err:
        first_turn.spawn(SLEEP, key="dev-server")
    assert err.value.pid == server.pid and err.value.key == "dev-server"
    assert isinstance(err.value, CgturnError) and "held by process" in str(err.value)
    other = first_turn.spawn(SLEEP, key="watcher")  # another key: no conflict
    first_turn.complete()  # survivors keep their keys
    second = manager.begin_turn("dev", "second")
    with pytest.raises(AlreadyRunning) as err:
        second.spawn(SLEEP, key="dev-server")
    assert err.value.pid == server.pid
    elsewhere = manager.begin_turn("other-task", "t").spawn(SLEEP, key="dev-server")  # keys are per task
    assert ps_keys(manager)["first"] == {"dev-server": server.pid, "watcher": other.pid}
    # the key names the process spawned, not what it left behind: once it exits, the key is free
    server.kill()
    assert server.wait(timeout=10) == -signal.SIGKILL
    again = second.spawn(SLEEP, key="dev-server")
    assert ps_keys(manager) == {"first": {"watcher": other.pid}, "second": {"dev-server": again.pid},
                                "t": {"dev-server": elsewhere.pid}}
    for bad in ("", "  ", "a\x00b", 5):
        with pytest.raises(ValueError):
            second.spawn(SLEEP, key=bad)
    manager.end_task("dev")
    manager.end_task("other-task")


# Begins its own turn of task "race", says "ready", waits for "go", spawns with key "one".
CONTENDER = textwrap.dedent("""
    import json, sys
    from cgturn import AlreadyRunning, TurnManager
    root, backend, state, name = sys.argv[1] or None, sys.argv[2], sys.argv[3], sys.argv[4]
    with TurnManager(root=root, backend=backend, state_dir=state, sentinel=False) as mgr:
        turn = mgr.begin_turn("race", name)
        print("ready", flush=True)
        sys.stdin.readline()
        try:
            p = turn.spawn(["sleep", "300"], key="one", stdin=-3, stdout=-3)  # DEVNULL: not our pipe
            print(json.dumps({"spawned": p.pid}), flush=True)
        except AlreadyRunning as err:
            print(json.dumps({"refused": err.pid}), flush=True)
""")


def contender(manager, name):
    p = subprocess.Popen([PY, "-c", CONTENDER, manager.root or "", manager.backend_name, manager.state_dir, name],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=cgturn_env())
    assert p.stdout.readline() == "ready\n"
    return p


def test_a_key_blocks_a_spawn_from_another_process(manager):
    turn = manager.begin_turn("race", "mine")
    mine = turn.spawn(SLEEP, key="one")
    p = contender(manager, "theirs")
    out, _ = p.communicate("go\n", timeout=60)
    assert json.loads(out) == {"refused": mine.pid}
    manager.end_task("race")


@pytest.mark.parametrize("rounds", [5])
def test_concurrent_spawns_with_one_key_start_exactly_one(manager, rounds):
    for i in range(rounds):
        procs = [contender(manager, f"r{i}-{n}") for n in range(2)]
        for p in procs:  # both are past begin_turn: released together
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
        spawned = [r["spawned"] for r in results if "spawned" in r]
        refused = [r["refused"] for r in results if "refused" in r]
        assert len(spawned) == 1 and refused == spawned, results
        running = [pid for info in manager.turns("race") for pid in info.pids]
        assert running == spawned
        manager.end_task("race")
        assert wait_until(lambda: manager.turns("race") == [])

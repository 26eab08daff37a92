"""Per-turn observation on the real kernel: listening ports (sock_diag and the psutil fallback), memory."""
import json
import os
import socket
import subprocess
import time

import pytest

from cgturn import Port, TurnManager
from cgturn.kernel import observe
from conftest import PY, cli, wait_until


def serve_http(turn) -> tuple[subprocess.Popen, int]:
    """`python -m http.server 0` inside the turn; returns it and the port it bound."""
    proc = turn.spawn([PY, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"],
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (http://127.0.0.1:N/) ..."
    return proc, int(line.split(" port ")[1].split()[0])


def ports_of(manager, task):
    [info] = manager.turns(task)
    return info.ports


def test_ports_of_a_turn_running_http_server(manager):
    outside = socket.socket()
    outside.bind(("127.0.0.1", 0))
    outside.listen()
    try:
        turn = manager.begin_turn("web", "t-1")
        _, port = serve_http(turn)
        want = Port("tcp", "127.0.0.1", port)
        assert wait_until(lambda: want in ports_of(manager, "web"), timeout=10)
        # a socket of a process outside the turn (ours) is not the turn's
        assert outside.getsockname()[1] not in [p.port for p in ports_of(manager, "web")]
        [info] = manager.turns("web")
        assert info.memory_bytes is not None and info.memory_bytes > 1_000_000  # a Python process' RSS
        turn.abandon("test", grace=0)
    finally:
        outside.close()


def test_ports_fall_back_to_psutil_when_sock_diag_is_unusable(cgroup2_root, state_dir, monkeypatch):
    def refused():
        raise observe.DiagUnavailable("forced by the test")

    monkeypatch.setattr(observe, "listening_sockets", refused)
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir) as mgr:
        turn = mgr.begin_turn("web", "t-1")
        _, port = serve_http(turn)
        assert wait_until(lambda: Port("tcp", "127.0.0.1", port) in ports_of(mgr, "web"),
                          timeout=10)
        turn.abandon("test", grace=0)


def test_sock_diag_cgroup_id_is_the_directory_inode(cgroup2_root):
    """The fact the port mapping rests on, checked on this kernel with a listener in a fresh cgroup."""
    os.mkdir(cgroup2_root)
    code = ("import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); sys.stdin.read()")
    shim = f'echo $$ > "{cgroup2_root}/cgroup.procs" && exec "$@"'
    proc = subprocess.Popen(["sh", "-c", shim, "sh", PY, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        mine = [s for s in observe.listening_sockets() if s.port == port]
        assert [s.cgroup_id for s in mine] == [os.stat(cgroup2_root).st_ino]
        assert observe.ports_in_cgroups(observe.by_cgroup(mine), observe.cgroup_ids(cgroup2_root)) == [
            Port("tcp", "127.0.0.1", port)]
    finally:
        proc.kill()
        proc.wait()


def test_udp_sockets_count_only_while_unconnected():
    bound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    bound.bind(("127.0.0.1", 0))
    connected = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    connected.connect(bound.getsockname())
    try:
        ports = {(s.proto, s.port) for s in observe.listening_sockets()}
        assert ("udp", bound.getsockname()[1]) in ports
        assert ("udp", connected.getsockname()[1]) not in ports
        mine = observe.ports_of_pids([os.getpid()])
        assert Port("udp", "127.0.0.1", bound.getsockname()[1]) in mine
        assert connected.getsockname()[1] not in [p.port for p in mine]
    finally:
        bound.close()
        connected.close()


@pytest.mark.parametrize("pids, expect", [([], 0), ([2 ** 22 + 1], None)])
def test_rss_of_nothing_readable(pids, expect):
    assert observe.rss_bytes(pids) == expect


# The documented `cgturn ps --json` object, key for key and in this order (docs/operations.md).
PS_JSON_KEYS = ["task", "turn", "state", "pids", "owner_pid", "reason", "cpu_seconds", "memory_bytes", "ports",
                "path", "frozen", "sealed", "network", "started_at", "limits", "oom_kills", "pids_max_hits",
                "memory_peak_bytes", "cpu_throttled_seconds", "pressure", "expires_at", "keys", "age_seconds"]


def test_turn_info_ports_are_typed_and_ps_json_keeps_their_shape(cgroup2_root, state_dir):
    """A real listener in a real turn: TurnInfo.ports holds `Port`s, `age_seconds` grows from started_at,
    and `cgturn ps --json` (a real subprocess) prints the same ports and age as plain JSON objects."""
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir) as mgr:
        turn = mgr.begin_turn("web", "t-1")
        try:
            _, port = serve_http(turn)
            assert wait_until(lambda: Port("tcp", "127.0.0.1", port) in ports_of(mgr, "web"), timeout=10)
            [info] = mgr.turns("web", detail=True)
            assert info.ports == [Port("tcp", "127.0.0.1", port)]
            assert all(type(p) is Port for p in info.ports)
            earlier = info.age_seconds
            assert 0 <= earlier <= time.time() - info.started_at
            out = cli(cgroup2_root, state_dir, "ps", "--json")
            assert out.returncode == 0, out.stderr
            [row] = json.loads(out.stdout)
            assert list(row) == PS_JSON_KEYS
            assert row["ports"] == [{"proto": "tcp", "address": "127.0.0.1", "port": port}]
            assert row == {**info.to_json(), "age_seconds": row["age_seconds"], "pids": row["pids"],
                           "cpu_seconds": row["cpu_seconds"], "memory_bytes": row["memory_bytes"],
                           "memory_peak_bytes": row["memory_peak_bytes"], "pressure": row["pressure"],
                           "cpu_throttled_seconds": row["cpu_throttled_seconds"]}
            assert earlier <= row["age_seconds"] <= time.time() - info.started_at + 0.001
        finally:
            turn.abandon("test", grace=0)

"""examples/gateway.py, started for real and driven over HTTP through the scenarios a gateway meets:
a completed turn's background server survives until the session ends; a client that goes away takes its
turn's setsid daemon with it; an inactivity timeout fires while the gateway's event loop is blocked;
`cgturn stop` from outside shows in the outcome with its reason, pids and killer; 200 concurrent turns
with random stops, disconnects and completions leave nothing behind.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess

import pytest

from conftest import PY, REPO, alive, audit_reasons, cgturn_env, cgturn_popen, wait_until

pytestmark = [pytest.mark.cgroup2, pytest.mark.root]

GATEWAY = os.path.join(REPO, "examples", "gateway.py")
SETSID_DAEMON = ("python3 -c 'import os; os.setsid(); print(os.getpid(), flush=True); "
                 "os.execvp(\"sleep\", [\"sleep\", \"300\"])' & ")


class Gateway:
    """The example, running as its own process on a test root; every call is one HTTP request."""

    def __init__(self, root: str, state_dir: str):
        self.root, self.state_dir = root, state_dir
        self.proc = subprocess.Popen([PY, GATEWAY, "--port", "0", "--root", root, "--state-dir", state_dir],
                                     stdout=subprocess.PIPE, text=True, env=cgturn_env())
        line = self.proc.stdout.readline()
        match = re.fullmatch(r"listening on (\d+)\n", line)
        assert match, f"the gateway did not start: {line!r}"
        self.port = int(match.group(1))

    def open(self, method: str, path: str, body: str = "") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        data = body.encode()
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        return sock

    def call(self, method: str, path: str) -> object:
        with self.open(method, path) as sock:
            return json.loads(body_of(read_all(sock)))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def body_of(response: bytes) -> bytes:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body


def run_lines(sock: socket.socket) -> tuple[list[str], dict]:
    """A finished /run response: the command's output lines and the outcome (its last line)."""
    lines = body_of(read_all(sock)).decode().splitlines()
    return lines[:-1], json.loads(lines[-1])


def first_line(sock: socket.socket) -> tuple[str, bytes]:
    """The first output line of a /run still in flight, and what was read after it."""
    data = b""
    while b"\n" not in data.partition(b"\r\n\r\n")[2]:
        chunk = sock.recv(4096)
        assert chunk, f"the response ended early: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    line, _, rest = body.partition(b"\n")
    return line.decode(), head + b"\r\n\r\n" + rest


@pytest.fixture
def gateway(cgroup2_root, state_dir):
    gw = Gateway(cgroup2_root, state_dir)
    yield gw
    gw.stop()  # cgroup2_root then kills what is left and removes the root


def test_a_background_server_survives_completion_and_dies_at_session_end(gateway):
    with gateway.open("POST", "/sessions/s1/run", "sleep 300 & echo $!") as sock:
        lines, outcome = run_lines(sock)
    server = int(lines[0])
    assert outcome["outcome"] == "completed" and outcome["exit"] == 0
    assert alive(server)
    [turn] = gateway.call("GET", "/sessions/s1/turns")
    assert turn["state"] == "completed" and turn["pids"] == [server]

    ended = gateway.call("POST", "/sessions/s1/end")
    assert server in ended["killed"] and ended["refused"] == []
    assert wait_until(lambda: not alive(server))
    assert gateway.call("GET", "/sessions/s1/turns") == []


def test_a_client_disconnect_kills_its_setsid_daemon(gateway):
    sock = gateway.open("POST", "/sessions/s2/run", SETSID_DAEMON + "exec sleep 300")
    line, _ = first_line(sock)
    daemon = int(line)
    assert os.getsid(daemon) == daemon  # it left the gateway's session: no process-group kill finds it
    sock.close()
    assert wait_until(lambda: not alive(daemon), timeout=30)
    # The audit line is written once the kill is done and the cgroup removed, after the daemon died.
    assert wait_until(lambda: "disconnect" in audit_reasons(gateway.state_dir), timeout=30)


def test_a_blocked_event_loop_still_times_out(gateway):
    with gateway.open("POST", "/sessions/s3/run?timeout=1", "echo $$; exec sleep 300") as sock:
        line, head = first_line(sock)
        blocked = gateway.call("POST", f"/debug/block?pid={int(line)}&max=60")
        assert blocked["gone"], "the turn outlived its timeout while the loop was blocked"
        _, outcome = run_lines_after(sock, head)
    assert outcome["outcome"] == "abandoned" and outcome["reason"] == "timeout"
    assert int(line) in outcome["killed"]


def run_lines_after(sock: socket.socket, already: bytes) -> tuple[list[str], dict]:
    lines = body_of(already + read_all(sock)).decode().splitlines()
    return lines[:-1], json.loads(lines[-1])


def test_an_outside_cgturn_stop_shows_in_the_outcome(gateway):
    with gateway.open("POST", "/sessions/s4/run", "echo $$; exec sleep 300") as sock:
        line, head = first_line(sock)
        [turn] = gateway.call("GET", "/sessions/s4/turns")
        stop = cgturn_popen(gateway.root, gateway.state_dir, "stop", "session:s4", turn["turn"],
                            "--reason", "operator", "--grace", "0")
        assert stop.wait(60) == 0
        _, outcome = run_lines_after(sock, head)
    assert outcome == {"turn": turn["turn"], "outcome": "abandoned", "reason": "operator", "external": True,
                       "killed_by": stop.pid, "killed": [int(line)], "error": None}


def test_two_hundred_concurrent_turns_with_random_stops_leak_nothing(gateway):
    """200 sessions with one turn each, all at once. Each turn prints a background sleep's pid and its
    shell's. At random, the turn completes (its sleep survives), or it keeps running until its client
    disconnects or /stop is sent. Then every session ends: no process any turn started is left, no
    turn is listed, no cgroup is left under the root."""
    rng = random.Random(0xC67)
    fates = [rng.choice(["complete", "disconnect", "stop"]) for _ in range(200)]
    pids: list[int] = []

    async def one(index: int, fate: str) -> tuple[str, str | None]:
        sid = f"c{index}"
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        cmd = "sleep 300 & echo $!; echo $$" + ("" if fate == "complete" else "; exec sleep 300")
        writer.write(f"POST /sessions/{sid}/run HTTP/1.1\r\nContent-Length: {len(cmd)}\r\n\r\n{cmd}".encode())
        await reader.readuntil(b"\r\n\r\n")
        pids.extend([int(await reader.readline()), int(await reader.readline())])
        if fate == "disconnect":
            writer.close()
            return "disconnected", None
        if fate == "stop":
            r2, w2 = await asyncio.open_connection("127.0.0.1", gateway.port)
            w2.write(f"POST /sessions/{sid}/stop HTTP/1.1\r\nContent-Length: 0\r\n\r\n".encode())
            await r2.read()
            w2.close()
        outcome = json.loads((await reader.read()).decode().splitlines()[-1])
        writer.close()
        return outcome["outcome"], outcome.get("reason")

    async def main():
        return await asyncio.gather(*(one(i, fate) for i, fate in enumerate(fates)))

    results = asyncio.run(asyncio.wait_for(main(), 240))
    expected = {"complete": ("completed", None), "disconnect": ("disconnected", None), "stop": ("abandoned", "stop")}
    assert results == [expected[fate] for fate in fates]
    assert len(pids) == 400
    for index in range(200):
        gateway.call("POST", f"/sessions/c{index}/end")
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=60)
    assert all(gateway.call("GET", f"/sessions/c{index}/turns") == [] for index in range(200))
    leftovers = [d for d in os.listdir(gateway.root) if os.path.isdir(os.path.join(gateway.root, d))]
    assert leftovers == [], f"cgroups left under the root: {leftovers}"

#!/usr/bin/env python3
"""An agent gateway on cgturn, standard library only: one turn per request, abandoned on disconnect,
/stop and inactivity; a completed turn's background servers live until the session ends.

    python3 examples/gateway.py --port 8080 [--root /sys/fs/cgroup/gw] [--state-dir DIR]

HTTP (one request per connection):
    POST /sessions/<sid>/run?timeout=S   body: a shell command. The response streams the command's
                                         output, then one JSON line: the turn's outcome.
    POST /sessions/<sid>/stop            abandon the session's running turn (reason `stop`)
    POST /sessions/<sid>/end             end the session: SIGTERM, 2 s, SIGKILL to all it left running
    GET  /sessions/<sid>/turns           the session's turns (JSON)
    POST /debug/block?pid=P&max=S        blocks the event loop (time.sleep) until pid P is gone, to show
                                         that timeouts fire while the loop is stuck (for the tests)

Everything that waits is awaited: no call here blocks the loop for longer than a spawn.
tests/test_example_gateway.py starts this file and drives it through its scenarios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from urllib.parse import parse_qs, urlsplit

from cgturn import Outcome, Run, Supervisor, TurnManager, aabandon_disconnected

PIPE, STDOUT = asyncio.subprocess.PIPE, asyncio.subprocess.STDOUT


class Gateway:
    def __init__(self, mgr: TurnManager):
        self.mgr = mgr
        self.current: dict[str, Supervisor] = {}  # session → the supervisor of its running turn

    async def run(self, sid: str, command: str, timeout: float, writer: asyncio.StreamWriter,
                  reader: asyncio.StreamReader) -> None:
        turn = await self.mgr.abegin_turn(f"session:{sid}")   # waits (on the loop) under pressure
        run = Run(uuid.uuid4().hex)
        sup = Supervisor(turn, timeout=timeout, deadline=3600, grace=2, run=run)
        self.current[sid] = sup

        async def worker() -> int:
            proc = await turn.create_subprocess_shell(command, stdout=PIPE, stderr=STDOUT)
            # The stream ends when the command exits, even if a server it started holds the pipe.
            async for line in proc.stdout:
                turn.touch()                                  # output is activity
                writer.write(line)
                try:
                    await writer.drain()
                except ConnectionError:
                    pass                                      # watch_client abandons the turn
            return await proc.wait()

        async def watch_client() -> None:                     # EOF: the client went away mid-turn
            await reader.read()
            await aabandon_disconnected(run)                  # a no-op once the turn completed

        watcher = asyncio.create_task(watch_client())
        try:
            outcome = await sup.run(worker)
        finally:
            watcher.cancel()
            if self.current.get(sid) is sup:
                del self.current[sid]
        writer.write((json.dumps(describe(turn.turn_id, outcome)) + "\n").encode())

    async def stop(self, sid: str) -> dict:
        sup = self.current.get(sid)
        if sup is None:
            return {"stopped": False}
        await sup.astop("stop")                               # the grace runs off the loop
        return {"stopped": True}

    async def end(self, sid: str) -> dict:
        result = await self.mgr.aend_task(f"session:{sid}", grace=2)
        return {"killed": result.killed, "refused": result.refused, "duration_ms": result.duration_ms}

    async def turns(self, sid: str) -> list[dict]:
        return [{"turn": t.turn, "state": t.state, "pids": t.pids, "reason": t.reason}
                for t in await self.mgr.aturns(f"session:{sid}")]


def describe(turn_id: str, outcome: Outcome) -> dict:
    if outcome.completed:
        return {"turn": turn_id, "outcome": "completed", "exit": outcome.result}
    abandon = outcome.abandon
    return {"turn": turn_id, "outcome": "abandoned", "reason": outcome.reason, "external": outcome.external,
            "killed_by": outcome.killed_by, "killed": abandon.killed if abandon else [],
            "error": None if outcome.error is None else repr(outcome.error)}


def block_loop(pid: int, most: float) -> dict:
    """Deliberately blocks the event loop: the kind of bug timeouts must survive."""
    started = time.monotonic()
    while time.monotonic() - started < most and not dead(pid):
        time.sleep(0.01)
    return {"gone": dead(pid), "blocked_seconds": time.monotonic() - started}


def dead(pid: int) -> bool:
    """Exited: gone, or a zombie (our child, which the blocked loop cannot reap)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def handle(gateway: Gateway, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        method, target, _ = (await reader.readline()).decode().split(" ", 2)
        headers = {}
        while (line := (await reader.readline()).decode().strip()):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        body = (await reader.readexactly(int(headers.get("content-length", 0)))).decode()
        url = urlsplit(target)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")
        if method == "POST" and parts[:1] == ["sessions"] and len(parts) == 3 and parts[2] == "run":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
            await gateway.run(parts[1], body, float(query.get("timeout", 300)), writer, reader)
        else:
            if parts[:1] == ["sessions"] and len(parts) == 3 and parts[2] in ("stop", "end", "turns"):
                answer = await getattr(gateway, parts[2])(parts[1])
            elif url.path == "/debug/block":
                answer = block_loop(int(query["pid"]), float(query.get("max", 30)))
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\n")
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
            writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the client went away; a run's turn was abandoned by watch_client
    except ValueError:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")
    finally:
        writer.close()


async def serve(args: argparse.Namespace) -> None:
    with TurnManager(root=args.root, state_dir=args.state_dir, recover=True) as mgr:
        gateway = Gateway(mgr)
        server = await asyncio.start_server(lambda r, w: handle(gateway, r, w), "127.0.0.1", args.port)
        print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--root", default=os.environ.get("CGTURN_ROOT"))
    parser.add_argument("--state-dir", default=os.environ.get("CGTURN_STATE_DIR"))
    try:
        asyncio.run(serve(parser.parse_args()))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""asyncio processes for a turn: a Popen started by cgturn, driven by the event loop.

`create_process(start, ...)` gives an `asyncio.subprocess.Process` whose Popen comes from `start`
(Turn.spawn: in the turn before the target runs) instead of from asyncio's own `subprocess.Popen`.
Two things differ from `asyncio.create_subprocess_exec`, both on purpose:

- Exit is seen through a pidfd on the loop's selector (Linux 5.3+; os.pidfd_open), not through a
  child watcher: Python 3.11's default watcher starts a thread per child, which a gateway with
  thousands of turns cannot afford. Without pidfds (older kernels) one waiting thread per child is
  the fallback.
- With `until_exit` (the default), the pipes end when the command exits. A command that starts a
  server in the background leaves the server holding its stdout; asyncio reads to end-of-file, so
  `wait()`, `communicate()` and `async for line in proc.stdout` would last as long as the server.
  Here, once the command has exited, what it wrote is delivered (the bytes in the pipe at that moment),
  the streams see end-of-file and `wait()` returns. The survivors keep their ends: what they write
  later is read and dropped until they close it (by one `cgturn-drain` thread per process, which
  outlives the loop), so they never block on a full pipe nor die of SIGPIPE; their stdin (a pipe) is
  closed, as asyncio closes it after `communicate(input)`.

The transport is asyncio's own `BaseSubprocessTransport` with `_start` and exit handling replaced;
its pipes, protocol and `Process` are asyncio's.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import select
import struct
import subprocess
import termios
import threading
from asyncio import base_subprocess, streams
from typing import Any, Callable

START_OPTIONS_REFUSED = ("universal_newlines", "text", "encoding", "errors")


async def create_process(start: Callable[..., subprocess.Popen], args: Any, *, shell: bool,
                         stdin: Any = None, stdout: Any = None, stderr: Any = None,
                         limit: int = streams._DEFAULT_LIMIT, until_exit: bool = True,
                         **popen_kwargs: Any) -> asyncio.subprocess.Process:
    """Start `args` with `start(args, shell=..., stdin=..., ..., **popen_kwargs)` and return it as an
    asyncio Process. Refuses, as asyncio does, the text-mode options and a nonzero bufsize."""
    for name in START_OPTIONS_REFUSED:
        if popen_kwargs.get(name):
            raise ValueError(f"{name} must be {'None' if name in ('encoding', 'errors') else 'False'}: "
                             "asyncio processes exchange bytes")
        popen_kwargs.pop(name, None)
    if popen_kwargs.pop("bufsize", 0) != 0:
        raise ValueError("bufsize must be 0")
    loop = asyncio.get_running_loop()
    protocol = asyncio.subprocess.SubprocessStreamProtocol(limit=limit, loop=loop)
    waiter = loop.create_future()
    transport = TurnSubprocessTransport(loop, protocol, args, shell, stdin, stdout, stderr, 0,
                                        waiter=waiter, start=start, until_exit=until_exit, **popen_kwargs)
    try:
        await waiter
    except BaseException:
        transport.watch_exit()
        transport.close()
        await transport._wait()
        raise
    # Watched once the pipes are connected: an exit seen earlier would find no pipe to end.
    transport.watch_exit()
    return asyncio.subprocess.Process(transport, protocol, loop)


class TurnSubprocessTransport(base_subprocess.BaseSubprocessTransport):
    """asyncio's subprocess transport around a Popen made by `start`, its exit seen through a pidfd."""

    def _start(self, args, shell, stdin, stdout, stderr, bufsize, *, start, until_exit, **kwargs) -> None:
        self._until_exit = until_exit
        self._proc = start(args, shell=shell, stdin=stdin, stdout=stdout, stderr=stderr, bufsize=bufsize, **kwargs)

    def watch_exit(self) -> None:
        """Start watching for the child's exit (an exit before this call is seen at once)."""
        pid = self._proc.pid
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # no pidfds (Linux < 5.3, or a seccomp filter): a thread waits instead
            threading.Thread(target=self._wait_in_thread, args=(pid,), name=f"cgturn-wait-{pid}",
                             daemon=True).start()
            return

        def exited() -> None:
            returncode = _reap(pid)
            if returncode is None:
                return  # woken before the status was there; the pidfd stays readable
            self._loop.remove_reader(pidfd)
            os.close(pidfd)
            self._exited(returncode)

        self._loop.add_reader(pidfd, exited)

    def _wait_in_thread(self, pid: int) -> None:
        try:
            _, status = os.waitpid(pid, 0)
            returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped behind our back (someone's waitpid(-1)): status unknown
            returncode = 255
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._exited, returncode)

    def _exited(self, returncode: int) -> None:
        if self._returncode is not None or self._loop is None:
            return
        if self._until_exit:
            self._end_pipes_at_exit()
        self._process_exited(returncode)

    def _end_pipes_at_exit(self) -> None:
        """Deliver what the command left in its pipes, then end them for the reader; survivors keep
        theirs (module docstring)."""
        for fd, proto in list(self._pipes.items()):
            if proto is None or proto.disconnected:
                continue
            pipe = proto.pipe
            if fd == 0:  # the command is gone: what is still buffered for it would never be read
                pipe.abort()
                continue
            fileno = pipe.get_extra_info("pipe").fileno()
            data = _read_available(fileno)
            if data:
                self._pipe_data_received(fd, data)
            # Our read end stays open, on a copy, until the survivors close theirs; asyncio's own
            # transport then closes as at end-of-file, and the reader sees the end after the data.
            _drainer.add(os.dup(fileno))
            pipe.close()


def _reap(pid: int) -> int | None:
    """The exit code of our child `pid` if it has exited (reaping it), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return 255
    return os.waitstatus_to_exitcode(status) if done else None


def _read_available(fd: int) -> bytes:
    """The bytes in the pipe right now, without waiting for more (a survivor may keep writing)."""
    chunks: list[bytes] = []
    try:
        (count,) = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, struct.pack("i", 0)))
        while count > 0:
            chunk = os.read(fd, count)
            if not chunk:
                break
            chunks.append(chunk)
            count -= len(chunk)
    except OSError:  # EAGAIN: another reader took it first; anything else: what was read stands
        pass
    return b"".join(chunks)


class _Drainer:
    """One daemon thread per process that reads and drops what survivors write to pipes whose command
    has exited, until they close them. A thread rather than the loop: the survivors outlive the loop
    that started their command (`asyncio.run` per request, a gateway restarting its loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoll: select.epoll | None = None

    def add(self, fd: int) -> None:
        with self._lock:
            if self._epoll is None:
                self._epoll = select.epoll()
                threading.Thread(target=self._run, args=(self._epoll,), name="cgturn-drain", daemon=True).start()
            self._epoll.register(fd, select.EPOLLIN)  # hang-up (every writer gone) is always reported

    @staticmethod
    def _run(epoll: select.epoll) -> None:
        while True:
            for fd, _ in epoll.poll():
                try:
                    if os.read(fd, 65536):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                epoll.unregister(fd)
                os.close(fd)


_drainer = _Drainer()

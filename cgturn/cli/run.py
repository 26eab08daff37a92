"""`cgturn run -- CMD`: run a command as a new turn and pass its exit status through.

Exit status: CMD's own code; 128+N if it died of signal N; 127 not found; 126 not executable; 124 when
`--timeout` abandoned the turn; 130/143/129 when `cgturn run` itself got SIGINT/SIGTERM/SIGHUP before
the turn completed (the turn is then abandoned, even if CMD exited first from the same Ctrl-C); 125
when `cgturn run` itself cannot start CMD: no sentinel could be started (CMD would not be guarded
against our death; CGTURN_SENTINEL=0 runs it without one), a limit cannot be enforced here
(`LimitsUnavailable`), isolation was refused (`IsolationUnavailable`: a namespace the kernel
refuses, a missing util-linux helper), the turn could not be made or joined, `--admit-timeout` ran
out under pressure (`Overloaded`), `--memory` is below one page, or the exec failed for another
reason than 127/126 (e.g. ENOMEM or E2BIG inside a memory limit too small to start CMD). Never 1:
that is CMD's own. When another process abandoned the turn (`cgturn stop`, `cgturn end`, the
sentinel, the guard), one stderr line names its reason and the killer's pid, and the status is CMD's
(128+N when it died of signal N), not 124.

When the kernel enforced a limit on the turn (an OOM kill, a refused fork) one stderr line says so
(`... hit its memory limit ...`, `... hit its pids limit ...`); the status stays CMD's.

`--cpu-time S`: run's sentinel abandons the turn once the CPU use of its cgroup passes S seconds
(reason `cpu-time`, `--grace` as for `--timeout`; exit 124). `--oom-kills-turn`: the sentinel abandons
the whole turn at its first OOM kill (reason `oom`, no grace; the status stays CMD's) — what a v2
group OOM kill does, for v1 layouts that have none. Both need the sentinel (exit 125 without one).
`--report FILE|-` writes one JSON object when the run ends, whatever the end (cgturn.run_report;
`-`: the last line of stdout).
"""
# size: one command's whole life (options, start, supervision, exit status) reads best in one place;
# the report it writes lives in run_reporter.
from __future__ import annotations

import argparse
import errno
import os
import select
import signal
import subprocess
import sys

from .. import reasons
from ..errors import CgturnError, TurnExists
from ..limits import PAGE_SIZE, under_one_page
from . import common, run_reporter
from .run_reporter import limit_messages

DEFAULT_TASK = "cli"
EXIT_TIMEOUT = 124
EXIT_CANNOT_START = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# After another process abandoned the turn and finished its kill, CMD is dead: this bounds the wait
# only for a killer that died midway.
EXTERNAL_KILL_WAIT = 30.0


def register(sub) -> None:
    p = sub.add_parser("run", help="run a command as a new turn")
    # Ids are checked while parsing, so bad input exits 2 before a sentinel or a turn exists.
    p.add_argument("--task", type=common.id_arg("task"), default=DEFAULT_TASK,
                   help=f"task id (default {DEFAULT_TASK!r})")
    p.add_argument("--turn", type=common.id_arg("turn"), help="turn id (default: a fresh one)")
    p.add_argument("--timeout", type=common.positive_seconds, help="abandon the turn after S seconds (exit 124)")
    p.add_argument("--grace", type=common.non_negative_seconds, default=2.0,
                   help="seconds between SIGTERM and SIGKILL when abandoning (default 2)")
    p.add_argument("--reap-on-exit", action="store_true",
                   help="abandon the turn when CMD exits, killing what it left running")
    common.add_limit_options(p)
    p.add_argument("--admit-timeout", type=common.non_negative_seconds,
                   help="wait up to S seconds while the pressure guard reports pressure (then exit 125)")
    p.add_argument("--keep-for", type=common.non_negative_seconds, metavar="S",
                   help="when CMD exits, what it left running may live S more seconds (a lease, enforced by "
                        "run's sentinel, which stays after run exits; without one, by `cgturn reap`)")
    p.add_argument("--key", type=_key, metavar="K",
                   help="one instance per key in the task: exit 125 while a process spawned with K runs")
    p.add_argument("--seal", action="store_true",
                   help="no way out of the turn, for root too: bubblewrap (docs/security.md); the host "
                        "read-only but for the working directory and a private /tmp")
    p.add_argument("--writable", action="append", metavar="PATH",
                   help="with --seal: a path CMD may write (repeatable; given, the working directory is not)")
    p.add_argument("--network", choices=("host", "none"), default="host",
                   help="none: a network namespace of the turn's own, only loopback (default host)")
    p.add_argument("--user", help="run CMD as this user (name or uid), after it joined its turn")
    p.add_argument("--group", help="and with this group (default: the user's primary group)")
    p.add_argument("--extra-groups", type=lambda text: [g for g in text.split(",") if g], metavar="G,...",
                   help="supplementary groups (default: the user's, from the group database)")
    p.add_argument("--cpu-time", type=common.library_arg(_parse_cpu_time, "cpu-time"), metavar="S",
                   help="abandon the turn once its processes used S CPU seconds in all (exit 124)")
    p.add_argument("--oom-kills-turn", action="store_true",
                   help="abandon the whole turn at its first OOM kill (v1 layouts have no group OOM kill)")
    p.add_argument("--report", metavar="FILE|-",
                   help="write how the run ended and what it used as one JSON object to FILE (-: stdout, last)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    p.set_defaults(handler=run)


def run(args) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("run needs a command after --")
    limits = common.limits_from_args(args)  # contradictions exit 2 here, before a sentinel or a turn
    report = run_reporter.Reporter(args.report)  # a report file that cannot be written exits 2 here
    try:
        code = _run(args, cmd, limits, report)
    except BaseException:
        report.close()
        raise
    report.write(code)
    return code


def _run(args, cmd: list[str], limits, report: "run_reporter.Reporter") -> int:
    too_small = _below_one_page(limits)
    if too_small:
        return report.not_started(_cannot_start(cmd, too_small), too_small)
    if (args.user, args.group, args.extra_groups) != (None, None, None):
        from ..identity import resolve_identity
        resolve_identity(args.user, args.group, args.extra_groups)  # an unknown user or group exits 2 here too
    if args.writable is not None:  # a refused path exits 2 here, before anything is made
        if not args.seal:
            raise ValueError("--writable applies to a sealed turn only (--seal)")
        from ..writable import writable_paths
        writable_paths(args.writable, None)
    from .. import Supervisor  # supervision pulls in asyncio: only `run` pays for it

    try:
        manager = common.make_manager(args)
    except CgturnError as err:
        return report.not_started(_cannot_start(cmd, err), err)
    try:
        # Started before the turn exists, so the turn is guarded against our death from its first
        # moment (a SIGKILLed `cgturn run` must not leave CMD running: a sentinel still starting
        # abandons the turns it was told of when it finds us dead). Its `ready` is waited for by
        # the supervisor's start, before CMD starts (meanwhile the turn is made: the two starts run
        # side by side); without a sentinel that promise cannot be kept: refuse to start CMD
        # rather than run it unguarded.
        try:
            sentinel_pid = Supervisor.start_sentinel(manager, wait=False)
            turn = manager.begin_turn(args.task, args.turn, limits=limits, admit_timeout=args.admit_timeout,
                                      seal=args.seal, network=args.network)
        except TurnExists:
            raise  # bad input (exit 2), not a failure to start
        except CgturnError as err:  # SentinelUnavailable, LimitsUnavailable, ...: CMD never started
            return report.not_started(_cannot_start(cmd, err), err)
        return _supervise(turn, cmd, args, limits, report, sentinel_pid=sentinel_pid)
    finally:
        manager.close()


def _parse_cpu_time(text: str) -> float:
    from ..limits import parse_cpu_time
    return parse_cpu_time(text)


def _key(text: str) -> str:
    from .. import ids

    try:
        return ids.validate_text(text, "key", ids.MAX_ID_BYTES)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _below_one_page(limits) -> str | None:
    """Why CMD cannot start when `--memory` is below one page, else None. The kernel rounds a memory
    limit down to whole pages (mm/page_counter.c), so such a turn holds no page at all and every exec
    in it fails; on the clone3 path even the child's report of that failure needs a page of the turn,
    so the spawn would look clean and CMD seem to exit 255. Refused before anything is made."""
    value = under_one_page(limits) if limits is not None else None
    if value is not None:
        return (f"its memory limit ({common.format_size(value)}) is less than one page ({PAGE_SIZE} bytes), "
                "the kernel's unit: nothing can start in it")
    return None


def _exec_failure(err: OSError, limits) -> str:
    """Why the exec of CMD failed, in one line. Inside a memory limit too small for it, execve fails
    with ENOMEM, or with E2BIG when the kernel cannot charge the pages that copy argv and the
    environment (fs/exec.c, copy_strings): both then name the limit."""
    text = err.strerror or str(err)
    value = limits.memory_max if limits is not None else None
    if err.errno in (errno.ENOMEM, errno.E2BIG) and isinstance(value, int):
        return f"{text}: its memory limit ({common.format_size(value)}) is too small to start it"
    if err.errno in (errno.ENOMEM, errno.E2BIG):
        return f"{text} (a memory limit of its task or the managed root may be too small to start it)"
    return text


def _cannot_start(cmd: list[str], err: CgturnError | str) -> int:
    print(f"cgturn: cannot start {cmd[0]}: {err}", file=sys.stderr)
    return EXIT_CANNOT_START


def _supervise(turn, cmd: list[str], args, limits, report: "run_reporter.Reporter",
               sentinel_pid: int | None = None) -> int:
    """Run CMD in the turn under a Supervisor; report limit hits; map its outcome to the exit status.

    `--timeout` is the supervisor's inactivity timeout with no activity source, i.e. wall-clock time
    since start (reason `timeout`); the sentinel holds it too, so a SIGSTOPped `cgturn run` still
    loses its turn on time, and a SIGKILLed one loses it at once (`owner-died`).
    """
    from .. import AlreadyRunning, Supervisor

    timeout, grace, reap_on_exit = args.timeout, args.grace, args.reap_on_exit
    received: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in FORWARDED}
    previous_fd = signal.set_wakeup_fd(wake_w)
    try:
        sup = Supervisor(turn, timeout=timeout, grace=grace, on_interrupt=lambda _reason: _poke(wake_w),
                         cpu_time=args.cpu_time, oom_kills_turn=args.oom_kills_turn)
        # The clocks run from before CMD starts: a `cgturn run` stopped right after the spawn still
        # loses its turn on time (the sentinel holds the deadlines it was given here).
        try:
            sup.start()
        except CgturnError as err:  # the sentinel could not be told a --cpu-time or --oom-kills-turn watch
            turn.abandon(reasons.ERROR, grace=0)
            return report.not_started(_cannot_start(cmd, err), err)
        report.spawning()
        try:
            sealing = {"writable": args.writable} if args.writable is not None else {}
            proc = turn.spawn(cmd, key=args.key, user=args.user, group=args.group, extra_groups=args.extra_groups,
                              **sealing)
        except AlreadyRunning as err:
            return report.not_started(_cannot_start(cmd, err), err, _stop(sup, reasons.ERROR))
        except FileNotFoundError:
            usage = _stop(sup, reasons.NOT_FOUND)
            print(f"cgturn: {cmd[0]}: command not found", file=sys.stderr)
            return report.not_started(EXIT_NOT_FOUND, "command not found", usage)
        except PermissionError:
            usage = _stop(sup, reasons.NOT_EXECUTABLE)
            print(f"cgturn: {cmd[0]}: permission denied", file=sys.stderr)
            return report.not_started(EXIT_NOT_EXECUTABLE, "permission denied", usage)
        except CgturnError as err:  # the process could not be put into the turn or its limits
            return report.not_started(_cannot_start(cmd, err), err, _stop(sup, reasons.ERROR))
        except OSError as err:  # the exec itself failed, e.g. for want of memory inside the turn's limit
            why = _exec_failure(err, limits)
            return report.not_started(_cannot_start(cmd, why), why, _stop(sup, reasons.ERROR))
        outcome = sup.run_blocking(_worker, sup, turn, proc, wake_r, received, reap_on_exit)
        return report.ended(outcome, proc, _status_of(outcome, turn, proc, args, limits, sentinel_pid))
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        os.close(wake_r)
        os.close(wake_w)


def _stop(sup, reason: str):
    """Abandon the turn of a CMD that never started; what the turn used (None when unknown)."""
    result = sup.stop(reason, grace=0, interrupt=False)
    return result.usage


def _status_of(outcome, turn, proc, args, limits, sentinel_pid: int | None) -> int:
    """Report the limits the kernel enforced, set a lease, and map the outcome to run's exit status."""
    from .. import NoSuchTurn

    for line in limit_messages(outcome.usage, limits):  # read before the turn completed or was removed
        print(f"cgturn: {line}", file=sys.stderr)
    if outcome.completed and args.keep_for is not None:
        try:
            turn.set_lease(args.keep_for)
        except NoSuchTurn:
            pass  # nothing was left running: the completed turn is already gone
    if outcome.completed or outcome.reason == reasons.REAP_ON_EXIT:
        code = outcome.result if outcome.completed else proc.returncode
        return code if code >= 0 else 128 - code
    # Our own sentinel holding our --timeout, --cpu-time or --oom-kills-turn is not "someone else".
    # When the killer cannot be told (its note not found in time under load), a reason we asked
    # for is ours.
    ours = outcome.killed_by in (sentinel_pid, None)
    own_timeout = ours and (outcome.reason in (reasons.TIMEOUT, reasons.DEADLINE) and args.timeout is not None
                            or outcome.reason == reasons.CPU_TIME and args.cpu_time is not None)
    own_oom = ours and outcome.reason == reasons.OOM and args.oom_kills_turn
    if outcome.reason == reasons.CPU_TIME and own_timeout:
        print(f"cgturn: the turn used its CPU time ({args.cpu_time:g} s): abandoned", file=sys.stderr)
    if own_oom:
        return _status(proc)  # an OOM kill ended it: CMD's own status (128+9 as a rule)
    if outcome.external and not own_timeout:
        who = f"process {outcome.killed_by}" if outcome.killed_by is not None else "another process"
        # The kill's own reason: when that process's mark came before our own abandon's, it is not ours.
        why = outcome.abandon.reason if outcome.abandon is not None else outcome.reason
        print(f"cgturn: the turn was abandoned by {who}: reason {why!r}", file=sys.stderr)
        return _status(proc)
    if outcome.reason and outcome.reason.startswith(reasons.SIGNAL_PREFIX):
        return 128 + signal.Signals[outcome.reason.removeprefix(reasons.SIGNAL_PREFIX)]
    if outcome.error is not None:
        raise outcome.error
    return EXIT_TIMEOUT


def _status(proc) -> int:
    """CMD's exit status as a shell reports it (128+N for signal N), once it has been killed."""
    try:
        code = proc.wait(timeout=EXTERNAL_KILL_WAIT)
    except subprocess.TimeoutExpired:
        # The killer died before CMD did, and nobody finished its kill yet: CMD is our own child.
        proc.kill()
        code = proc.wait()
    return code if code >= 0 else 128 - code


def _worker(sup, turn, proc, wake_fd: int, received: list[int], reap_on_exit: bool) -> int | None:
    """The supervised worker: wait for CMD; a signal to us, or --reap-on-exit, abandons the turn
    before the worker returns (returning normally completes it)."""
    code = _wait(proc, wake_fd, received)
    if code is None:
        return None  # the watchdog abandoned the turn (timeout): the outcome is already decided
    # Before the turn completes or is abandoned: completing removes an empty turn, and its counters with it.
    _audit_limits(turn)
    # CMD exited. A signal that reached us first (the same Ctrl-C, often) still abandons the turn:
    # block further delivery, let handlers of signals already delivered run, then decide.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    pending = signal.sigpending() & set(FORWARDED)
    if received or pending:
        sig = (received or sorted(pending))[0]
        sup.stop(reasons.for_signal(signal.Signals(sig).name), interrupt=False)
    elif reap_on_exit:
        sup.stop(reasons.REAP_ON_EXIT, interrupt=False)
    return code


def _audit_limits(turn) -> None:
    """Audit the limits the kernel enforced on the turn (`action: limit`, once per counter increase,
    whoever notices first). A turn that completes with survivors keeps its cgroup, so completion
    itself does not audit it: this does. A failure is reported and never changes CMD's status."""
    try:
        turn.check_limits()
    except CgturnError as err:
        print(f"cgturn: warning: cannot check the turn's limits: {err}", file=sys.stderr)


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:
        pass  # the pipe is full: the waiter is awake already


def _wait(proc, wake_fd: int, received: list[int]) -> int | None:
    """Wait for CMD to exit or a forwarded signal; None when the supervisor abandoned the turn first
    (its interrupt wrote to `wake_fd`); -N when signal N reached us first."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(wake_fd, select.POLLIN)
        while True:
            if received:
                proc.poll()
                return proc.returncode if proc.returncode is not None else -received[0]
            code = proc.poll()
            if code is not None:
                return code
            for fd, _ in poller.poll():
                if fd == wake_fd:
                    os.read(wake_fd, 512)
                    if not received:
                        return None
    finally:
        os.close(pidfd)

"""What a run of one command as a turn ended as, in figures: `cgturn run --report`'s object.

`RunReport` puts the turn's outcome (completed, or abandoned for a reason by someone) and what the
turn used (`Usage`, read before its cgroup was removed) into one flat record, as benchexec's
`runexec` reports a termination reason beside wall time, CPU time and peak memory. Pure values: the
caller measures the wall time and knows the exit status; nothing here reads the kernel.

`ended`, first match wins:
- `not-started`: the command never ran (not found, not executable, the turn could not be made);
- the turn was abandoned: `timeout` (reasons `timeout`, `deadline`), `cpu-time`, `oom` (the sentinel
  abandoned it at its first OOM kill), else `abandoned` (stop, end, owner death, a signal to `run`);
- the command ended by itself (also with `--reap-on-exit`): `oom` when the kernel OOM-killed any
  process of the turn, `pids-max` when the pids limit refused a fork, `signal` when the command died
  of a signal, else `exited`. The exit status stays the command's in each of these.
"""
from __future__ import annotations

import dataclasses
import json
import signal as signals
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import reasons

if TYPE_CHECKING:
    from .limits import Usage
    from .outcome import Outcome

EXITED, SIGNAL, TIMEOUT, CPU_TIME, OOM, PIDS_MAX, ABANDONED, NOT_STARTED = (
    "exited", "signal", "timeout", "cpu-time", "oom", "pids-max", "abandoned", "not-started")
ENDINGS = (EXITED, SIGNAL, TIMEOUT, CPU_TIME, OOM, PIDS_MAX, ABANDONED, NOT_STARTED)
_BY_REASON = {reasons.TIMEOUT: TIMEOUT, reasons.DEADLINE: TIMEOUT, reasons.CPU_TIME: CPU_TIME, reasons.OOM: OOM}


@dataclass(frozen=True, slots=True)
class RunReport:
    """How a command run as a turn ended, and what the turn used.

    Attributes:
        exit_status: the status `cgturn run` exits with (the command's, 128+N for signal N, 124 for
            a timeout or CPU-time abandon, 125-127 when it did not start); None when not known.
        ended: one of ENDINGS (see the module docstring).
        reason: the abandon reason when the turn was abandoned (also `reap-on-exit`), else None.
        killed_by: pid of the process that abandoned the turn, when known.
        signal: name of the signal the command died of (`SIGKILL`), else None.
        wall_seconds: from just before the command started until the turn's end was known.
        cpu_seconds: CPU time of every process of the turn (its cgroup's cpu.stat usage).
        memory_peak_bytes: the turn's peak memory (v2 memory.peak, v1 memory.max_usage_in_bytes);
            None without a memory controller on the turn.
        oom_kills: processes of the turn the kernel OOM-killed.
        pids_max_hits: forks the turn's pids limit refused.
        cpu_throttled_seconds: time the turn's CPU quota held it back; None without a cpu controller.
        error: why the command did not start (`not-started` only), else None.
    """

    exit_status: int | None
    ended: str
    reason: str | None = None
    killed_by: int | None = None
    signal: str | None = None
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    memory_peak_bytes: int | None = None
    oom_kills: int = 0
    pids_max_hits: int = 0
    cpu_throttled_seconds: float | None = None
    error: str | None = None

    @classmethod
    def from_outcome(cls, outcome: "Outcome", wall_seconds: float, returncode: int | None = None,
                     exit_status: int | None = None) -> "RunReport":
        """The report of a supervised turn (`Supervisor.run`'s Outcome) whose command returned `returncode`.

        Args:
            outcome: how the turn ended; its `usage` gives the figures (zeros and None when unknown).
            wall_seconds: the run's wall time, measured by the caller.
            returncode: the command's `Popen.returncode` (-N: signal N), when there is one.
            exit_status: the caller's exit status; default: `returncode` as a shell reports it.

        Returns:
            The RunReport.
        """
        died_of = _signal_name(-returncode) if returncode is not None and returncode < 0 else None
        if exit_status is None and returncode is not None:
            exit_status = returncode if returncode >= 0 else 128 - returncode
        usage = outcome.usage
        ended = _ended(outcome, usage, died_of)
        return cls(exit_status=exit_status, ended=ended, reason=outcome.reason, killed_by=outcome.killed_by,
                   signal=died_of, wall_seconds=wall_seconds, **_figures(usage))

    @classmethod
    def not_started(cls, exit_status: int, error: str, wall_seconds: float = 0.0,
                    usage: "Usage | None" = None) -> "RunReport":
        """The report of a command that never ran.

        Args:
            exit_status: the caller's exit status (125, 126, 127 for `cgturn run`).
            error: why, in one line.
            wall_seconds: time spent until the failure was known.
            usage: what the turn used, if one was made (its first process may have run a little).

        Returns:
            The RunReport (`ended` = `not-started`).
        """
        return cls(exit_status=exit_status, ended=NOT_STARTED, wall_seconds=wall_seconds, error=error,
                   **_figures(usage))

    def to_json(self) -> dict[str, Any]:
        """Every field by name (the `--report` object)."""
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        """The report as one line of JSON."""
        return json.dumps(self.to_json(), ensure_ascii=False)


def _ended(outcome: "Outcome", usage: "Usage | None", died_of: str | None) -> str:
    if outcome.abandoned and outcome.reason != reasons.REAP_ON_EXIT:
        return _BY_REASON.get(outcome.reason or "", ABANDONED)
    if usage is not None and usage.oom_kills:
        return OOM
    if usage is not None and usage.pids_max_hits:
        return PIDS_MAX
    return SIGNAL if died_of is not None else EXITED


def _figures(usage: "Usage | None") -> dict[str, Any]:
    if usage is None:
        return {}
    return {"cpu_seconds": usage.cpu_seconds, "memory_peak_bytes": usage.memory_peak_bytes,
            "oom_kills": usage.oom_kills, "pids_max_hits": usage.pids_max_hits,
            "cpu_throttled_seconds": usage.cpu_throttled_seconds}


def _signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"

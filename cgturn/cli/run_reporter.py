"""What `cgturn run` tells at the end: one stderr line per limit the kernel enforced, and with
`--report FILE|-` one JSON object (cgturn.RunReport), its target opened before anything starts and
written when the run ends, whatever the end."""
from __future__ import annotations

import sys
import time
from typing import Any

from . import common


class Reporter:
    """The `--report` of one run: its target opened before anything starts, its figures gathered
    as the run ends, written once whatever the end.

    Args:
        target: a file path, `-` (stdout), or None (no report: every call is cheap and does nothing).

    Raises:
        ValueError: the file cannot be opened for writing (a usage error: exit 2, nothing started).
    """

    def __init__(self, target: str | None) -> None:
        self.target = target
        self.started = time.monotonic()
        self.report: Any = None  # the RunReport, once the end is known
        self._file: Any = None
        if target is not None and target != "-":
            try:
                self._file = open(target, "w", encoding="utf-8")  # noqa: SIM115 - closed in write()/close()
            except OSError as err:
                raise ValueError(f"cannot write the report to {target}: {err.strerror or err}") from None

    def spawning(self) -> None:
        """CMD is about to start: its wall time counts from now."""
        self.started = time.monotonic()

    def not_started(self, code: int, error: object, usage=None) -> int:
        """Note that CMD never ran (exit status `code`, for `error`); returns `code`."""
        if self.target is not None:
            from .. import RunReport
            self.report = RunReport.not_started(code, str(error), time.monotonic() - self.started, usage)
        return code

    def ended(self, outcome, proc, code: int) -> int:
        """Note how the supervised CMD ended (exit status `code`); returns `code`."""
        if self.target is not None:
            from .. import RunReport
            wall = time.monotonic() - self.started
            self.report = RunReport.from_outcome(outcome, wall, returncode=proc.poll(), exit_status=code)
        return code

    def write(self, code: int) -> None:
        """Write the report (a failure is one stderr line: the exit status stays `code`)."""
        if self.target is None:
            return
        if self.report is None:  # an end no branch described
            self.not_started(code, "cgturn run failed")
        line = "" if self.report is None else self.report.dumps() + "\n"
        try:
            if self._file is None:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                self._file.write(line)
        except OSError as err:
            print(f"cgturn: warning: cannot write the report to {self.target}: {err}", file=sys.stderr)
        finally:
            self.close()

    def close(self) -> None:
        """Close the report file without writing (an exception ends the run)."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError as err:
                print(f"cgturn: warning: cannot write the report to {self.target}: {err}", file=sys.stderr)
            self._file = None


def limit_messages(usage, limits) -> list[str]:
    """One line per limit the kernel enforced on the turn (`usage`), naming the turn's own limit from
    `limits` when it set one (else the hit came from its task's or the managed root's budget)."""
    if usage is None:
        return []
    lines = []
    if usage.oom_kills:
        value = limits.memory_max if limits is not None else None
        which = f"its memory limit ({common.format_size(value)})" if isinstance(value, int) else \
            "a memory limit (its task's or the managed root's)"
        lines.append(f"the turn hit {which}: {_count(usage.oom_kills, 'process', 'processes')} OOM-killed")
    if usage.pids_max_hits:
        value = limits.pids_max if limits is not None else None
        which = f"its pids limit ({value})" if isinstance(value, int) else "a pids limit"
        lines.append(f"the turn hit {which}: {_count(usage.pids_max_hits, 'fork', 'forks')} refused")
    return lines


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"

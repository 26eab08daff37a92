"""`cgturn limits [TASK [TURN]] [--memory SIZE ...] [--json]`: show or change the limits of the managed
root (no TASK: all turns together), a task (all its turns together) or one turn, with what it used.

Without a limit option it only reads. With one it changes just the limits given (the others stay as
they are; `max` removes one) and prints the result. A task given limits keeps its cgroup between
turns until `cgturn end`. Exit 1: no such task or turn, or a limit this host cannot enforce; 2: bad input.

What is shown is what holds: a limit not set reads `max` (no limit of its own; its task's or the
root's may apply), `cpu_weight` not set reads `default (100)` (a weight has no maximum), `oom_group`
not set reads `default (on ...)` (cgroup v2 memory kills a turn whole on OOM), and a limit this host's
layout cannot set at all (memory_high or oom_group on a hybrid host's v1 memory, say) reads
`unsupported here` with the reason; JSON adds `unsupported` ({field: why}).
"""
from __future__ import annotations

from . import common

ROOT, TASK, TURN = "root", "task", "turn"
# The order `limits` prints the fields in, with the formatter of each value.
_LIMIT_ROWS = (("memory_max", "size"), ("memory_high", "size"), ("swap_max", "size"), ("pids_max", "plain"),
               ("cpus", "plain"), ("cpu_weight", "plain"), ("oom_group", "plain"))
# What a limit not set means, where it is not "max" (no limit of its own).
_UNSET = {"cpu_weight": "default (100)", "oom_group": "default (on: an OOM kill takes the whole turn)"}
_USAGE_ROWS = (("oom_kills", "plain"), ("pids_max_hits", "plain"), ("memory_peak_bytes", "size"),
               ("cpu_seconds", "seconds"), ("cpu_throttled_seconds", "seconds"))


def register(sub) -> None:
    p = sub.add_parser("limits", help="show or change the limits of the managed root, a task or a turn")
    p.add_argument("task", nargs="?", type=common.id_arg("task"), metavar="TASK",
                   help="the task (default: the managed root, i.e. all turns together)")
    p.add_argument("turn", nargs="?", type=common.id_arg("turn"), metavar="TURN", help="one turn of TASK")
    common.add_limit_options(p)
    common.add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    changes = common.limits_from_args(args)  # contradictions exit 2 here, before anything is touched
    with common.make_manager(args) as manager:
        data = apply(manager, args.task, args.turn, changes)
    if args.json:
        common.print_json(data)
    else:
        print(format_report(data))
    return common.EXIT_OK


def apply(manager, task: str | None, turn: str | None, changes) -> dict:
    """Set `changes` (a Limits, or None to only read) at the level `task`/`turn` name, then return
    the documented JSON object `{level, task, turn, limits, usage}`.

    Raises:
        NoSuchTurn: the task (when only reading) or the turn does not exist.
        LimitsUnavailable: a limit this host or backend cannot enforce (nothing changed).
    """
    if turn is not None:
        target = manager.turn(task, turn)
        if changes is not None:
            target.set_limits(changes)
        level, limits, usage = TURN, target.limits(), target.usage()
    elif task is not None:
        if changes is not None:
            manager.set_task_limits(task, changes)
        level, limits, usage = TASK, manager.task_limits(task), manager.task_usage(task)  # NoSuchTurn: exit 1
    else:
        if changes is not None:
            manager.set_limits(changes)
        level, limits, usage = ROOT, manager.limits(), manager.usage()
    return {"level": level, "task": task, "turn": turn, "limits": limits.to_json(), "usage": usage.to_json(),
            "unsupported": _unsupported(manager.limits_report())}


def _unsupported(report: dict) -> dict[str, str]:
    """{field: why} of the limits this managed root cannot have (all of them without a layout)."""
    if report.get("layout") is None:
        why = "; ".join(report.get("problems") or ()) or "no controllers for limits here"
        return {name: why for name, _ in _LIMIT_ROWS}
    return dict(report.get("unsupported") or {})


def format_report(data: dict) -> str:
    """The human-readable form of `apply`'s result."""
    if data["level"] == TURN:
        title = f"turn {data['turn']!r} of task {data['task']!r}"
    elif data["level"] == TASK:
        title = f"task {data['task']!r} (all its turns together)"
    else:
        title = "the managed root (all turns together)"
    lines = [f"limits of {title}:"]
    limits = dict(data["limits"])
    unset = {name: _UNSET.get(name, "max") for name, _ in _LIMIT_ROWS}
    for name, why in (data.get("unsupported") or {}).items():
        if limits.get(name) is None and name in unset:
            unset[name] = f"{'off, ' if name == 'oom_group' else ''}unsupported here ({why})"
    lines += _rows(limits, _LIMIT_ROWS, unset=unset)
    lines.append("usage:")
    lines += _rows(data["usage"], _USAGE_ROWS, unset={name: "-" for name, _ in _USAGE_ROWS})
    return "\n".join(lines)


def _rows(values: dict, rows, unset: dict[str, str]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    out = []
    for name, kind in rows:
        value = values.get(name)
        if value is None:
            shown = unset[name]
        elif kind == "size":
            shown = common.format_size(value)
        elif kind == "seconds":
            shown = f"{value:.2f}s"
        else:
            shown = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"  {name.ljust(width)}  {shown}")
    return out

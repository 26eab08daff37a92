"""`cgturn end TASK [--grace S] [--reason R] [--json]`: kill everything the task owns, completed turns'
survivors included, and remove its cgroups. Idempotent: a task with no turns left is a success that
kills nothing. A turn that must not be killed (it holds this process) is left and reported (exit 1).
"""
from __future__ import annotations

from .. import reasons
from . import common


def register(sub) -> None:
    p = sub.add_parser("end", help="end a task: kill everything it owns and remove its cgroups")
    p.add_argument("task", type=common.id_arg("task"), metavar="TASK")
    p.add_argument("--grace", type=common.non_negative_seconds, default=2.0,
                   help="seconds between SIGTERM and SIGKILL (default 2; 0 sends no SIGTERM)")
    p.add_argument("--reason", default=reasons.END_TASK, type=common.reason_arg,
                   help=f"reason recorded in the audit log (default {reasons.END_TASK!r})")
    common.add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    manager = common.make_manager(args)
    try:
        result = manager.end_task(args.task, args.reason, grace=args.grace)
        left = manager.turns(args.task)
    finally:
        manager.close()
    data = {"task": args.task, "reason": result.reason, "killed": result.killed, "signals": result.signals,
            "duration_ms": round(result.duration_ms, 3), "refused": result.refused,
            "turns_left": [info.turn for info in left]}
    if args.json:
        common.print_json(data)
    else:
        print(f"ended task {args.task!r}: killed {len(result.killed)} process(es) "
              f"{' '.join(map(str, result.killed))}".rstrip())
        for refused in result.refused:
            print(f"refused turn {refused['turn']!r}: {refused['error']}")
        if left:
            # Quoted as stop quotes them: an id's escape sequence or newline never reaches the terminal.
            print(f"still present: {', '.join(map(repr, data['turns_left']))}")
    return common.EXIT_FAILED if left else common.EXIT_OK

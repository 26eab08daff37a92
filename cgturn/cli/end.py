"""`cgturn end TASK [--json]`: kill everything the task owns, completed turns' survivors included,
and remove its cgroups. Idempotent: a task with no turns left is a success that kills nothing.
"""
from __future__ import annotations

from . import common


def register(sub) -> None:
    p = sub.add_parser("end", help="end a task: kill everything it owns and remove its cgroups")
    p.add_argument("task", type=common.id_arg("task"), metavar="TASK")
    common.add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    manager = common.make_manager(args)
    try:
        result = manager.end_task(args.task)
        left = manager.turns(args.task)
    finally:
        manager.close()
    data = {"task": args.task, "killed": result.killed, "signals": result.signals,
            "turns_left": [info.turn for info in left]}
    if args.json:
        common.print_json(data)
    else:
        print(f"ended task {args.task!r}: killed {len(result.killed)} process(es) "
              f"{' '.join(map(str, result.killed))}".rstrip())
        if left:
            print(f"still present: {', '.join(data['turns_left'])}")
    return common.EXIT_FAILED if left else common.EXIT_OK

"""`cgturn pause TASK TURN`, `cgturn resume TASK TURN`: the operator's words for the library's
`Turn.freeze()` and `Turn.thaw()` — freeze a turn's processes where they are, and thaw them
(cgroup.freeze; SIGSTOP/SIGCONT on the registry, see docs/registry.md).

Exit 1 when there is no such running or completed turn, or when the freeze is refused (the turn holds
this process); the message says why. A paused (frozen) turn's inactivity and deadline clocks stop; a
lease does not. An abandon of a paused turn still kills it.
"""
from __future__ import annotations

from . import common


def register(sub) -> None:
    for name, what in (("pause", "freeze a turn: its processes stop where they are"),
                       ("resume", "thaw a paused turn: its processes run again")):
        p = sub.add_parser(name, help=what)
        p.add_argument("task", type=common.id_arg("task"), metavar="TASK")
        p.add_argument("turn", type=common.id_arg("turn"), metavar="TURN")
        common.add_json_option(p)
        p.set_defaults(handler=run, freeze=name == "pause")


def run(args) -> int:
    with common.make_manager(args) as manager:
        turn = manager.turn(args.task, args.turn)   # NoSuchTurn -> exit 1
        pids = turn.freeze() if args.freeze else turn.thaw()   # UnsafeOperation -> exit 1
    verb = "paused" if args.freeze else "resumed"
    if args.json:
        common.print_json({"task": args.task, "turn": args.turn, "frozen": args.freeze, "pids": pids})
    else:
        print(f"{verb} turn {args.turn!r} of task {args.task!r}: {len(pids)} process(es) "
              f"{' '.join(map(str, pids))}".rstrip())
    return common.EXIT_OK

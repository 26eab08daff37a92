"""`cgturn stop TASK TURN [--reason R] [--grace S] [--force] [--json]`: abandon one turn by hand.

Exit 1 when there is no such turn. An abandon whose turn could not be marked first (its lock held,
or a full or read-only state directory) still kills and exits 0; what its record lacks is printed
on stderr (`unrecorded` in the JSON). A completed turn's survivors are left alone (skipped, exit 0)
unless `--force`. Refused (exit 1) when the turn contains this process.
"""
from __future__ import annotations

import sys

from .. import reasons
from . import common

DEFAULT_REASON = reasons.STOP
DEFAULT_GRACE = 2.0


def register(sub) -> None:
    p = sub.add_parser("stop", help="abandon one turn: SIGTERM, grace, SIGKILL; print what was killed")
    p.add_argument("task", type=common.id_arg("task"), metavar="TASK")
    p.add_argument("turn", type=common.id_arg("turn"), metavar="TURN")
    p.add_argument("--reason", default=DEFAULT_REASON, type=common.reason_arg,
                   help=f"reason recorded in the audit log (default {DEFAULT_REASON!r})")
    p.add_argument("--grace", type=common.non_negative_seconds, default=DEFAULT_GRACE,
                   help=f"seconds between SIGTERM and SIGKILL (default {DEFAULT_GRACE:g}; 0 = SIGKILL at once)")
    p.add_argument("--force", action="store_true", help="also kill a completed turn's survivors")
    common.add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    manager = common.make_manager(args)
    try:
        turn = manager.turn(args.task, args.turn)   # NoSuchTurn -> exit 1
        before = turn.state
        result = turn.abandon(args.reason, grace=args.grace, force=args.force)
    finally:
        manager.close()
    data = {"task": args.task, "turn": args.turn, "state_before": before, "skipped": result.skipped,
            "reason": result.reason, "killed": result.killed, "signals": result.signals,
            "duration_ms": round(result.duration_ms, 3), "unrecorded": result.unrecorded}
    if result.unrecorded is not None and not args.json:
        # The kill happened; what its record lacks goes to stderr, as the warnings before it did.
        print(f"cannot record the abandon: {result.unrecorded}", file=sys.stderr)
    if args.json:
        common.print_json(data)
    elif result.skipped:
        hint = " (its survivors are left alone; --force kills them)" if before == "completed" else ""
        print(f"turn {args.turn!r} of task {args.task!r} is {before}: nothing killed{hint}")
    else:
        print(f"abandoned turn {args.turn!r} of task {args.task!r} ({result.reason}): "
              f"killed {len(result.killed)} process(es) {' '.join(map(str, result.killed))}".rstrip())
    return common.EXIT_OK

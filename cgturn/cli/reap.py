"""`cgturn reap [--json]`: crash recovery, safe beside a live gateway and from ExecStartPre=/a timer.

Abandons running turns whose owner (pid + start time) is gone, finishes kills whose killer died,
kills turns without a trustworthy record, removes completed turns with nothing left, thaws turns the
pressure guard froze when no guard is alive to thaw them (`thawed`). Turns whose
owner lives, or cannot be looked at (`owner-unknown`), are never touched.
Exit 0; 1 when a turn could not be handled (listed as an `error` action).
"""
from __future__ import annotations

from . import common


def register(sub) -> None:
    p = sub.add_parser("reap", help="recover after a crash: abandon turns whose owner died, remove empty ones")
    common.add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    manager = common.make_manager(args)
    try:
        actions = [action.to_json() for action in manager.recover()]
    finally:
        manager.close()
    if args.json:
        common.print_json(actions)
    else:
        for act in actions:
            print(_describe(act))
        if not actions:
            print("nothing to reap")
    return common.EXIT_FAILED if any(a["action"] == "error" for a in actions) else common.EXIT_OK


def _describe(act: dict) -> str:
    if act["action"] == "removed-v1-dirs":
        return f"removed-v1-dirs: {act['path']} (its turn was gone)"
    if act["action"] == "thawed":
        return f"thawed turn {act['turn']!r} of task {act['task']!r}: frozen by a pressure guard that is gone"
    if act["action"] == "killed-stray":
        return f"killed-stray: process {act['killed'][0]} had left its turn (task {act['task']!r})"
    where = f"turn {act['turn']!r} of task {act['task']!r}"
    if act["action"] in ("error", "owner-unknown"):
        return f"{act['action']}: {where}: {act['error']}"
    killed = act.get("killed")
    tail = f": killed {len(killed)} process(es) {' '.join(map(str, killed))}".rstrip() if killed is not None else ""
    return f"{act['action']} {where}{tail}"

"""`cgturn reap [--json]`: crash recovery, safe beside a live gateway and from ExecStartPre=/a timer.

Abandons running turns whose owner (pid + start time) is gone, finishes kills whose killer died,
kills turns without a trustworthy record, removes completed turns with nothing left, thaws turns the
pressure guard froze when no guard is alive to thaw them (`thawed`). Turns whose
owner lives, or cannot be looked at (`owner-unknown`), are never touched.
`--remove-root`: then remove the managed root itself (with its v1 directories, and the budgets of
tasks without turns and of the root) when nothing is left in it and no pressure guard is armed on it
(`removed-root`); otherwise say what is left, exit 1. Nothing else removes a managed root: a gateway's
root keeps its budget and its guard's state between turns.
Exit 0; 1 when a turn could not be handled (listed as an `error` action), or the root could not be
removed.
"""
from __future__ import annotations

from . import common


def register(sub) -> None:
    p = sub.add_parser("reap", help="recover after a crash: abandon turns whose owner died, remove empty ones")
    p.add_argument("--remove-root", action="store_true",
                   help="then remove the managed root itself if no turn, task or process is left in it")
    common.add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    manager = common.make_manager(args)
    try:
        actions = [action.to_json() for action in manager.recover()]
        if args.remove_root:
            actions.append(_remove_root(args, manager))
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


def _remove_root(args, manager) -> dict:
    """Remove the managed root if nothing is left in it: `removed-root`, or an `error` saying why not."""
    from .. import doctor_report

    where = manager.root or manager.state_dir
    guard = doctor_report(args.root, args.backend, args.state_dir).get("guard")
    if guard is not None and guard.get("active"):
        why = f"a pressure guard (process {guard.get('owner_pid')}) is armed on it: stop it first"
    elif left := manager.turns():
        why = f"it still holds {len(left)} turn(s)"
    elif manager.remove_root():
        return {"action": "removed-root", "task": "", "turn": "", "path": where}
    else:
        why = "it still holds a task directory or a process"
    return {"action": "error", "task": "", "turn": "", "path": where, "error": f"managed root not removed: {why}"}


def _describe(act: dict) -> str:
    if act["action"] == "removed-root":
        return f"removed-root: {act['path']}"
    if act["action"] == "error" and not act["turn"] and "path" in act:
        return f"error: {act['path']}: {act['error']}"
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

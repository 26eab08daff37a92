"""`cgturn guard`: run the pressure guard of the managed root in the foreground (a unit of its own).

Exit status: 0 after SIGTERM/SIGINT (guard-frozen turns are thawed first); 2 for bad input (the
kernel's rule in the message); 1 when the trigger cannot be armed or another guard owns the root.
"""
from __future__ import annotations

import signal

from . import common


def register(sub) -> None:
    p = sub.add_parser("guard", help="run the pressure guard in the foreground")
    p.add_argument("--resource", default="memory", help="memory, cpu or io (default memory)")
    p.add_argument("--trigger", default="some 150000 1000000",
                   help="PSI trigger 'some|full STALL_US WINDOW_US' (default 'some 150000 1000000')")
    p.add_argument("--watch", default="owner",
                   help="owner (this process's cgroup), root (the managed root), host, or a cgroup directory")
    p.add_argument("--action", default="freeze", help="freeze or abandon the heaviest running turn")
    p.add_argument("--thaw-after", type=common.non_negative_seconds, default=5.0,
                   help="thaw once pressure stayed below the threshold this long (default 5)")
    p.add_argument("--abandon-after", type=common.non_negative_seconds, default=60.0,
                   help="abandon a turn frozen by the guard longer than this (default 60)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from .. import PressureGuard

    guard = PressureGuard(resource=args.resource, trigger=args.trigger, watch=args.watch, action=args.action,
                          thaw_after=args.thaw_after, abandon_after=args.abandon_after)
    guard.check()  # ValueError (exit 2) before anything is touched
    manager = common.make_manager(args)
    try:
        runner = guard.runner(manager)
        runner.arm()
        previous = {sig: signal.signal(sig, lambda *_: runner.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            print(f"cgturn: pressure guard armed on {runner.path}: {args.resource} '{guard.trigger}', "
                  f"action {guard.action}", flush=True)
            runner.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return common.EXIT_OK
    finally:
        manager.close()

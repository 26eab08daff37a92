"""`cgturn watch [--once] [--interval S]`: the `ps` table, redrawn in the terminal until Ctrl-C.

Read-only, like `ps`. `--once` prints one frame (no screen control) and exits.
"""
from __future__ import annotations

import argparse
import sys
import time

from . import common, ps

CLEAR = "\x1b[H\x1b[2J"
DEFAULT_INTERVAL = 2.0


def register(sub) -> None:
    p = sub.add_parser("watch", help="live view of ps (Ctrl-C to leave)")
    p.add_argument("--task", type=common.id_arg("task"), help="only the turns of this task")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=_interval, default=DEFAULT_INTERVAL,
                   help=f"seconds between frames (default {DEFAULT_INTERVAL:g})")
    p.set_defaults(handler=run)


def _interval(text: str) -> float:
    value = common.non_negative_seconds(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"interval must be >= 0.1 s: {text!r}")
    return value


def frame(args, manager) -> str:
    rows = ps.snapshot(args, manager)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    states: dict[str, int] = {}
    for row in rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "no turns"
    body = ps.format_table(rows) if rows else ""
    return f"cgturn watch  {stamp}  {summary}\n{body}".rstrip() + "\n"


def run(args) -> int:
    with common.make_manager(args) as manager:  # one for every frame: records are parsed once
        if args.once:
            sys.stdout.write(frame(args, manager))
            return common.EXIT_OK
        clear = CLEAR if sys.stdout.isatty() else ""
        try:
            while True:
                sys.stdout.write(clear + frame(args, manager))
                sys.stdout.flush()
                time.sleep(args.interval)  # a refresh period, not a wait for an event
        except KeyboardInterrupt:
            return common.EXIT_OK  # Ctrl-C is the normal way out of a live view

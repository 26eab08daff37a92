"""`cgturn ps [--task T] [--json]`: one row per turn — state, processes, age, cpu, memory (and its limit),
ports, owner, and the limits the kernel enforced on it.

Read-only: it never recovers, kills or moves anything.
"""
from __future__ import annotations

import gc
import json
import sys

from . import common


def register(sub) -> None:
    p = sub.add_parser("ps", help="list turns with their processes, usage and listening ports")
    p.add_argument("--task", type=common.id_arg("task"), help="only the turns of this task")
    common.add_json_option(p)
    p.set_defaults(handler=run)


def snapshot(args, manager=None) -> list[dict]:
    """The turns as the documented JSON objects (`TurnInfo.to_json`).

    `watch` passes the manager it keeps across frames (which then re-reads only changed records);
    without one, a manager is made for this call and closed.
    """
    if manager is None:
        with common.make_manager(args) as own:
            return snapshot(args, own)
    # detail: usage, pressure, frozen, the ps --json fields
    return [info.to_json() for info in manager.turns(args.task, detail=True)]


# A turn's pressure shows in EVENTS once some of its tasks stalled at least this share of the last 10 s.
PSI_SHOWN = 1.0


def format_table(rows: list[dict]) -> str:
    """The human-readable table of `rows` (what `ps` and `watch` print): ids with characters that are
    not printable show escaped (`common.shown_id`). MEM is used/limit when the turn has a memory
    limit; an EVENTS column (OOM kills, refused forks, frozen, pressure stalls of PSI_SHOWN % or more)
    appears when any turn has one."""
    header: tuple[str, ...] = ("TASK", "TURN", "STATE", "PIDS", "AGE", "CPU", "MEM", "PORTS", "OWNER")
    events = [_events(row) for row in rows]
    if any(events):
        header += ("EVENTS",)
    lines: list[tuple[str, ...]] = [header]
    for row, note in zip(rows, events):
        line = (common.shown_id(row["task"]), common.shown_id(row["turn"]), row["state"], _pids(row["pids"]),
                _age(row["age_seconds"]),
                f"{row['cpu_seconds']:.2f}s", _memory(row), _ports(row["ports"]), str(row["owner_pid"] or "-"))
        lines.append(line + (note or "-",) if len(header) > len(line) else line)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _memory(row: dict) -> str:
    limit = (row["limits"] or {}).get("memory_max")
    used = _bytes(row["memory_bytes"])
    return f"{used}/{_bytes(limit)}" if limit is not None else used


def _events(row: dict) -> str:
    """What the kernel enforced on the turn, and whether it is frozen: `oom:1,pids-max:3,frozen`."""
    out = []
    if row["oom_kills"]:
        out.append(f"oom:{row['oom_kills']}")
    if row["pids_max_hits"]:
        out.append(f"pids-max:{row['pids_max_hits']}")
    if row["frozen"]:
        out.append("frozen")
    stalled = [f"{name}={figures['some_avg10']:.1f}%" for name, figures in (row.get("pressure") or {}).items()
               if figures and (figures.get("some_avg10") or 0) >= PSI_SHOWN]
    if stalled:
        out.append("psi:" + "/".join(stalled))
    return ",".join(out)


def _pids(pids: list[int]) -> str:
    shown = ",".join(map(str, pids[:5]))
    return (shown + f",+{len(pids) - 5}") if len(pids) > 5 else (shown or "-")


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "K", "M", "G"):
        if value < 1024 or unit == "G":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return "-"  # pragma: no cover - the loop always returns


def _ports(ports: list[dict]) -> str:
    return ",".join(f"{p['proto']}/{_host(p['address'])}:{p['port']}" for p in ports) or "-"


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def json_lines(rows: list[dict]) -> str:
    """`rows` as one JSON array, one turn per line, ending in a newline. Not json.dump(indent=2):
    an indent makes the json module use its pure-Python encoder and write every token on its own
    (190,000 writes for 1,000 turns, most of `ps --json`'s time); each row here goes through the C
    encoder (one encoder for all rows: json.dumps with a keyword makes one per call), and the whole
    array is one write."""
    if not rows:
        return "[]\n"
    return "".join(("[\n", ",\n".join(map(_ENCODER.encode, rows)), "\n]\n"))


_ENCODER = json.JSONEncoder(ensure_ascii=False)


def run(args) -> int:
    # A listing allocates a few dicts per turn and frees none of them before it prints: over 10,000
    # turns the cyclic collector ran hundreds of times over objects that were all still live (5-12 %
    # of the listing's time). Nothing `ps` makes needs collecting; it is switched back on once printed.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with common.make_manager(args) as manager:
            rows = snapshot(args, manager)
            for where, pid in manager.strays():
                print(f"cgturn: warning: process {pid} ({where}) is in no turn: it left its turn; "
                      "`cgturn reap` kills it", file=sys.stderr)
        if args.json:
            sys.stdout.write(json_lines(rows))
        elif rows:
            print(format_table(rows))
        else:
            print("no turns")
    finally:
        if collecting:
            gc.enable()
    return common.EXIT_OK

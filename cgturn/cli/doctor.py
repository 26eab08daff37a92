"""`cgturn doctor`: what the host offers, which backend cgturn would use, how it will spawn (the clone3
extension, posix_spawn or the shim), and which resource limits it can set here (and through which cgroup
layout), with reasons."""
from __future__ import annotations

from . import common


def register(sub) -> None:
    p = sub.add_parser("doctor", help="show what was found and which backend is used")
    common.add_json_option(p)
    p.set_defaults(handler=run)


def report(args) -> dict:
    """The doctor report as a dict (the documented JSON shape)."""
    from .. import doctor_report  # the library loads only for the command that runs

    return doctor_report(args.root, args.backend, args.state_dir)


def run(args) -> int:
    data = report(args)
    if args.json:
        common.print_json(data)
    else:
        print(f"backend:        {data['backend']}")
        print(f"cgroup2 mount:  {data['cgroup2_mount'] or '-'}")
        print(f"own cgroup:     {data['own_cgroup'] or '-'}")
        print(f"managed root:   {data['managed_root'] or '-'}")
        print(f"writable:       {'yes' if data['writable'] else 'no'}")
        print(f"delegated:      {_delegation_line(data)}")
        if data["systemd_scope"] is not None:
            print(f"systemd scope:  {_scope_line(data['systemd_scope'])}")
        kill = {True: "yes", False: "no (freeze + kill fallback)", None: "unknown until the first kill"}
        print(f"cgroup.kill:    {kill[data['cgroup_kill']]}")
        print(f"controllers:    {' '.join(data['controllers']) or '-'}")
        print(f"spawn paths:    {' '.join(data['spawn_paths'])}")  # preferred first
        guard = data["guard"]
        print(f"pressure guard: {_guard_line(guard)}")
        if data.get("container_init"):
            print(f"cgturn init:    would enable {' '.join(data['container_init']['would_enable'])}")
        for problem in data["problems"]:
            print(f"problem:        {problem}")
        print(format_limits(data["limits"]))
    return common.EXIT_OK if data["usable"] else common.EXIT_FAILED


def format_limits(section: dict) -> str:
    """The `limits` section in words: through which layout limits are set, which ones, and why any
    are missing."""
    layouts = {"v2": "cgroup v2 controllers", "v1-hybrid": "the v1 hierarchies of a hybrid host"}
    if section["layout"] is None:
        lines = ["limits:         unavailable"]
    else:
        available = " ".join(section["available"]) or "none"
        layout = section["layout"]
        lines = [f"limits:         {available} (layout {layout}: {layouts.get(layout, layout)})"]
    lines += [f"limits problem: {problem}" for problem in section["problems"]]
    return "\n".join(lines)


def _delegation_line(data: dict) -> str:
    """Whether systemd delegated the cgroup the managed root is in (its user.delegate/trusted.delegate mark)."""
    if data["systemd_scope"] is not None:
        return f"yes ({data['systemd_scope']['unit']}, Delegate=yes)"
    return {True: "yes (systemd Delegate=yes)", None: "- (no systemd unit above the managed root)",
            False: "no: a systemd unit's own cgroup (turns still work there; limits need Delegate=yes)"}[
        data["delegated"]]


def _scope_line(scope: dict) -> str:
    """Where cgturn's transient scope is, and whether the caller moves into it."""
    state = "exists" if scope["exists"] else "made by the first turn"
    move = ("this process is in it" if scope["caller_inside"]
            else f"a process that begins a turn moves into {scope['owners']}")
    return f"{scope['unit']} of the systemd {scope['manager']} manager at {scope['cgroup']} ({state}; {move})"


def _guard_line(guard: dict | None) -> str:
    if guard is None:
        return "none"
    if not guard["active"]:
        return f"not running (process {guard['owner_pid']})"
    state = "OVER threshold" if guard.get("over") else "quiet"
    return (f"process {guard['owner_pid']}, {guard.get('resource')} '{guard.get('trigger')}' on {guard.get('file')}, "
            f"{state}, {len(guard.get('frozen') or [])} turn(s) frozen")

"""`cgturn doctor`: what the host offers and which backend cgturn would use, with reasons."""
from __future__ import annotations

import os

from ..kernel import discovery
from . import common


def register(sub) -> None:
    p = sub.add_parser("doctor", help="show what was found and which backend is used")
    common.add_json_option(p)
    p.set_defaults(handler=run)


def report(args) -> dict:
    """The doctor report as a dict (the documented JSON shape)."""
    info = discovery.discover(args.root)
    wanted = args.backend or os.environ.get("CGTURN_BACKEND") or "auto"
    backend = "cgroup2" if info.usable and wanted != "registry" else "registry"
    problems = list(info.problems)
    if wanted == "cgroup2" and not info.usable:
        problems.append("--backend cgroup2 was asked for but cgroup v2 is not usable")
    return {
        "backend": backend,
        "cgroup2_mount": info.cgroup2_mount,
        "managed_root": info.managed_root,
        "own_cgroup": info.own_cgroup,
        "cgroup_kill": info.cgroup_kill,
        "controllers": info.controllers,
        "writable": info.writable,
        "problems": problems,
        "usable": info.usable or wanted != "cgroup2",
    }


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
        print(f"cgroup.kill:    {'yes' if data['cgroup_kill'] else 'no (freeze + kill fallback)'}")
        print(f"controllers:    {' '.join(data['controllers']) or '-'}")
        for problem in data["problems"]:
            print(f"problem:        {problem}")
    return common.EXIT_OK if data["usable"] else common.EXIT_FAILED

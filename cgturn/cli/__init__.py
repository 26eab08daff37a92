"""The `cgturn` command line: thin faces over the library. Each subcommand lives in its own module with
`register(subparsers)` (declare arguments) and `run(args) -> int` (call the library, print, return a
code). Exceptions become exit codes in one table (`common.EXIT_CODES`).
"""
from __future__ import annotations

import sys

from .. import __version__
from . import common, doctor, end, guard, init, limits, metrics, pause, ps, reap, run, stop, watch

COMMANDS = [doctor, run, ps, limits, stop, pause, end, reap, watch, metrics, guard, init]


def build_parser() -> common.Parser:
    parser = common.Parser(prog="cgturn", description="cgroup-v2 backed process manager for turns.")
    parser.add_argument("--version", action="version", version=f"cgturn {__version__}")
    common.add_global_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=common.Parser)
    sub.required = True
    for module in COMMANDS:
        module.register(sub)
    for command in sub.choices.values():
        common.add_global_options(command, after_command=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and `python -m cgturn`. Returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except common.UsageError as err:
        print(f"cgturn: {err}", file=sys.stderr)
        return common.EXIT_USAGE
    return common.invoke(args)

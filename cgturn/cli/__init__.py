"""The `cgturn` command line: thin faces over the library. Each subcommand lives in its own module with
`register(subparsers)` (declare arguments) and `run(args) -> int` (call the library, print, return a
code). Exceptions become exit codes in one table (`common.EXIT_CODES`).
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import NoReturn

from .. import __version__
from . import common

# The subcommand modules (cgturn/cli/<name>.py), in the order `--help` lists them; imported only when
# their parser is built, so a start imports the one module of its command.
COMMANDS = ["doctor", "run", "ps", "limits", "stop", "pause", "end", "reap", "watch", "metrics", "guard", "init"]
# command name -> the module that registers it (tests/test_fast_paths.py checks it against the full parser)
COMMAND_MODULES = {**{name: name for name in COMMANDS}, "resume": "pause"}
# The global options that take a value, as they may stand before the command.
_VALUED_GLOBALS = ("--root", "--backend", "--state-dir")


def build_parser(only: str | None = None) -> common.Parser:
    """The command line's parser; with `only`, just that command's subparser beside the global
    options: building every subcommand's arguments is most of the parser's cost at a start."""
    parser = common.Parser(prog="cgturn", description="cgroup-v2 backed process manager for turns.")
    parser.add_argument("--version", action="version", version=f"cgturn {__version__}")
    common.add_global_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=common.Parser)
    sub.required = True
    for name in COMMANDS if only is None else [COMMAND_MODULES[only]]:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    for command in sub.choices.values():
        common.add_global_options(command, after_command=True)
    return parser


def command_named(argv: list[str]) -> str | None:
    """The command `argv` runs, when nothing before it but global options can change how it parses
    (so a parser of that command alone parses it the same); None otherwise (the full parser then
    parses and reports, as for `--help`, a typo or an abbreviated option)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in COMMAND_MODULES:
            return token
        if token in _VALUED_GLOBALS:
            i += 2
        elif token.split("=", 1)[0] in _VALUED_GLOBALS and "=" in token:
            i += 1
        else:
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and `python -m cgturn`. Returns the exit status."""
    parser = build_parser(command_named(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except common.UsageError as err:
        print(f"cgturn: {err}", file=sys.stderr)
        return common.EXIT_USAGE
    return common.invoke(args)


def console() -> NoReturn:
    """Entry point of the console script and `python -m cgturn`: main(), then exit without tearing
    the interpreter down.

    A normal exit finalizes every module and collects every object it loaded (~10 ms for what
    `cgturn run` imports, a sixth of its start-up) when the kernel frees them all at once anyway.
    What an exit must still do is done first, in the interpreter's order: the atexit functions run
    (logging's flushes its handlers), then stdout and stderr are flushed. A thread that is not a
    daemon would be waited for at a normal exit, so then, or when a flush fails (the interpreter
    reports that and exits 120), the exit is the normal one: SystemExit. Never returns.
    """
    code = main()
    threading = sys.modules.get("threading")
    if threading is not None and any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    import atexit
    atexit._run_exitfuncs()  # they run once: a normal exit after this finds none left
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        sys.exit(code)
    os._exit(code)

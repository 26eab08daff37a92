"""What every subcommand shares: global options, the manager factory, JSON output, exit codes."""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import CgroupUnavailable, CgturnError, NoSuchTurn, PermissionDenied, TurnExists, UnsafeOperation

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# The one table mapping library exceptions to exit codes (most specific first).
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (ValueError, EXIT_USAGE),
    (TurnExists, EXIT_USAGE),
    (NoSuchTurn, EXIT_FAILED),
    (CgroupUnavailable, EXIT_FAILED),
    (PermissionDenied, EXIT_FAILED),
    (UnsafeOperation, EXIT_FAILED),
    (CgturnError, EXIT_FAILED),
]


class UsageError(Exception):
    """Bad command-line usage; reported in one line, exit 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but errors raise UsageError (one line, no usage dump) instead of exiting."""

    def error(self, message: str):  # noqa: D102 - argparse API
        raise UsageError(message)


def add_global_options(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """--root, --backend, --state-dir. `after_command`: the copy each subcommand accepts too
    (`cgturn ps --root R`), which leaves the value given before the command alone when absent."""
    default = argparse.SUPPRESS if after_command else None
    parser.add_argument("--root", default=default, help="managed root on the cgroup2 mount (env CGTURN_ROOT)")
    parser.add_argument("--backend", choices=["auto", "cgroup2", "registry"], default=default,
                        help="which backend to use (env CGTURN_BACKEND; default auto)")
    parser.add_argument("--state-dir", default=default,
                        help="registry, metadata fallback and audit log (env CGTURN_STATE_DIR)")


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def id_arg(what: str):
    """An argparse `type` for a task or turn id: blank, NUL or non-UTF-8 ids are usage errors (exit 2)."""
    from .. import ids

    def parse(text: str) -> str:
        try:
            return ids.validate(text, what)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    parse.__name__ = f"{what} id"
    return parse


def non_negative_seconds(text: str) -> float:
    """An argparse `type` for a duration in seconds: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse `type` for a timeout in seconds: a finite number > 0."""
    value = non_negative_seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def make_manager(args, recover: bool = False):
    from .. import TurnManager
    return TurnManager(root=args.root, backend=args.backend, state_dir=args.state_dir, recover=recover)


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")


def invoke(args) -> int:
    """Run the chosen subcommand, mapping exceptions to exit codes with a one-line message."""
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except tuple(cls for cls, _ in EXIT_CODES) as err:
        for cls, code in EXIT_CODES:
            if isinstance(err, cls):
                print(f"cgturn: {err}", file=sys.stderr)
                return code
        raise  # pragma: no cover - the tuple above and the table are the same classes

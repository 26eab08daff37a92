"""What every subcommand shares: global options, the manager factory, JSON output, exit codes."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .. import reasons
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

    def _get_formatter(self):
        # argparse makes a formatter at every add_argument (its metavar check) and each one asks
        # shutil.get_terminal_size for the width: an import of shutil (bz2, lzma) at every start.
        # The same width, read without it.
        # (typeshed's formatter protocol names `prog` only; every argparse.HelpFormatter takes `width`)
        return self.formatter_class(prog=self.prog, width=terminal_columns() - 2)  # type: ignore[call-arg]


def terminal_columns() -> int:
    """shutil.get_terminal_size().columns, as argparse's help formatter reads it: $COLUMNS, else the
    terminal on stdout, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


def add_global_options(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """--root, --backend, --state-dir. `after_command`: the copy each subcommand accepts too
    (`cgturn ps --root R`), which leaves the value given before the command alone when absent."""
    default = argparse.SUPPRESS if after_command else None
    parser.add_argument("--root", default=default, help="managed root on the cgroup2 mount (env CGTURN_ROOT)")
    parser.add_argument("--backend", choices=["auto", "cgroup2", "registry"], default=default,
                        help="which backend to use (env CGTURN_BACKEND; default auto)")
    parser.add_argument("--state-dir", default=default, type=absolute_path,
                        help="registry, metadata fallback and audit log: an absolute path (env CGTURN_STATE_DIR)")


def absolute_path(text: str) -> str:
    """An argparse `type` for --state-dir: a relative path is a usage error (exit 2), as a relative
    --root is, instead of a directory made wherever the command happens to run."""
    if not os.path.isabs(text):
        raise argparse.ArgumentTypeError(f"state directory {text!r} is not an absolute path")
    return text


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def library_arg(parse, what: str):
    """An argparse `type` from a library parser that raises ValueError (`cgturn.limits.parse_size`, ...):
    bad input becomes a usage error (exit 2) while parsing, before anything is created."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = what
    return convert


def id_arg(what: str):
    """An argparse `type` for a task or turn id: blank, NUL or non-UTF-8 ids are usage errors (exit 2)."""
    def validate(text: str) -> str:
        from .. import ids
        return ids.validate(text, what)
    return library_arg(validate, f"{what} id")


def reason_arg(text: str) -> str:
    """An argparse `type`: blank, NUL, undecodable (argv bytes that are not UTF-8) or over-long reasons
    are usage errors (exit 2), refused before anything is touched."""
    try:
        return reasons.validate(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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


def _limit_parser(name: str):
    def parse(text: str):
        from .. import limits  # loaded when a limit option is given, not for every command
        return getattr(limits, name)(text)
    return parse


# (option, Limits field, library parser, help): the limit options `run` and `limits` share.
LIMIT_OPTIONS = (
    ("--memory", "memory_max", "parse_size", "hard memory limit: bytes, K/M/G/T (powers of 1024; below 8 EiB) or max"),
    ("--memory-high", "memory_high", "parse_size", "memory throttling threshold (cgroup v2 only)"),
    ("--swap", "swap_max", "parse_size", "swap on top of memory (on cgroup v1 needs --memory)"),
    ("--pids", "pids_max", "parse_pids", "processes and threads at once: N from 1 to 4194304, or max"),
    ("--cpus", "cpus", "parse_cpus", "CPU time as cores from 0.01, e.g. 0.5 or 2, or max"),
    ("--cpu-weight", "cpu_weight", "parse_weight", "share under contention, 1-10000 (100 = default)"),
)


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """--memory, --memory-high, --swap, --pids, --cpus, --cpu-weight, checked while parsing."""
    for option, field, parse, text in LIMIT_OPTIONS:
        metavar = "N" if parse in ("parse_pids", "parse_weight") else "F" if parse == "parse_cpus" else "SIZE"
        parser.add_argument(option, dest=field, metavar=metavar, help=text,
                            type=library_arg(_limit_parser(parse), option.lstrip("-")))


def limits_from_args(args):
    """The `cgturn.Limits` the limit options ask for, or None when none was given.

    Raises:
        ValueError: the values contradict each other (e.g. --memory-high above --memory).
    """
    given = {field: getattr(args, field) for _, field, _, _ in LIMIT_OPTIONS if getattr(args, field) is not None}
    if not given:
        return None
    from .. import Limits
    return Limits(**given)


def shown_id(text: str) -> str:
    """A task or turn id as a table cell: as it is when every character is printable, else quoted and
    escaped as a Python literal (`'a\\x1b[2Jb'`), so no id can move the cursor, recolour the
    terminal or split a row. `--json` keeps ids exact."""
    return text if text.isprintable() else repr(text)


def format_size(value) -> str:
    """Bytes as people read a limit: `512 MiB`, `1.5 GiB`, `100 B`; "max" and None as given."""
    if value is None or isinstance(value, str):
        return "-" if value is None else value
    for unit, scale in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if value >= scale:
            return f"{value / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{value} B"


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

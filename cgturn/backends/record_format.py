"""The format version every stored turn record carries (xattr JSON, the metadata file fallback, the
registry's SQLite rows), so an upgrade keeps the turns that are running across it.

A record without a version was written before records carried one (cgturn up to this field's
introduction): it has the fields of format 1 and is read as format 1, the same turn — never as
`corrupt`, which any stop or reap would kill. A record with a version newer than `RECORD_FORMAT` was
written by a newer cgturn: this code cannot know what its fields mean, so it reads as a corrupt turn
whose `problem` says so. That is what a downgrade means: turns begun under the newer version are
listed as corrupt (and killed by any stop, reap or end_task) by the older one. Versions only change
when a field's meaning changes; a new field alone does not need one (readers ignore unknown fields).
"""
from __future__ import annotations

RECORD_FORMAT = 1
FORMAT_KEY = "format"  # the key in a record's JSON, the column in the registry's turns table


def format_problem(version: object) -> str | None:
    """Why a record of format `version` (None: written before records carried one) cannot be read
    by this code; None when it can."""
    if version is None:
        return None
    if type(version) is not int or version < 1:
        return f"record format {version!r} is not a format version"
    if version > RECORD_FORMAT:
        return (f"record format {version} is newer than this cgturn reads ({RECORD_FORMAT}): written by a "
                "newer cgturn, which this older one cannot read (a downgrade)")
    return None

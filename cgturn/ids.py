"""Task and turn ids: validation, and the mapping from any id to a safe cgroup directory name.

Ids are user strings (`telegram:123/abc`, unicode) of at most MAX_ID_BYTES bytes of UTF-8. A directory name must:
contain no `/`, never be `.` or `..`, never clash with a kernel interface file, and fit in 255 bytes.
Every interface file name contains a dot (`cgroup.procs`, `cpu.stat`), so names without a dot can
never clash. The encoding is percent-encoding over a small safe alphabet (the dot is encoded), which is
injective; names that would be too long keep a readable prefix and end in `~` plus a SHA-256 of the id.
`~` is itself always percent-encoded, so a shortened name can never equal an unshortened one.
"""
from __future__ import annotations

import functools
import os
import re
import time

# Characters kept as they are. Everything else, including '.', '%' and '~', is %XX-encoded.
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-:@+=,")
# Ids made only of safe characters (fresh turn ids, most task ids) are their own names: one match.
_ALL_SAFE = re.compile("[A-Za-z0-9_\\-:@+=,]{1,%d}" % 255)
_MAX_NAME = 255
_PREFIX_KEEP = 180  # readable part of a shortened name; 180 + 1 + 64 hex = 245 bytes

# The longest id accepted, in bytes of UTF-8. Bounded so that whatever carries ids always has room
# for two of them, even when JSON escapes every byte as \u00XX (6x): a turn record in one 64 KiB
# xattr value (XATTR_SIZE_MAX, xattr(7)), a sentinel message in one 64 KiB datagram.
MAX_ID_BYTES = 4096

# Names cgturn makes for its own use start with this character, which the encoder never emits.
INTERNAL_PREFIX = "#"


def is_blank(value: object) -> bool:
    """True for an empty or whitespace-only string (CONTRACT.md: such ids match nothing)."""
    return isinstance(value, str) and not value.strip()


def validate(value: object, what: str) -> str:
    """Return `value` if it is a usable id; raise ValueError with a one-line reason otherwise.

    Rejected: non-strings, blank strings, strings with NUL, strings that cannot be encoded as UTF-8
    (lone surrogates), and strings longer than MAX_ID_BYTES bytes of UTF-8.
    """
    return validate_text(value, f"{what} id", MAX_ID_BYTES)


def validate_text(value: object, what: str, max_bytes: int) -> str:
    """Return `value` if it is recordable text (ids, reasons, spawn keys); ValueError naming `what`
    otherwise: not a string, blank, NUL, not UTF-8 (a lone surrogate), over `max_bytes` of UTF-8."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, not {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{what} must not be blank")
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8 text") from None
    if size > max_bytes:
        raise ValueError(f"{what} is {size} bytes long; the limit is {max_bytes}")
    return value


@functools.lru_cache(maxsize=4096)  # a record's ids are encoded at every read that verifies it
def encode(value: str) -> str:
    """Map a valid id to its directory name (see module doc). Pure; the caller validates first."""
    if _ALL_SAFE.fullmatch(value):
        return value
    raw = value.encode("utf-8")
    out = "".join(chr(b) if chr(b) in _SAFE else f"%{b:02X}" for b in raw)
    if len(out) <= _MAX_NAME:
        return out
    prefix = out[:_PREFIX_KEEP]
    cut = prefix.rfind("%", len(prefix) - 2)  # do not leave half an escape behind
    if cut != -1:
        prefix = prefix[:cut]
    import hashlib  # only long ids need it: a CLI that lists turns starts faster without it

    return f"{prefix}~{hashlib.sha256(raw).hexdigest()}"


def names(value: object, name: str, what: str) -> bool:
    """True when `value` is a valid `what` id (`validate`) whose directory name (`encode`) is `name`."""
    if value == name and isinstance(value, str) and _ALL_SAFE.fullmatch(name):
        return True  # safe characters only: a valid id, its own name (a listing verifies 1000s of them)
    try:
        return encode(validate(value, what)) == name
    except ValueError:
        return False


def decode(name: str) -> str | None:
    """Invert `encode` for unshortened names; None for shortened or foreign names."""
    if "~" in name or name.startswith(INTERNAL_PREFIX):
        return None
    try:
        raw = bytearray()
        i = 0
        while i < len(name):
            if name[i] == "%":
                raw.append(int(name[i + 1:i + 3], 16))
                i += 3
            else:
                raw.append(ord(name[i]))
                i += 1
        return raw.decode("utf-8")
    except (ValueError, IndexError):
        return None


def new_turn_id() -> str:
    """A fresh turn id: sortable by creation time, unique without coordination."""
    # os.urandom is what secrets.token_hex reads; importing secrets would add hmac and hashlib.
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{os.urandom(3).hex()}"

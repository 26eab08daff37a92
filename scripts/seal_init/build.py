#!/usr/bin/env python3
"""Build scripts/seal_init/seal_init.c into the static executable cgturn/_spawn.c embeds, and print it as
the C array SEAL_INIT_ELF's body (paste it there). Needs gcc on x86_64; the same source and gcc give
the same bytes (no build id, no .comment, no timestamps), so `--check` tells whether the array in
_spawn.c is what the source builds (exit 1, and how they differ, if not):

    python3 scripts/seal_init/build.py            # print the array's body
    python3 scripts/seal_init/build.py --check    # compare it with cgturn/_spawn.c's
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SPAWN_C = os.path.join(HERE, "..", "..", "cgturn", "_spawn.c")
FLAGS = ["-Os", "-static", "-nostdlib", "-nostartfiles", "-fno-asynchronous-unwind-tables", "-fno-stack-protector",
         "-fcf-protection=none", "-Wl,--build-id=none", "-Wl,-z,norelro", "-Wl,-n"]


def build() -> bytes:
    """The stripped executable's bytes."""
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "seal_init")
        subprocess.run(["gcc", *FLAGS, "-o", out, os.path.join(HERE, "seal_init.c")], check=True)
        subprocess.run(["strip", "-s", "-R", ".comment", out], check=True)
        with open(out, "rb") as f:
            return f.read()


def embedded(path: str = SPAWN_C) -> bytes:
    """The bytes of the SEAL_INIT_ELF array in `path` (cgturn/_spawn.c).

    Raises:
        ValueError: `path` holds no such array.
    """
    with open(path) as f:
        found = re.search(r"SEAL_INIT_ELF\[\] = \{(.*?)\};", f.read(), re.S)
    if found is None:
        raise ValueError(f"no SEAL_INIT_ELF array in {path}")
    return bytes(int(byte, 16) for byte in re.findall(r"0x([0-9a-f]{2})", found.group(1)))


def main() -> int:
    data = build()
    if sys.argv[1:] == ["--check"]:
        have = embedded()
        if have == data:
            return 0
        print(f"cgturn/_spawn.c's SEAL_INIT_ELF ({len(have)} bytes) is not what seal_init.c builds "
              f"({len(data)} bytes): paste this script's output there", file=sys.stderr)
        return 1
    for i in range(0, len(data), 16):
        print("    " + ", ".join(f"0x{b:02x}" for b in data[i:i + 16]) + ",")
    print(f"/* {len(data)} bytes */", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

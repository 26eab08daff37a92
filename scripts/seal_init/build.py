#!/usr/bin/env python3
"""Build scripts/seal_init/seal_init.c into the static executable cgturn/_spawn.c embeds, and print it as
the C array SEAL_INIT_ELF's body (paste it there). Needs gcc on x86_64:

    python3 scripts/seal_init/build.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
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


def main() -> int:
    data = build()
    for i in range(0, len(data), 16):
        print("    " + ", ".join(f"0x{b:02x}" for b in data[i:i + 16]) + ",")
    print(f"/* {len(data)} bytes */", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

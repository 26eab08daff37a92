"""`python -m cgturn.sentinel_main`: the sentinel process's entry point (see cgturn.sentinel).

A module of its own because `cgturn/__init__` already imports cgturn.sentinel, and running an
imported module with -m executes it twice (runpy warns).
"""
import sys

from .sentinel import main

if __name__ == "__main__":
    sys.exit(main())

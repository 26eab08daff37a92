"""`python -m cgturn`: the same as the `cgturn` console script."""
import sys

from .cli import main

sys.exit(main())

"""`python -m cgturn`: the same as the `cgturn` console script."""
from .cli import console

console()

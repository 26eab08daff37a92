"""cgturn: every turn in its own cgroup; abandoning a turn kills all it started, daemons included.

Public API: `TurnManager`, `Turn`, the result types and the exceptions below. See README.md.
"""
from .errors import (CgroupUnavailable, CgturnError, KernelError, NoSuchTurn, PermissionDenied, TurnExists,
                     UnsafeOperation)
from .manager import Turn, TurnManager
from .model import ABANDONED, COMPLETED, RUNNING, AbandonResult, TurnInfo
from .supervisor import Outcome, Run, Supervisor, reap_disconnected

__all__ = [
    "TurnManager", "Turn", "AbandonResult", "TurnInfo", "RUNNING", "COMPLETED", "ABANDONED",
    "CgturnError", "CgroupUnavailable", "PermissionDenied", "TurnExists", "NoSuchTurn", "UnsafeOperation",
    "KernelError", "Supervisor", "Outcome", "Run", "reap_disconnected",
]
__version__ = "0.1.0"

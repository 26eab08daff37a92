"""cgturn: every turn in its own cgroup; abandoning a turn kills all it started, daemons included.

Public API: `TurnManager`, `Turn`, the result types and the exceptions below. See README.md.

Names resolve lazily (PEP 562): `import cgturn` costs almost nothing, so a command that only lists
turns never pays for asyncio or the supervisor.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__  # the one place it is written

# public name -> module that defines it
_EXPORTS = {
    "TurnManager": "manager", "Turn": "turn",
    "AbandonResult": "model", "TurnInfo": "model", "Port": "model", "TurnEnded": "model", "TurnListener": "model", "RUNNING": "model", "COMPLETED": "model",
    "ABANDONED": "model", "CORRUPT": "model",
    "CgturnError": "errors", "CgroupUnavailable": "errors", "PermissionDenied": "errors", "TurnExists": "errors",
    "NoSuchTurn": "errors", "UnsafeOperation": "errors", "KernelError": "errors", "NoSuchProcess": "errors",
    "AccessDenied": "errors", "RegistryUnavailable": "errors", "LimitsUnavailable": "errors",
    "IsolationUnavailable": "errors",
    "Overloaded": "errors", "GuardUnavailable": "errors", "PressureGuard": "guard", "AlreadyRunning": "errors",
    "Limits": "limits", "Usage": "limits",
    "RecoveryAction": "recovery",
    "HostInfo": "host", "discover_host": "host", "choose_backend": "host", "doctor_report": "host",
    "ProcessInfo": "processes",
    "Supervisor": "supervisor", "Outcome": "supervisor", "Run": "supervisor",
    "reap_disconnected": "supervisor", "abandon_disconnected": "supervisor",
    "areap_disconnected": "supervisor", "aabandon_disconnected": "supervisor",
    "attach_sentinel": "sentinel",
}
# submodules faces may use through the package: the vocabulary and plain helpers
_SUBMODULES = ("reasons", "processes", "audit", "ids", "errors", "model", "limits")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # resolved once
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cgturn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly ("X as X": re-exported)
    from .errors import (
        AccessDenied as AccessDenied, AlreadyRunning as AlreadyRunning, CgroupUnavailable as CgroupUnavailable,
        CgturnError as CgturnError, GuardUnavailable as GuardUnavailable,
        IsolationUnavailable as IsolationUnavailable, KernelError as KernelError,
        LimitsUnavailable as LimitsUnavailable, NoSuchProcess as NoSuchProcess, NoSuchTurn as NoSuchTurn,
        Overloaded as Overloaded, PermissionDenied as PermissionDenied,
        RegistryUnavailable as RegistryUnavailable, TurnExists as TurnExists, UnsafeOperation as UnsafeOperation)
    from .guard import PressureGuard as PressureGuard
    from .host import (
        HostInfo as HostInfo, choose_backend as choose_backend, discover_host as discover_host,
        doctor_report as doctor_report)
    from .limits import Limits as Limits, Usage as Usage
    from .manager import TurnManager as TurnManager
    from .model import (
        ABANDONED as ABANDONED, COMPLETED as COMPLETED, CORRUPT as CORRUPT, RUNNING as RUNNING,
        AbandonResult as AbandonResult, Port as Port, TurnEnded as TurnEnded, TurnInfo as TurnInfo,
        TurnListener as TurnListener)
    from .processes import ProcessInfo as ProcessInfo
    from .recovery import RecoveryAction as RecoveryAction
    from .sentinel import attach_sentinel as attach_sentinel
    from .supervisor import (
        Outcome as Outcome, Run as Run, Supervisor as Supervisor, aabandon_disconnected as aabandon_disconnected,
        abandon_disconnected as abandon_disconnected, areap_disconnected as areap_disconnected,
        reap_disconnected as reap_disconnected)
    from .turn import Turn as Turn

"""cgturn: every turn in its own cgroup; abandoning a turn kills all it started, daemons included.

Public API: `TurnManager`, `Turn`, the result and event types and the exceptions below (`__all__`,
pinned by tests/test_api.py). See README.md.

Names resolve lazily (PEP 562): `import cgturn` costs almost nothing, so a command that only lists
turns never pays for asyncio or the supervisor.
"""
from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__  # the one place it is written

# public name -> module that defines it
_EXPORTS = {
    "TurnManager": "manager", "Turn": "turn",
    "AbandonResult": "model", "TurnInfo": "model", "TurnRecord": "model",
    "RUNNING": "model", "COMPLETED": "model", "ABANDONED": "model", "CORRUPT": "model",
    "Port": "ports", "TurnEnded": "events", "TurnListener": "events", "TurnHandle": "events",
    "CgturnError": "errors", "CgroupUnavailable": "errors", "PermissionDenied": "errors", "TurnExists": "errors",
    "NoSuchTurn": "errors", "UnsafeOperation": "errors", "KernelError": "errors", "NoSuchProcess": "errors",
    "AccessDenied": "errors", "RegistryUnavailable": "errors", "LimitsUnavailable": "errors",
    "IsolationUnavailable": "errors", "Overloaded": "errors", "GuardUnavailable": "errors",
    "AlreadyRunning": "errors", "SentinelUnavailable": "errors",
    "Limits": "limits", "Usage": "limits",
    "RecoveryAction": "recovery", "RunReport": "run_report",
    "HostInfo": "host", "discover_host": "host", "doctor_report": "host",
    "init_container": "init_setup",
    "ProcessInfo": "processes",
    "PressureGuard": "guard",
    "Supervisor": "supervisor", "Outcome": "supervisor", "Run": "supervisor",
    "abandon_disconnected": "supervisor", "aabandon_disconnected": "supervisor",
}
# Deprecated names, importable for one more release (a DeprecationWarning on every access):
# old name -> (module, the name there, what to use instead).
_DEPRECATED = {
    "choose_backend": ("host", "choose_backend", "TurnManager(backend=...) chooses the backend"),
    "attach_sentinel": ("sentinel", "attach_sentinel", "Supervisor.start_sentinel(manager)"),
    "reap_disconnected": ("supervisor", "abandon_disconnected", "cgturn.abandon_disconnected"),
    "areap_disconnected": ("supervisor", "aabandon_disconnected", "cgturn.aabandon_disconnected"),
}
# submodules faces may use through the package: the vocabulary and plain helpers
_SUBMODULES = ("reasons", "processes", "audit", "ids", "errors", "model", "limits")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # resolved once
        return value
    if name in _DEPRECATED:
        module, attr, instead = _DEPRECATED[name]
        warnings.warn(f"cgturn.{name} is deprecated and will be removed in the next minor release: {instead}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f".{module}", __name__), attr)  # never cached: each use warns
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
        RegistryUnavailable as RegistryUnavailable, SentinelUnavailable as SentinelUnavailable,
        TurnExists as TurnExists, UnsafeOperation as UnsafeOperation)
    from .events import TurnEnded as TurnEnded, TurnHandle as TurnHandle, TurnListener as TurnListener
    from .guard import PressureGuard as PressureGuard
    from .host import HostInfo as HostInfo, discover_host as discover_host, doctor_report as doctor_report
    from .init_setup import init_container as init_container
    from .limits import Limits as Limits, Usage as Usage
    from .manager import TurnManager as TurnManager
    from .model import (
        ABANDONED as ABANDONED, COMPLETED as COMPLETED, CORRUPT as CORRUPT, RUNNING as RUNNING,
        AbandonResult as AbandonResult, TurnInfo as TurnInfo, TurnRecord as TurnRecord)
    from .ports import Port as Port
    from .processes import ProcessInfo as ProcessInfo
    from .recovery import RecoveryAction as RecoveryAction
    from .run_report import RunReport as RunReport
    from .supervisor import (
        Outcome as Outcome, Run as Run, Supervisor as Supervisor, aabandon_disconnected as aabandon_disconnected,
        abandon_disconnected as abandon_disconnected)
    from .turn import Turn as Turn

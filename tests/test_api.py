"""The public surface: `cgturn.__all__` exactly (a change to it is a visible diff here), the deprecated
aliases (they warn and still work), the friend operations off TurnManager, and docstrings on every
public name and every public method of its classes.
"""
import importlib
import inspect
import subprocess
import sys
import warnings

import pytest

import cgturn

PUBLIC = [
    "ABANDONED", "AbandonResult", "AccessDenied", "AlreadyRunning", "COMPLETED", "CORRUPT", "CgroupUnavailable",
    "CgturnError", "GuardUnavailable", "HostInfo", "IsolationUnavailable", "KernelError", "Limits",
    "LimitsUnavailable", "NoSuchProcess", "NoSuchTurn", "Outcome", "Overloaded", "PermissionDenied", "Port",
    "PressureGuard", "ProcessInfo", "RUNNING", "RecoveryAction", "RegistryUnavailable", "Run", "RunReport",
    "SentinelUnavailable", "Supervisor", "Turn", "TurnEnded", "TurnExists", "TurnHandle", "TurnInfo",
    "TurnListener", "TurnManager", "TurnRecord", "UnsafeOperation", "Usage", "aabandon_disconnected",
    "abandon_disconnected", "discover_host", "doctor_report", "init_container",
]

# old name -> the object it stands for now (module, name)
DEPRECATED = {
    "choose_backend": ("cgturn.host", "choose_backend"),
    "attach_sentinel": ("cgturn.sentinel", "attach_sentinel"),
    "reap_disconnected": ("cgturn.supervisor", "abandon_disconnected"),
    "areap_disconnected": ("cgturn.supervisor", "aabandon_disconnected"),
}

# What Turn and supervision use through `manager._control`, never through TurnManager (PLAN: the house).
FRIENDS = ("complete_turn", "abandon_turn", "finish_kill", "take_abandon_note", "turn_usage_quietly", "adopt_into",
           "running_turns_of_caller", "owner_alive", "turn_state", "check_limits", "freeze_turn", "thaw_turn",
           "set_lease", "expire_lease", "spawn_keyed")

# The modules whose public names must be documented in this branch; the supervision layer's (and the
# kernel's HostInfo) are listed by the same check and pass once their branches are merged.
DOCUMENTED_HERE = ("cgturn.manager", "cgturn.turn", "cgturn.control", "cgturn.governance", "cgturn.recovery",
                   "cgturn.host", "cgturn.processes", "cgturn.model", "cgturn.events", "cgturn.ports",
                   "cgturn.errors", "cgturn.limits", "cgturn.run_report")


def test_all_is_exactly_the_public_surface():
    assert cgturn.__all__ == sorted(PUBLIC)
    assert len(set(PUBLIC)) == len(PUBLIC)


def test_every_public_name_resolves_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in cgturn.__all__:
            assert getattr(cgturn, name) is not None, name


def test_importing_the_package_loads_nothing_heavy():
    """The lazy names stay lazy: `import cgturn` imports no submodule that costs (asyncio, the manager);
    only the bare version leaf, which imports nothing."""
    code = "import sys, cgturn; print(sorted(m for m in sys.modules if m.startswith('cgturn') or m == 'asyncio'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "['cgturn', 'cgturn._version']"


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_a_deprecated_alias_warns_and_still_works(old):
    module, name = DEPRECATED[old]
    with pytest.warns(DeprecationWarning, match=f"cgturn.{old} is deprecated"):
        value = getattr(cgturn, old)
    assert value is getattr(importlib.import_module(module), name)
    assert old not in cgturn.__all__
    with pytest.warns(DeprecationWarning):  # every use warns, not only the first
        getattr(cgturn, old)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        cgturn.no_such_name  # noqa: B018


def test_deprecated_spellings_of_the_names_of_a_turn_warn_and_agree(tmp_path):
    from cgturn import reasons
    from cgturn.events import TurnEnded

    event = TurnEnded("t", "u", "tk", "uk", cgturn.COMPLETED)
    assert event.names == ("tk", "uk")
    with pytest.warns(DeprecationWarning, match="TurnEnded.key"):
        assert event.key == event.names
    with pytest.warns(DeprecationWarning, match="UNKNOWN"):
        assert reasons.UNKNOWN == reasons.UNRECORDED == "unrecorded"
    with cgturn.TurnManager(backend="registry", state_dir=str(tmp_path)) as mgr:
        turn = mgr.begin_turn("api-task")
        with pytest.warns(DeprecationWarning, match="Turn.key"):
            assert turn.key == turn.names == ("api-task", turn.turn_id)
        turn.complete()


def test_friend_operations_are_on_the_control_not_on_the_manager():
    from cgturn.control import TurnControl

    for name in FRIENDS:
        assert callable(getattr(TurnControl, name)), name
        assert name not in vars(cgturn.TurnManager), f"TurnManager.{name} is back on the public surface"


def test_recovery_action_names_are_not_the_reasons():
    """`lease-expired` is both a reason and a `reap --json` action (the contract pins both strings);
    the two constants have different names so neither is mistaken for the other."""
    from cgturn import reasons, recovery

    assert recovery.KILLED_EXPIRED == reasons.LEASE_EXPIRED == "lease-expired"
    assert not hasattr(recovery, "LEASE_EXPIRED")


def _public_members(obj):
    """(qualified name, member) of the public callables and properties a class defines itself."""
    for name, member in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            yield f"{obj.__name__}.{name}", member


def _undocumented(name):
    obj = getattr(cgturn, name)
    if not (inspect.isclass(obj) or callable(obj)):
        return []  # a constant: documented where it is defined
    missing = []
    if not (inspect.getdoc(obj) or "").strip():
        missing.append(name)
    if inspect.isclass(obj):
        for qualified, member in _public_members(obj):
            doc = member.__doc__ or ""
            if not doc.strip() or not doc.strip().splitlines()[0].strip():
                missing.append(qualified)
    return missing


def _module_of(name):
    return getattr(getattr(cgturn, name), "__module__", None) or cgturn._EXPORTS[name]


@pytest.mark.parametrize("name", [n for n in PUBLIC if _module_of(n) in DOCUMENTED_HERE])
def test_public_names_and_their_methods_have_docstrings(name):
    """Every public name of the modules above, and every public method and property of its classes,
    opens with a one-line summary (Args/Returns/Raises follow where there is something to say)."""
    assert _undocumented(name) == []


@pytest.mark.parametrize("name", [n for n in PUBLIC if _module_of(n) not in DOCUMENTED_HERE])
def test_public_names_of_other_layers_have_docstrings(name):
    """The same check for the supervision layer's names (and HostInfo, the kernel's): their modules
    are documented on their own branches, so what is missing is listed here until those merge."""
    missing = _undocumented(name)
    if missing:
        pytest.xfail(f"undocumented until the supervision/kernel branches merge: {', '.join(missing)}")

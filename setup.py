"""The optional C extension (cgturn._spawn: clone3 straight into a turn's cgroup). Everything else is in
pyproject.toml.

optional=True: without a compiler, or off x86_64, the build of the extension fails quietly and cgturn
spawns through its shim (`cgturn doctor` then lists the problem). py_limited_api: the extension uses the
stable ABI of CPython 3.11, so one `cp311-abi3` wheel serves 3.11, 3.12, 3.13 and later (docs/install.md).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[Extension("cgturn._spawn", ["cgturn/_spawn.c"], optional=True, py_limited_api=True,
                           define_macros=[("Py_LIMITED_API", "0x030B0000")],
                           extra_compile_args=["-O2", "-Wall"])],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)

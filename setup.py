"""The optional C extension (cgturn._spawn: clone3 straight into a turn's cgroup). Everything else is in
pyproject.toml. optional=True: without a compiler, or off x86_64, the build of the extension fails
quietly and cgturn spawns through its shim."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cgturn._spawn", ["cgturn/_spawn.c"], optional=True,
                             extra_compile_args=["-O2", "-Wall"])])

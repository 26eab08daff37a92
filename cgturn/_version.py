"""The version of cgturn: the one place it is written. `cgturn.__version__`, `cgturn --version` and the
package metadata (pyproject.toml reads it as a dynamic version) all come from here. The policy that says
when which part changes is in docs/versions.md."""

__version__ = "0.1.0"

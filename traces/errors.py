"""User-facing errors: one line that names the thing at fault and how to fix it."""

from __future__ import annotations


class ParatwinError(Exception):
    """Base of every error paratwin reports to a user (the CLI prints it without a traceback)."""


class BundleError(ParatwinError):
    """A trace bundle, table or trace file that cannot be read as asked."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class ConfigError(ParatwinError):
    """A plan, cluster spec or workload configuration that fails validation."""

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        message = f"{field}: {problem}" + (f" (fix: {fix})" if fix else "")
        super().__init__(message)
        self.field = field
        self.problem = problem
        self.fix = fix

"""Typed loader errors: ``ValueError`` subclasses that name the value, the bound and the fix.

``str(err)`` carries the place (step file and line), so the text survives a DataLoader worker
boundary; ``__reduce__`` keeps the attributes through pickling as well.
"""

from __future__ import annotations


class LoaderError(ValueError):
    """Base class: loader input, configuration or saved state is not what the loader needs."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None) -> None:
        self.message, self.file, self.line = message, file, line
        where = [f"{k}={v}" for k, v in (("file", file), ("line", line)) if v is not None]
        super().__init__(f"{message} [{', '.join(where)}]" if where else message)

    def __reduce__(self):
        return (type(self), (self.message,), {"file": self.file, "line": self.line})

    def __setstate__(self, state: dict) -> None:
        self.__init__(self.message, **state)


class LoaderConfigError(LoaderError):
    """Bad constructor arguments (sizes, ranks, policies)."""


class StepFileError(LoaderError):
    """A step file holds a line that is not a valid sample record."""


class StepTimeoutError(LoaderError):
    """Stream mode: the next step file did not appear within the wait bound."""


class LoaderStateError(LoaderError):
    """A saved state cannot be loaded here (other version, world shape or seed)."""


class EmptyStepError(LoaderError):
    """A step has no micro batch to train on: its file holds no samples, or all were dropped."""

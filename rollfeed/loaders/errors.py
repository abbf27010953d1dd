"""Typed loader errors: :class:`~rollfeed.errors.RollfeedError` subclasses that name the value,
the bound and the fix, and the place (step file, step and sample, DataLoader worker).
"""

from __future__ import annotations

from rollfeed.errors import RollfeedError


class LoaderError(RollfeedError):
    """Base class: loader input, configuration or saved state is not what the loader needs."""

    PLACE = ("file", "line", "step", "sample", "worker")


class LoaderConfigError(LoaderError):
    """Bad constructor arguments (sizes, ranks, policies)."""


class StepFileError(LoaderError):
    """A step file cannot be read as one: bytes or a record that are not what its format says, a
    record that is not a valid sample, something other than a regular file (a symlink, a FIFO, a
    directory) under a step file's name, or a step file of the JSON-lines format."""


class StepMissingError(StepFileError):
    """A step asked for by number has no step file (names the step and the directory)."""


class StepReplacedError(StepFileError):
    """A step file is not the version its step was planned from: it was replaced (or rewritten)
    after planning, so its samples or lengths may differ from the plan's."""


class StepWriteError(LoaderError):
    """Writing a step file or its index failed (disk full, file size limit, I/O error); nothing of
    the attempt is left behind."""


class StepTimeoutError(LoaderError):
    """A pass's step file did not appear within ``step_timeout_s`` (names the directory, what it
    holds, and the newest step there)."""


class LoaderStateError(LoaderError):
    """A saved state cannot be resumed exactly here: another version, world shape, seed or plan,
    a step whose samples are not those it counted, or more micro batches consumed than the step
    has."""


class EmptyStepError(LoaderError):
    """A step has no micro batch to train on: its file holds no samples, or all were dropped."""


class PlanMismatchError(LoaderConfigError):
    """The collator's planner config is not the one the sampler planned the micro batch with."""


class WorkerError(LoaderError):
    """A DataLoader worker cannot deliver the micro batch the trainer waits for (names the worker,
    its pid in the message, and the step)."""


class WorkerStoppedError(WorkerError):
    """A worker stays stopped (``SIGSTOP``, a debugger) while the trainer waits for it."""


class WorkerDiedError(WorkerError):
    """A worker exited or was killed (``SIGKILL``, the OOM killer) before delivering."""


class WorkerTimeoutError(WorkerError):
    """Running workers delivered no micro batch within ``LoaderOptions.timeout_s``."""

"""The trainer's progress file: how far the trainer is, for the producer that must not run ahead.

A trainer writes ``trainer_progress.json`` in the step directory after each checkpoint it
completes: the steps it has trained (``step``: the next step it trains), the policy ``version``
of its weights then, and where that checkpoint's weights are (``weights``, a directory an
inference server can load; ``None`` when it writes none). It is written whole or not at all (a
temporary file, ``fsync``, ``rename``, ``fsync`` of the directory; one PUT on an object store),
and only after the checkpoint it names is complete, so a reader never sees progress the trainer
would not resume from: after a crash the trainer resumes from that checkpoint or a later one.

The producer reads it to stay at most ``max_ahead`` steps ahead (it samples step ``k`` only once
``step >= k - max_ahead``) and to tell its inference server which weights to load.

Example::

    write_progress("/run/steps", TrainerProgress(step=3, version=3, weights="/run/weights/v3"))
    read_progress("/run/steps")  # TrainerProgress(step=3, version=3, weights='/run/weights/v3')
    read_progress("/run/empty")  # None: the trainer has not finished a step
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from rollfeed.loaders.step_files import step_root
from rollfeed.orchestrator.errors import ProgressFileError
from rollfeed.payload import PayloadMissingFileError

PROGRESS_NAME = "trainer_progress.json"
_MAX_BYTES = 1 << 16


class TrainerProgress(BaseModel):
    """``step``: optimizer steps done (the next step file the trainer trains on); ``version``:
    the policy version of the weights after them; ``weights``: the directory of those weights, or
    None; ``checkpoint``: the trainer's checkpoint they come from, or None."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: StrictInt = Field(ge=0)
    version: StrictInt = Field(ge=0)
    weights: str | None = None
    checkpoint: str | None = None


def write_progress(
    directory: str | os.PathLike[str],
    progress: TrainerProgress,
    *,
    store: Mapping[str, object] | None = None,
) -> str:
    """Put ``progress`` in step directory ``directory``, whole (see the module doc); its path."""
    root = step_root(directory, store)
    try:
        staged = root.store.stage(PROGRESS_NAME, fsync=True)
        staged.write(progress.model_dump_json().encode())
        staged.commit()
        return root.store.where(PROGRESS_NAME)
    finally:
        root.close()


def read_progress(
    directory: str | os.PathLike[str], *, store: Mapping[str, object] | None = None
) -> TrainerProgress | None:
    """The progress in step directory ``directory``; ``None`` when there is none yet."""
    root = step_root(directory, store)
    where = root.store.where(PROGRESS_NAME)
    try:
        f = root.store.open_file(PROGRESS_NAME)
        try:
            if f.size > _MAX_BYTES:
                raise ProgressFileError(
                    f"the progress file holds {f.size} bytes, more than a progress record's "
                    f"{_MAX_BYTES}",
                    file=where,
                )
            data = f.read(0, f.size)
        finally:
            f.close()
    except PayloadMissingFileError:
        return None
    finally:
        root.close()
    try:
        return TrainerProgress.model_validate_json(data)
    except ValidationError as err:
        raise ProgressFileError(
            f"the progress file is not a trainer progress record: {err.errors()[0]['msg']}",
            file=where,
        ) from None

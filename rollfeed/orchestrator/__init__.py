"""The orchestrator, between the capture server and the trainer: requests out, samples and steps in.

:class:`CaptureClient` talks to a capture server (``python -m rollfeed serve``,
:mod:`rollfeed.capture`); :class:`Rollout` stitches a rollout's turns into one
:class:`~rollfeed.collate.Sample`, and :meth:`CaptureClient.step_writer` writes a step file the
trainer's loaders read as rollouts finish (:class:`rollfeed.loaders.StepWriter`;
:meth:`CaptureClient.write_step` writes a list at once). :class:`OpenAIRollouts` makes
the same rollouts from the answers of vLLM's OpenAI endpoints that captured (an agent framework
on the plain ``openai`` client).

:class:`Producer` runs the loop's rollout side: prompts (:class:`Prompt`) sampled in groups by a
client, rewards made advantages within each group (:func:`group_advantages`), steps written as
they finish, at most ``max_ahead`` steps ahead of the trainer's progress file
(:class:`TrainerProgress`, :func:`write_progress`, :func:`read_progress`), every event recorded
first in a durable cursor beside the step files (:class:`RolloutCursor`), so a producer killed
anywhere continues where it stopped: nothing lost, nothing sampled twice.

It sits downstream of both sides, so it may import capture, collate and loaders; none of them
imports it.
"""

from rollfeed.orchestrator.client import CaptureClient, Rollout
from rollfeed.orchestrator.cursor import RolloutCursor
from rollfeed.orchestrator.errors import (
    CursorCorruptError,
    CursorInUseError,
    CursorMismatchError,
    CursorWriteError,
    OrchestratorError,
    ProgressFileError,
)
from rollfeed.orchestrator.groups import Prompt, group_advantages
from rollfeed.orchestrator.openai_rollouts import OpenAIRollouts
from rollfeed.orchestrator.producer import Producer
from rollfeed.orchestrator.producer_config import ProducerConfig
from rollfeed.orchestrator.progress import TrainerProgress, read_progress, write_progress

__all__ = [
    "CaptureClient",
    "CursorCorruptError",
    "CursorInUseError",
    "CursorMismatchError",
    "CursorWriteError",
    "OpenAIRollouts",
    "OrchestratorError",
    "Producer",
    "ProducerConfig",
    "ProgressFileError",
    "Prompt",
    "Rollout",
    "RolloutCursor",
    "TrainerProgress",
    "group_advantages",
    "read_progress",
    "write_progress",
]

"""The orchestrator, between the capture server and the trainer: requests out, samples and steps in.

:class:`CaptureClient` talks to a capture server (``python -m rollfeed serve``,
:mod:`rollfeed.capture`); :class:`Rollout` stitches a rollout's turns into one
:class:`~rollfeed.collate.Sample`, and :meth:`CaptureClient.step_writer` writes a step file the
trainer's loaders read as rollouts finish (:class:`rollfeed.loaders.StepWriter`;
:meth:`CaptureClient.write_step` writes a list at once). :class:`OpenAIRollouts` makes
the same rollouts from the answers of vLLM's OpenAI endpoints that captured (an agent framework
on the plain ``openai`` client). It sits downstream of both
sides, so it may import capture, collate and loaders; none of them imports it.
"""

from rollfeed.orchestrator.client import CaptureClient, Rollout
from rollfeed.orchestrator.openai_rollouts import OpenAIRollouts

__all__ = ["CaptureClient", "OpenAIRollouts", "Rollout"]

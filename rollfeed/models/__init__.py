"""rollfeed.models: scoring over the recorded sampling support (plain, fused LM head, TP, cp);
the trainer's weights as a checkpoint the capture server loads (:func:`save_checkpoint`).

Metrics convention: every ``metrics`` dict of this package (:class:`SupportScores`, the counters of
:meth:`RouterReplay.set`) maps a counter's name to a 0-d int64 tensor on the device of the inputs.
Nothing is read back to the host until the caller reads it (``int(v)``, ``v.item()``, or one
``torch.stack`` of the values and one ``.tolist()``), so a training step that never logs pays no
sync for them. Counters are this rank's own (under ``cp``, its shard of the row); sum them over a
group to count the whole row.

Errors are :class:`ModelError` subclasses (a :class:`~rollfeed.errors.RollfeedError`), placed by
input tensor, row position, sample and layer as far as they are known.

Renamed (the old names work until the next release, with a ``DeprecationWarning``):
``SupportScores.kept_logprobs`` is :attr:`SupportScores.support_logprobs`, and the scorers'
``return_kept_logprobs=`` is ``return_support_logprobs=``.
"""

from rollfeed.models.checkpoint import CheckpointWriteError, save_checkpoint
from rollfeed.models.cp_group import CPGroup
from rollfeed.models.errors import (
    CPGroupError,
    CPMismatchError,
    GradientReductionError,
    LMHeadError,
    ModelError,
    NonFiniteLogitError,
    PackingError,
    RoutingReplayError,
    SupportInputError,
    SupportLabelError,
    TemperatureError,
    UlyssesShapeError,
    UnpackableAttentionError,
    VocabularyRangeError,
)
from rollfeed.models.fused import fused_support_logprobs
from rollfeed.models.gradient_sum import sum_gradients
from rollfeed.models.policy import PolicyScorer
from rollfeed.models.router_replay import RouterReplay, Routing
from rollfeed.models.support import SupportScores, support_logprobs

__all__ = [
    "CPGroup",
    "CPGroupError",
    "CPMismatchError",
    "CheckpointWriteError",
    "GradientReductionError",
    "LMHeadError",
    "ModelError",
    "NonFiniteLogitError",
    "PackingError",
    "PolicyScorer",
    "RouterReplay",
    "Routing",
    "RoutingReplayError",
    "SupportInputError",
    "SupportLabelError",
    "SupportScores",
    "TemperatureError",
    "UlyssesShapeError",
    "UnpackableAttentionError",
    "VocabularyRangeError",
    "fused_support_logprobs",
    "save_checkpoint",
    "sum_gradients",
    "support_logprobs",
]

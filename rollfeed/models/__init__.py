"""rollfeed.models: scoring over the recorded sampling support (plain, fused LM head, TP)."""

from rollfeed.models.candidates import SupportInputError, SupportLabelError
from rollfeed.models.fused import fused_support_logprobs
from rollfeed.models.support import SupportScores, support_logprobs

__all__ = [
    "SupportInputError",
    "SupportLabelError",
    "SupportScores",
    "fused_support_logprobs",
    "support_logprobs",
]

"""rollfeed.models: scoring over the recorded sampling support (plain, fused LM head, TP)."""

from rollfeed.models.candidates import (
    SupportInputError,
    SupportLabelError,
    TemperatureError,
    VocabularyRangeError,
)
from rollfeed.models.fused import fused_support_logprobs
from rollfeed.models.packing_attention import (
    PACKED_ATTENTION,
    PackedLayout,
    PackingError,
    UnpackableAttentionError,
    packed_layout,
    register_packed_attention,
)
from rollfeed.models.policy import PolicyScorer, PolicyScores
from rollfeed.models.router_replay import RouterReplay, Routing, RoutingReplayError
from rollfeed.models.support import SupportScores, support_logprobs
from rollfeed.models.ulysses import (
    SequenceParallel,
    UlyssesShapeError,
    gather_sequence,
    heads_to_seq,
    seq_to_heads,
)

__all__ = [
    "PACKED_ATTENTION",
    "PackedLayout",
    "PackingError",
    "PolicyScorer",
    "PolicyScores",
    "RouterReplay",
    "Routing",
    "RoutingReplayError",
    "SequenceParallel",
    "SupportInputError",
    "SupportLabelError",
    "SupportScores",
    "TemperatureError",
    "UlyssesShapeError",
    "UnpackableAttentionError",
    "VocabularyRangeError",
    "fused_support_logprobs",
    "gather_sequence",
    "heads_to_seq",
    "packed_layout",
    "register_packed_attention",
    "seq_to_heads",
    "support_logprobs",
]

"""What to capture and how strictly: one :class:`CaptureConfig` per run.

It fixes the sampler's ``top_k`` (the bound of every kept set), how many logprobs to ask per token
so a cut kept set is detectable, the replay policy and the routing dtype, so the engine check, the
sampling parameters, the writer and the conversion all read the same numbers.

Example: ``CaptureConfig(top_k=20, num_experts=128)`` -> ``requested == 21`` (ask vLLM for 21
processed logprobs per token), ``writer_dtypes == {"routed_experts": "uint8"}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollfeed.capture.errors import CaptureError, SamplingSettingsError
from rollfeed.capture.kept_set import POLICIES, Policy
from rollfeed.capture.routing import routed_dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureConfig:
    """What to capture and how strictly.

    top_k: the sampler's top_k (>= 2): it bounds the kept set. extra_logprobs: entries asked beyond
    top_k (>= 1) so a cut kept set is detectable; ``requested = top_k + extra_logprobs``.
    policy: ``"error"`` | ``"repair"`` (see :mod:`rollfeed.capture.kept_set`).
    num_experts: the model's experts per MoE layer, when routing is captured (sets uint8/uint16).
    mask_logprobs: also write ``sampling_mask_logprobs``.
    """

    top_k: int
    extra_logprobs: int = 1
    policy: Policy = "error"
    num_experts: int | None = None
    mask_logprobs: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k <= 1:
            raise SamplingSettingsError(
                f"capture needs top_k >= 2 to bound the kept set, got top_k={self.top_k!r}; "
                "sample with top_k (e.g. 50) or turn capture off"
            )
        if self.extra_logprobs < 1:
            raise CaptureError(
                f"extra_logprobs must be >= 1 so a cut kept set is detectable, got "
                f"{self.extra_logprobs}"
            )
        if self.policy not in POLICIES:
            raise CaptureError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.num_experts is not None:
            routed_dtype(self.num_experts)

    @property
    def writer_dtypes(self) -> dict[str, str]:
        """``dtypes=`` for :class:`~rollfeed.payload.PayloadWriter`: one routing dtype for every
        request of a run."""
        if self.num_experts is None:
            return {}
        return {"routed_experts": routed_dtype(self.num_experts).name}

    @property
    def requested(self) -> int:
        """Logprobs to ask per token (``SamplingParams.logprobs``)."""
        return self.top_k + self.extra_logprobs

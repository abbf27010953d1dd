"""rollfeed.objectives: loss objectives over the sampler's kept set, as functions a loss calls.

Score centering (arXiv:2609.20807), token and sequence importance weights and mismatch metrics,
from the trainer's logprob of every kept id (:attr:`rollfeed.models.SupportScores.support_logprobs`)
and the sampler's (``sampling_mask_logprobs``). A loss step::

    support, mask_lp = micro_batch_rows(mb)
    out = scorer.score(mb, return_support_logprobs=True)
    distribution = support_distribution(support, out.support_logprobs, mask_lp, labels=mb.labels,
                                        loss_mask=mb.loss_mask,
                                        inference_logprobs=mb.inference_logprobs)
    terms = policy_loss(distribution, out.logprobs[mb.positions], mb.advantages,
                        weight=TruncatedIS(cap=2.0), centering=ScoreCentering(),
                        positions=mb.positions, cu_seqlens=mb.cu_seqlens, group=cp_group)
    aggregate(terms.loss, mb, mode="token_mean").backward()   # this micro batch's share

:func:`aggregate` normalises over the whole step from the counts every micro batch carries
(``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum``): summed over every rank and
micro batch, the shares are the loss of the whole step in one process (the gradients summed over
ranks, :func:`rollfeed.models.sum_gradients`).

With the micro batch's policy versions (``versions=mb.versions, lag=VersionLag(step=k)``) the
mismatch metrics are split by version lag and a weight per lag may scale each token's term
(:mod:`rollfeed.objectives.version_lag`).

Every function returns per-token terms ``[N]`` (the caller reduces them) and metric sums as 0-d
tensors on the inputs' device; ``support_distribution`` and ``policy_loss`` each read their input
checks back in one host sync. Errors are :class:`ObjectiveError` subclasses (a
:class:`~rollfeed.errors.RollfeedError`): bad input (:class:`ObjectiveInputError`; a NaN where a
logprob should be, positions outside the micro batch), an input the objective needs and did not
get (:class:`ObjectiveMissingInputError`), a loss token without a sampler logprob under
``no_sampler_logprob="error"`` (:class:`NoSamplerLogprobError`), a term beyond the dtype
(:class:`ObjectiveOverflowError`), options that do not compose (:class:`ObjectiveCompositionError`).
A mean :func:`finish_metrics` cannot compute is absent and named in ``metrics["not_computed"]``.

Renamed (the old names work until the next release, with a ``DeprecationWarning``):
``KeptDistribution`` is :class:`SupportDistribution`, ``kept_distribution`` is
:func:`support_distribution` (its ``kept_logprobs=`` is ``support_logprobs=``), ``policy_loss``'s
``kept=`` is ``distribution=``, the counter ``rows_no_kept_set`` is ``rows_no_support``.
"""

from rollfeed.deprecation import renamed_names as _renamed_names
from rollfeed.objectives.aggregate import AGGREGATIONS, aggregate
from rollfeed.objectives.errors import (
    NoSamplerLogprobError,
    ObjectiveCompositionError,
    ObjectiveError,
    ObjectiveInputError,
    ObjectiveMissingInputError,
    ObjectiveOverflowError,
)
from rollfeed.objectives.micro_batch_rows import micro_batch_rows
from rollfeed.objectives.mismatch import finish_metrics
from rollfeed.objectives.policy_loss import PolicyTerms, PPOClip, ScoreCentering, policy_loss
from rollfeed.objectives.sequence_weights import SequenceWeight
from rollfeed.objectives.support_distribution import SupportDistribution, support_distribution
from rollfeed.objectives.token_weights import (
    MaskedIS,
    TokenWeight,
    TruncatedIS,
    TrustRegion,
    Unweighted,
)
from rollfeed.objectives.version_lag import VersionLag

__getattr__ = _renamed_names(
    __name__,
    {"KeptDistribution": "SupportDistribution", "kept_distribution": "support_distribution"},
)

__all__ = [
    "AGGREGATIONS",
    "MaskedIS",
    "NoSamplerLogprobError",
    "ObjectiveCompositionError",
    "ObjectiveError",
    "ObjectiveInputError",
    "ObjectiveMissingInputError",
    "ObjectiveOverflowError",
    "PPOClip",
    "PolicyTerms",
    "ScoreCentering",
    "SequenceWeight",
    "SupportDistribution",
    "TokenWeight",
    "TruncatedIS",
    "TrustRegion",
    "Unweighted",
    "VersionLag",
    "aggregate",
    "finish_metrics",
    "micro_batch_rows",
    "policy_loss",
    "support_distribution",
]

"""The planner: token counts -> micro batches per DP rank (truncate, balance, pack, pad).

:func:`plan_lengths` plans from integers alone; :func:`prepare_batch` is that plan placed
(:func:`~rollfeed.collate.micro_batch.place_micro_batch`) on the samples. Steps, all pure and
deterministic (same inputs -> same plan on every rank):

1. Truncate at ``seq_len`` (``overlong``: ``"truncate"`` | ``"drop"`` | ``"error"``, counted);
   never inside an image's placeholder run: before it, or the sample is dropped when nothing
   precedes it (counted, :mod:`rollfeed.collate.image_runs`).
2. Balance samples over DP ranks by the cost of their slots (linear + quadratic, Karmarkar–Karp
   then refinement, :mod:`rollfeed.collate.balance`); balancing whole samples rather than packed
   bins keeps the granularity fine.
3. Pack each rank's samples First-Fit-Decreasing into micro batches of at most ``seq_len`` tokens
   (zigzag slots padded to ``2 * cp_size`` first), heaviest micro batch first so that the ranks'
   k-th micro steps are alike.
4. Pad each micro batch to a multiple of the pad multiple (``PlanConfig.pad``) and give short
   ranks dummy micro batches of that minimum length, so every rank runs the same number of micro
   steps.
With :class:`~rollfeed.collate.SharedPrefixes` (and ``PlanConfig.trees``), step 2 first makes
the samples' prefix trees (:mod:`rollfeed.collate.prefix_trees`): a tree is one unit to balance
(by the tokens it computes, each shared prefix once, and its attention pairs) and to pack (by its
token count), and its samples stay consecutive in the micro batch, in the tree's order.
``plan.trees[r][k]`` holds each micro batch's trees as ``(first sample, tree)``. Samples with
images claim no shared prefix, and in a step with trees they are packed apart from the text.

5. Given the samples' loss runs (:class:`~rollfeed.collate.loss_runs.LossRuns`), count the step's
   loss tokens after truncation (:mod:`rollfeed.collate.step_counts`): ``plan.loss``, which every
   micro batch carries as its ``step_counts``, and the metrics ``loss_tokens``,
   ``samples_with_loss``, ``samples_without_loss`` and ``micro_batches_without_loss``.

Worked example (``seq_len=8``, ``dp_size=2``, lengths ``[5, 3, 6, 2]``, contiguous, cp 1)::

    plan_lengths([5, 3, 6, 2], config, dp_size=2)  -> [[(2, 3)], [(0, 1)]]
    prepare_batch(samples, config, dp_size=2)      -> rank 0: [MicroBatch(indices=(2, 3), length=8)]
                                                      rank 1: [MicroBatch(indices=(0, 1), length=8)]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from rollfeed.collate.balance import partition_costs, sequence_cost
from rollfeed.collate.config import PlanConfig
from rollfeed.collate.cp import slot_lengths
from rollfeed.collate.errors import BatchConfigError, OverlongError, SampleLengthError
from rollfeed.collate.image_runs import ImageRuns
from rollfeed.collate.loss_runs import LossRuns
from rollfeed.collate.micro_batch import place_micro_batch
from rollfeed.collate.pack import pack_ffd
from rollfeed.collate.prefix_trees import PrefixTree, Unit, micro_batch_trees, plan_units
from rollfeed.collate.sample import Sample
from rollfeed.collate.shared_prefix import SharedPrefixes, check_prefixes
from rollfeed.collate.step_counts import StepLoss

logger = logging.getLogger(__name__)


Trees = tuple[tuple[int, PrefixTree], ...]


class BatchPlan(list):
    """``plan[dp_rank][micro_step]`` plus ``plan.metrics`` (counters, ratios), ``plan.loss``
    (the step's loss tokens, :class:`~rollfeed.collate.step_counts.StepLoss`; ``None`` when
    planned without loss runs) and ``plan.trees`` (``[dp_rank][micro_step]``: the micro batch's
    prefix trees as ``(first sample, tree)``, ``()`` for none).

    Entries are :class:`~rollfeed.collate.MicroBatch` from :func:`prepare_batch`, and tuples of
    sample positions in packing order (``()`` for a dummy) from :func:`plan_lengths`.
    """

    def __init__(
        self,
        ranks: list[list],
        metrics: dict[str, float],
        loss: StepLoss | None = None,
        trees: list[list[Trees]] | None = None,
    ) -> None:
        super().__init__(ranks)
        self.metrics, self.loss = metrics, loss
        self.trees = [[() for _ in r] for r in ranks] if trees is None else trees


def plan_lengths(
    lengths: np.ndarray | Sequence[int],
    config: PlanConfig,
    *,
    dp_size: int,
    loss_runs: LossRuns | None = None,
    image_runs: ImageRuns | None = None,
    prefixes: SharedPrefixes | None = None,
) -> BatchPlan:
    """Plan ``[dp_rank][micro_step]`` micro batches from token counts alone; see the module doc.

    Args:
        lengths: ``[n]`` token count of each sample (ints >= 1).
        config: the planner's options.
        dp_size: data-parallel ranks to balance over.
        loss_runs: each sample's loss runs (aligned with ``lengths``): the plan then counts the
            step's loss tokens (``plan.loss`` and four more metrics, see the module doc).
        image_runs: each sample's image placeholder runs (aligned with ``lengths``): a cut at
            ``seq_len`` that would split an image cuts before it, or drops the sample when
            nothing precedes the image (:mod:`rollfeed.collate.image_runs`).
        prefixes: each sample's claimed shared prefixes (aligned with ``lengths``): samples
            sharing one are packed as prefix trees where that saves at least
            ``config.tree_min_saving`` of their tokens (unless ``config.trees`` is False). A
            sample with images that claims one is a :class:`SharedPrefixError`.

    Returns:
        ``plan[r][k]``: positions into ``lengths`` of rank ``r``'s micro step ``k``, in packing
        order (the order :func:`place_micro_batch` takes them; ``()`` for a dummy), and
        ``plan.metrics``: samples, truncated, truncated_tokens, dropped (every sample left out),
        truncated_before_image, dropped_at_image, tokens, padding_tokens,
        padding_fraction, micro_steps, dummy_micro_batches, rank_cost_max, rank_cost_mean,
        rank_cost_max_over_mean, trees, tree_samples, shared_tokens_saved (``tokens`` counts
        the tokens the rows compute: each shared prefix once) (with ``loss_runs``:
        loss_tokens, samples_with_loss, samples_without_loss, micro_batches_without_loss,
        dummies included).
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise BatchConfigError(f"dp_size must be an int >= 1, got {dp_size!r}")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu"):
        raise SampleLengthError(
            f"lengths must be [n] integers, got {lengths.dtype} of shape {lengths.shape}"
        )
    lengths = lengths.astype(np.int64, copy=False)
    if lengths.size and lengths.min() < 1:
        at = int(np.argmin(lengths))
        raise SampleLengthError(f"a sample needs at least one token, got {lengths[at]}", sample=at)
    seq_len = config.seq_len
    over = lengths > seq_len
    if over.any() and config.overlong == "error":
        at = int(np.argmax(over))
        raise OverlongError(
            f"sample has {lengths[at]} tokens > seq_len={seq_len}; raise seq_len or pass "
            "overlong='truncate' or 'drop'",
            sample=at,
            pos=seq_len,
        )
    if image_runs is None:
        cuts = np.minimum(lengths, seq_len)
    else:
        _check_image_runs(image_runs, lengths)
        cuts = image_runs.cuts(lengths, seq_len)
    if config.overlong == "drop":
        cuts[over] = 0
    at_image = over & (cuts < seq_len) & (config.overlong == "truncate")
    keep = cuts > 0
    dropped = int((~keep).sum())
    truncated = int((over & keep).sum())
    truncated_tokens = int((lengths[over & keep] - cuts[over & keep]).sum())
    if prefixes is not None and config.trees:
        check_prefixes(prefixes, lengths, image_runs)
        units = plan_units(
            cuts, prefixes.chains, seq_len=seq_len, min_saving=config.tree_min_saving
        )
    else:
        units = [Unit(members=(i,), tree=None, tokens=int(cuts[i])) for i in np.flatnonzero(keep)]
    sizes = np.array([u.tokens for u in units], np.int64)
    slots = slot_lengths(sizes, config.cp_size, config.cp_layout)
    costs = sequence_cost(slots, config.quadratic_cost)
    for j, u in enumerate(units):
        if u.tree is not None:
            costs[j] = u.tree.cost(config.quadratic_cost) + float(slots[j] - sizes[j])
    pad = config.pad
    ranks: list[list[tuple[int, ...]]] = []
    trees: list[list[Trees]] = []
    rank_cost, total = [], 0
    # A tree row holds no images (the images' positions are flat-row ones): with both in the
    # step, samples with images are packed in micro batches of their own.
    imaged = np.zeros(len(units), bool)
    if image_runs is not None and any(u.tree is not None for u in units):
        imaged = np.array([u.tree is None and image_runs.counts[u.members[0]] > 0 for u in units])
    for part in partition_costs(costs, dp_size):
        bins = []
        for group in ([j for j in part if not imaged[j]], [j for j in part if imaged[j]]):
            bins += [[group[j] for j in b] for b in pack_ffd(slots[group], seq_len)]
        cost = [float(costs[b].sum()) for b in bins]
        order = sorted(range(len(bins)), key=lambda k: -cost[k])  # stable: ties keep packing order
        ranks.append([tuple(i for j in bins[k] for i in units[j].members) for k in order])
        trees.append([micro_batch_trees(units, bins[k]) for k in order])
        rank_cost.append(sum(cost[k] for k in order))
        total += sum(-(-int(slots[b].sum()) // pad) * pad for b in bins)
    steps = max(len(r) for r in ranks)
    dummies = sum(steps - len(r) for r in ranks)
    for r, t in zip(ranks, trees, strict=True):
        t += [()] * (steps - len(r))
        r += [()] * (steps - len(r))
    total += dummies * pad
    tokens = int(sizes.sum())
    top, mean = max(rank_cost), float(np.mean(rank_cost))
    shared = [u for u in units if u.tree is not None]
    metrics = {
        "samples": len(lengths),
        "truncated": truncated,
        "truncated_tokens": truncated_tokens,
        "dropped": dropped,
        "truncated_before_image": int((at_image & keep).sum()),
        "dropped_at_image": int((at_image & ~keep).sum()),
        "tokens": tokens,
        "padding_tokens": total - tokens,
        "padding_fraction": (total - tokens) / total if total else 0.0,
        "micro_steps": steps,
        "dummy_micro_batches": dummies,
        "rank_cost_max": top,
        "rank_cost_mean": mean,
        "rank_cost_max_over_mean": top / mean if mean else 1.0,
        "trees": len(shared),
        "tree_samples": sum(len(u.members) for u in shared),
        "shared_tokens_saved": int(cuts[keep].sum()) - tokens,
    }
    loss = None
    if loss_runs is not None:
        _check_runs(loss_runs, lengths)
        loss = StepLoss.of(loss_runs.label_tokens(cuts, seq_len), keep)
        empty = sum(not loss.per_sample[list(mb)].any() for r in ranks for mb in r)
        metrics["loss_tokens"] = loss.loss_tokens
        metrics["samples_with_loss"] = loss.samples_with_loss
        metrics["samples_without_loss"] = loss.samples - loss.samples_with_loss
        metrics["micro_batches_without_loss"] = empty
    if truncated or dropped:
        logger.debug("plan truncated %d and dropped %d samples", truncated, dropped)
    return BatchPlan(ranks, metrics, loss, trees)


def _check_image_runs(runs: ImageRuns, lengths: np.ndarray) -> None:
    """Image runs of these samples: one entry per sample, runs in token order inside it."""
    at = runs.misplaced(lengths) if len(runs) == len(lengths) else -1
    if at is not None:
        raise SampleLengthError(
            f"image_runs holds {len(runs)} samples for {len(lengths)} lengths, or the runs of "
            f"sample {at} are not ranges in token order inside it",
            sample=None if at < 0 else at,
            field="images",
        )


def _check_runs(runs: LossRuns, lengths: np.ndarray) -> None:
    """Loss runs that belong to these samples: one entry per sample, each run a non-empty range
    inside its sample, after the one before."""
    if len(runs) != len(lengths):
        raise SampleLengthError(
            f"loss_runs holds {len(runs)} samples, lengths {len(lengths)}; give one per sample"
        )
    at = runs.misplaced(lengths)
    if at is not None:
        raise SampleLengthError(
            f"loss runs of sample {at} are not ranges in token order, non-empty, inside its "
            f"{int(lengths[at])} tokens and apart: {runs.of(at).tolist()}",
            sample=at,
        )


def prepare_batch(
    samples: Sequence[Sample],
    config: PlanConfig,
    *,
    dp_size: int,
    prefixes: SharedPrefixes | None = None,
) -> BatchPlan:
    """Plan ``[dp_rank][micro_step]`` micro batches of ``samples``; see the module doc. No I/O.

    Args:
        samples: the batch; ``MicroBatch.indices`` are positions in this sequence.
        config: the planner's options.
        dp_size: data-parallel ranks to balance over.
        prefixes: the samples' claimed shared prefixes (e.g. ``SharedPrefixes.of_tokens`` of
            their tokens and groups), packed as trees as in :func:`plan_lengths`; the tokens are
            confirmed as each micro batch is placed.

    Returns:
        :func:`plan_lengths` of the samples' lengths and loss runs, each micro batch placed
        (:func:`place_micro_batch`) with its step counts; ``plan.metrics`` and ``plan.loss`` as
        there.
    """
    for i, sample in enumerate(samples):  # all of them, dropped ones too, in batch order
        sample.check_fields(config.fields, index=i)
    lengths = np.fromiter((len(s) for s in samples), np.int64, len(samples))
    images = ImageRuns.of_samples(samples) if any(s.images for s in samples) else None
    plan = plan_lengths(
        lengths,
        config,
        dp_size=dp_size,
        loss_runs=LossRuns.of_samples(samples),
        image_runs=images,
        prefixes=prefixes,
    )
    assert plan.loss is not None
    ranks = [
        [
            place_micro_batch(
                [samples[j] for j in mb],
                config,
                indices=mb,
                check_fields=False,
                step_counts=plan.loss.counts(mb),
                trees=trees,
            )
            for mb, trees in zip(rank, rank_trees, strict=True)
        ]
        for rank, rank_trees in zip(plan, plan.trees, strict=True)
    ]
    return BatchPlan(ranks, plan.metrics, plan.loss, plan.trees)

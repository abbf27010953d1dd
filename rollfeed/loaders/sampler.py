"""MicroBatchSampler: the ``batch_sampler`` yielding, per micro step, one micro batch's indices.

For each training step it plans the step from ``dataset.lengths(step)`` alone, with the loss
runs, image runs and claimed shared prefixes the step's index holds
(:func:`rollfeed.collate.plan_lengths`; the same plan on every rank) and yields this DP rank's
micro batches as lists of dataset indices **in packing order** — empty for a dummy micro batch of
a rank that came up short — each a :class:`~rollfeed.loaders.plan.Planned` carrying the config.
:class:`~rollfeed.loaders.collator.MicroBatchCollator` places the exact micro batch from the
samples in that order, after checking that its config is the sampler's.

One pass (``iter`` once) is one training step. An in-memory list is the same samples every step;
a step directory has one file per step: a pass covers the next step file present (a gap in the
numbering is skipped), or in stream mode exactly the next step's file. When that file is not there
yet, the pass waits for it (bounded by ``step_timeout_s`` and logged at INFO, then
:class:`~rollfeed.loaders.errors.StepTimeoutError` naming the directory and what is there:
:mod:`~rollfeed.loaders.step_wait`) before its first micro batch, in the caller's
``iter``/``next`` -- never inside a prefetch of the previous step's micro batches. A trainer ahead
of its rollouts waits or fails; it never trains on a quiet empty step.

Each planned micro batch carries the step file's version and its samples' planned lengths
(:class:`~rollfeed.loaders.plan.Planned`), which the dataset holds its reads to, and the step's
loss-token counts (:class:`~rollfeed.collate.StepCounts`, planned from ``dataset.loss_runs(step)``:
exact after truncation, the same on every rank, no collective), which the micro batch carries.
Under a staleness bound (``LoaderConfig.max_staleness``, :mod:`rollfeed.loaders.staleness`) the
step's samples are held to it from ``dataset.policy_versions(step)`` (the index's oldest version of
each) before planning: ``"drop"`` plans the others only, ``"error"`` raises
:class:`~rollfeed.loaders.staleness.StaleSampleError`; the plan's metrics count them
(``stale_samples``, ``stale_dropped``).
A step with samples truncated at ``seq_len`` is logged once, on one rank of the world (the one at
dp 0, cp 0, tp 0, pp 0; DEBUG on the others): a warning naming samples and tokens, and how to
make it an error; its plan's counts are :meth:`MicroBatchSampler.plan_metrics`.

Example (lengths ``[5, 3, 6, 2]``, ``seq_len=8``, ``dp_size=2``)::

    config = LoaderConfig(plan=PlanConfig(seq_len=8))
    list(MicroBatchSampler(ds, Topology(dp_rank=0, dp_size=2), config))
    -> [[2, 3]]

State (:mod:`rollfeed.loaders.state`) counts micro batches *yielded*, in the samples of the step
it counted in (their identity, held to the step when its pass starts: a rewritten step, or a count
at or past the step's plan, is a ``LoaderStateError`` or the ``on_reshard`` policy, never a pass of
nothing): the right count when the sampler runs in the trainer's loop. With workers the sampler
draws ahead of the trainer, so :class:`~rollfeed.loaders.RolloutLoader` sends each micro batch
with the sampler state right after it and saves the state of the last micro batch it handed out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from rollfeed.collate import BatchPlan, CollateError, Topology, plan_lengths
from rollfeed.loaders.config import LoaderConfig
from rollfeed.loaders.dataset import RolloutDataset
from rollfeed.loaders.errors import EmptyStepError, LoaderConfigError
from rollfeed.loaders.plan import Planned
from rollfeed.loaders.plan_fingerprint import plan_fingerprint
from rollfeed.loaders.staleness import stale_error, stale_samples
from rollfeed.loaders.state import SamplerState, continue_at, resume_point, step_gone
from rollfeed.loaders.step_identity import StepIdentity
from rollfeed.loaders.step_rows import StepRows
from rollfeed.loaders.step_version import StepVersion

logger = logging.getLogger(__name__)
# what on_reshard did as a pass started: its step started over, steps whose rest it went past
NO_FALLBACKS = {"reshard_restarted": 0, "reshard_skipped": 0}


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class _StepPlan:
    """One step's plan and what it was planned from: ``order [n]`` dataset indices and
    ``lengths [n]`` (shuffled alike, stale samples dropped), the step file's ``version``, its
    samples' ``identity`` and the staleness counts (``stale``: ``stale_samples``,
    ``stale_dropped``)."""

    step: int
    plan: BatchPlan
    order: np.ndarray
    lengths: np.ndarray
    version: StepVersion | None
    identity: StepIdentity
    stale: dict[str, int]


class MicroBatchSampler(Sampler[list[int]]):
    """Batch sampler over training steps; see the module doc.

    Args:
        dataset: the samples of each step.
        topology: this rank's place; ``(dp_rank, dp_size)`` selects its micro batches, and its
            ``cp_size`` is the plan's (``topology.bind(config.plan)``).
        config: the plan and the run's choices (seed, shuffle, stream, start step, reshard
            policy, step timeout), the collator's too; ``self.config`` holds it with the plan
            bound to the topology. ``step_timeout_s`` is also an attribute, read at each wait.
    """

    def __init__(self, dataset: RolloutDataset, topology: Topology, config: LoaderConfig) -> None:
        if not isinstance(config, LoaderConfig):
            raise LoaderConfigError(
                f"config must be a LoaderConfig, got {type(config).__name__}; wrap a plan as "
                "LoaderConfig(plan=PlanConfig(...))"
            )
        if config.stream and not dataset.streams:
            raise LoaderConfigError("stream=True needs a step directory (from_step_dir)")
        config = dataclasses.replace(config, plan=topology.bind(config.plan))
        self.dataset, self.topology, self.config = dataset, topology, config
        self.step_timeout_s = config.step_timeout_s
        self._fingerprint = plan_fingerprint(config)
        self._step = dataset.first_step() if config.start_step is None else config.start_step
        self._consumed = 0
        self._counted: StepIdentity | None = None  # the samples _consumed counts in, when > 0
        self._step_size: int | None = None  # micro steps of self._step once planned
        self._plan: _StepPlan | None = None
        self._warned: int | None = None  # the last step whose truncation was logged
        self._fallbacks: dict[int, dict[str, int]] = {}  # the last pass's step: on_reshard's doing
        self._loaded = dict(NO_FALLBACKS)  # on_reshard's doing as a state was loaded

    def plan(self, step: int) -> tuple[BatchPlan, np.ndarray]:
        """``(plan, order)``: ``plan[dp][k]`` positions into ``order``, the step's indices."""
        got = self._step_plan(step)
        return got.plan, got.order

    def _step_plan(self, step: int) -> _StepPlan:
        got = self._plan
        if got is None or got.step != step:
            rows = StepRows.read(self.dataset, step)
            version = self.dataset.step_version(step)
            identity = self.dataset.step_identity(step)
            if self.config.shuffle:
                rng = np.random.default_rng([self.config.seed, step])
                rows = rows.take(rng.permutation(len(rows.order)))
            stale = self._stale(step, rows.order, rows.versions)
            if stale["stale_dropped"]:
                fresh = ~stale_samples(rows.versions, step, self.config.max_staleness)
                rows = rows.take(np.flatnonzero(fresh))
            try:
                plan = plan_lengths(
                    rows.lengths,
                    self.config.plan,
                    dp_size=self.topology.dp_size,
                    loss_runs=rows.runs,
                    image_runs=rows.images,
                    prefixes=rows.prefixes,
                )
            except CollateError as err:  # an overlong sample, images claiming a prefix, ...
                raise self._placed(err, step, rows.order) from None
            got = self._plan = _StepPlan(
                step=step,
                plan=plan,
                order=rows.order,
                lengths=rows.lengths,
                version=version,
                identity=identity,
                stale=stale,
            )
            self._log_truncation(step, plan.metrics)
        return got

    def _placed(self, err: CollateError, step: int, order: np.ndarray) -> CollateError:
        """``err``, raised planning ``step`` (whose samples in plan order are ``order``), naming
        the sample by its number in the step rather than its place in the plan, and the step
        and its file: as places where the error family has them, else in the message.

        Example: an overlong sample at place 0 of a shuffled step 3, sample 5 of its file ->
        ``OverlongError("... (step 3, /run/steps/step_000003.rfs)", sample=5)``."""
        place = err.place
        if place.get("sample") is not None:
            place["sample"] = self.dataset.source.locate(int(order[place["sample"]]))[1]
        file = self.dataset.where(step)
        if {"file", "step"} <= set(err.PLACE):
            place.update({k: v for k, v in (("file", file), ("step", step)) if place[k] is None})
            return type(err)(err.message, **place)
        at = "" if file is None else f", {file}"
        return type(err)(f"{err.message} (step {step}{at})", **place)

    def _stale(self, step: int, order: np.ndarray, versions: np.ndarray) -> dict[str, int]:
        """The step's staleness counts under the config's bound; ``"error"`` raises for the
        first stale sample (in dataset order)."""
        policy = self.config.staleness
        if policy is None:
            return {"stale_samples": 0, "stale_dropped": 0}
        stale = stale_samples(versions, step, policy.max_staleness)
        if stale.any() and policy.on_stale == "error":
            at = np.flatnonzero(stale)
            first = at[np.argmin(order[at])]
            _, sample = self.dataset.source.locate(int(order[first]))
            bound, file = policy.max_staleness, self.dataset.where(step)
            raise stale_error(step, sample, int(versions[first]), bound, file)
        dropped = int(stale.sum()) if policy.on_stale == "drop" else 0
        return {"stale_samples": int(stale.sum()), "stale_dropped": dropped}

    def _log_truncation(self, step: int, metrics: Mapping[str, float]) -> None:
        """A truncation is never silent: one warning per step, on one rank of the world (every
        rank plans the same step; also counted in the metrics)."""
        if metrics["truncated"] and self._warned != step:
            self._warned = step
            topo = self.topology
            first = not (topo.dp_rank or topo.cp_rank or topo.tp_rank or topo.pp_rank)
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "step %d: %d of %d samples are longer than seq_len=%d and were truncated to it, "
                "%d tokens cut (overlong='truncate'); pass PlanConfig(overlong='error') to make "
                "this an error, or overlong='drop' to leave such samples out",
                step,
                metrics["truncated"],
                metrics["samples"],
                self.config.plan.seq_len,
                metrics["truncated_tokens"],
            )

    def step_micro_batches(self, step: int) -> list[Planned]:
        """This DP rank's micro batches of ``step`` as dataset indices (packing order), each
        with the step file's version and its samples' planned lengths."""
        got = self._step_plan(step)
        loss, out = got.plan.loss, []
        assert loss is not None  # planned with the dataset's loss runs
        rank = self.topology.dp_rank
        for mb, trees in zip(got.plan[rank], got.plan.trees[rank], strict=True):
            at = list(mb)
            lengths, plan, counts = got.lengths[at].tolist(), self.config.plan, loss.counts(at)
            indices = got.order[at].tolist()
            out.append(
                Planned(
                    indices,
                    plan,
                    version=got.version,
                    lengths=lengths,
                    counts=counts,
                    trees=trees,
                    step=step,
                    staleness=self.config.staleness,
                )
            )
        return out

    def plan_metrics(self, step: int) -> dict[str, float]:
        """``plan_lengths``'s metrics of ``step``, its staleness counts, and what ``on_reshard``
        did as the pass over it started (the whole step, the same on every rank)."""
        got = self._step_plan(step)
        return {**got.plan.metrics, **got.stale, **self._fallbacks.get(step, NO_FALLBACKS)}

    def _normalize(self) -> None:
        if self._consumed and self._consumed == self._step_size:  # finished: resume at the next
            self._step, self._consumed, self._step_size = self._step + 1, 0, None

    @property
    def step(self) -> int:
        """The step the next micro batch comes from (before waiting or skipping gaps)."""
        self._normalize()
        return self._step

    def warm(self) -> None:
        """Plan the next step now if its data is there (no waiting): forked workers then inherit
        its index (or, for a step file without one, its parsed samples) instead of each reading
        it again."""
        self._normalize()
        if self._step in self.dataset.steps_from(self._step)[:1]:
            self.plan(self._step)

    def _pass_step(self, step: int) -> int:
        """The step a pass from ``step`` covers, waiting (bounded, logged) for its file; see the
        module doc."""
        exact = self.config.stream
        return self.dataset.wait_for_step(step, timeout_s=self.step_timeout_s, exact=exact)

    def _resume(
        self, step: int, consumed: int, counted: StepIdentity | None, *, log: bool
    ) -> tuple[int, int, list[Planned], dict[str, int]]:
        """``(step, start, micro batches, fallbacks)`` of the pass from ``(step, consumed)``,
        ``consumed`` counted in the samples ``counted``: waits for the step's file, skips a gap,
        and holds the count to the step's samples and plan
        (:func:`~rollfeed.loaders.state.continue_at`, ``log``: whether its policy warns);
        ``fallbacks``: what ``on_reshard`` did (``reshard_restarted``: the step started over,
        ``reshard_skipped``: steps whose rest was gone past)."""
        fallbacks = dict(NO_FALLBACKS)
        while True:
            found = self._pass_step(step)
            if found != step:  # a gap in the step files: nothing of the missing steps was seen
                if consumed:
                    step_gone(step, consumed, found, on_reshard=self.config.on_reshard, log=log)
                    fallbacks["reshard_skipped"] += 1
                step, consumed, counted = found, 0, None
            micro = self.step_micro_batches(step)
            identity, on_reshard = self._step_plan(step).identity, self.config.on_reshard
            start = continue_at(
                step, consumed, counted, identity, len(micro), on_reshard=on_reshard, log=log
            )
            if start is not None:
                fallbacks["reshard_restarted"] = int(consumed > 0 and start == 0)
                return step, start, micro, fallbacks
            fallbacks["reshard_skipped"] += 1
            step, consumed, counted = step + 1, 0, None

    def __iter__(self) -> Iterator[list[int]]:
        """One pass = one training step (see module doc)."""
        return _Pass(self, self._micro_batches())

    def _micro_batches(self) -> Iterator[list[int]]:
        self._normalize()
        step, start, micro, fallbacks = self._resume(
            self._step, self._consumed, self._counted, log=True
        )
        self._fallbacks = {step: {k: n + self._loaded[k] for k, n in fallbacks.items()}}
        self._loaded = dict(NO_FALLBACKS)
        self._step, self._consumed = step, start
        self._counted = self._step_plan(step).identity
        self._step_size = len(micro)
        for k in range(self._consumed, len(micro)):
            self._consumed = k + 1
            yield micro[k]
        self._normalize()
        if not micro:  # counted as done, so a caller that catches the error goes on at the next
            self._step, self._consumed, self._step_size = step + 1, 0, None
            raise self._empty_step_error(step)
        logger.debug("step %d done (%d micro batches)", step, len(micro))

    def _empty_step_error(self, step: int) -> EmptyStepError:
        samples = len(self.plan(step)[1])
        metrics = self.plan_metrics(step)
        at_image, stale = metrics["dropped_at_image"], metrics["stale_dropped"]
        why = (
            f"all {stale} samples lag the step by more than max_staleness="
            f"{self.config.max_staleness} and were dropped (on_stale='drop')"
            if stale and samples == 0
            else "its step file holds no samples"
            if samples == 0
            else f"all {samples} samples were dropped as longer than "
            f"seq_len={self.config.plan.seq_len} "
            + (
                f"({at_image} of them because nothing precedes the image a cut would split; "
                "raise seq_len)"
                if at_image
                else "(overlong='drop'; use 'truncate' to keep them)"
            )
        )
        return EmptyStepError(
            f"step {step} has no micro batch to train on: {why}", file=self.dataset.where(step)
        )

    def __len__(self) -> int:
        """Micro batches left in this pass (once the step file is there: may wait for it)."""
        return self.pass_length()

    def pass_length(self, state: Mapping[str, Any] | None = None) -> int:
        """Micro batches a pass from ``state`` (default: this sampler's) yields: waits (bounded)
        for the step file, skips a gap and holds the count to the step, as the pass would."""
        if state is None:
            state = self.state_dict()
        counted = StepIdentity.from_dict(state["data"])
        _, start, micro, _ = self._resume(state["step"], state["micro_batches"], counted, log=False)
        return len(micro) - start

    def state_dict(self) -> dict[str, Any]:
        self._normalize()
        return SamplerState(
            step=self._step,
            micro_batches=self._consumed,
            seed=self.config.seed,
            dp_size=self.topology.dp_size,
            cp_size=self.topology.cp_size,
            plan=self._fingerprint,
            data=self._counted if self._consumed else None,
        ).to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = SamplerState.from_dict(state)
        self._step, self._consumed, self._counted = resume_point(
            saved,
            seed=self.config.seed,
            dp_size=self.topology.dp_size,
            cp_size=self.topology.cp_size,
            plan=self._fingerprint,
            on_reshard=self.config.on_reshard,
        )
        self._step_size = None
        fell_back = saved.micro_batches and not self._consumed  # another world shape or plan
        self._loaded = {
            "reshard_restarted": int(fell_back and self._step == saved.step),
            "reshard_skipped": int(fell_back and self._step != saved.step),
        }


class _Pass(Iterator[list[int]]):
    """One pass, whose state says whether it handed out its step's last micro batch: restored
    from that state it yields nothing, and the next pass is the next step. torchdata's
    ``StatefulDataLoader`` saves it beside the sampler's and, restoring a pass that had ended,
    draws its workers' prefetch from the restored pass before it starts the next: a pass of the
    next step there would lose those micro batches (torchdata's own samplers end an epoch so)."""

    def __init__(self, sampler: MicroBatchSampler, micro_batches: Iterator[list[int]]) -> None:
        self._sampler, self._micro_batches, self._ended = sampler, micro_batches, False

    def __next__(self) -> list[int]:
        got = next(self._micro_batches)
        self._ended = self._sampler._consumed == self._sampler._step_size
        return got

    def state_dict(self) -> dict[str, bool]:
        return {"ended": self._ended}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("ended"):
            self._micro_batches, self._ended = iter(()), True

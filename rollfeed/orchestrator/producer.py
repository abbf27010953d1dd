"""The producer: prompts in, rollouts from a capture server, step files out, under a durable cursor.

:class:`Producer` samples ``group_size`` rollouts of every prompt through a
:class:`~rollfeed.orchestrator.CaptureClient` (requests from a thread pool), scores each finished
rollout with the reward function, and writes step ``k`` (the prompts
:func:`~rollfeed.orchestrator.groups.step_prompts` gives it; advantages normalised within each
prompt's group) as soon as its rollouts are all finished, steps in order. It never runs more than
``max_ahead`` steps ahead of the trainer: step ``k`` is begun only once the trainer's progress file
(:mod:`~rollfeed.orchestrator.progress`) says ``step >= k - max_ahead``; until the trainer has
finished a step, ``step`` counts as 0.

**Durable.** Every event goes to the cursor (:class:`~rollfeed.orchestrator.cursor.RolloutCursor`)
before the producer acts on it: the step's prompts, each turn sent, each answer, each finished
rollout with its reward, each step file written. A producer started again on the same step
directory (after a crash, SIGKILL included) replays the cursor: written steps stay written,
finished rollouts are not sampled again, a rollout continues from its recorded turns, and the turns
in flight at the crash are sent again (``metrics["resent"]``); a step file put but not recorded is
adopted (:func:`~rollfeed.orchestrator.step_output.put_step`). Nothing recorded is lost, nothing
finished is repeated.

**A server that dies.** A turn whose request got no answer (the server died or was unreachable)
or an HTTP 5xx is held; no request is sent until the server answers its info route again, then
``sync`` runs (so a restarted server loads the trainer's weights before it samples) and the held
turns are sent again (``metrics["retried"]``). A server down for longer than ``server_wait_s``
raises its last error. Any other refusal (HTTP 4xx: a bad request) stops the producer.

**Multi-turn.** ``next_turn(prompt, rollout)`` gives the tokens a rollout adds for its next turn
(tool output, a user message), or ``None`` when it is finished; by default every rollout is one
turn. ``reward(prompt, rollout)`` scores a finished one; it is recorded, never computed twice.

``sync(progress)`` runs before the first request, whenever the trainer's progress changes, before
each step is begun and after a server outage: the place to make the server load the weights the
progress names (``None``: the trainer has finished no step).

Example::

    producer = Producer(CaptureClient(url), "/run/steps", prompts, reward=my_reward,
                        config=ProducerConfig(group_size=4, prompts_per_step=8,
                                              sampling={"top_k": 20, "max_tokens": 256}))
    producer.run()   # -> metrics; step_000000.rfs, step_000001.rfs, ... as the trainer advances
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from rollfeed.capture.errors import CaptureServerError
from rollfeed.capture.protocol import GenerateResponse
from rollfeed.orchestrator.client import CaptureClient, Rollout
from rollfeed.orchestrator.cursor import RolloutCursor
from rollfeed.orchestrator.cursor_events import (
    RolloutDone,
    StepBegun,
    StepWritten,
    TurnDone,
    TurnSent,
)
from rollfeed.orchestrator.errors import OrchestratorError
from rollfeed.orchestrator.groups import Prompt, check_prompts, step_count, step_prompts
from rollfeed.orchestrator.producer_checks import check_resume
from rollfeed.orchestrator.producer_config import ProducerConfig, turn_seed
from rollfeed.orchestrator.progress import TrainerProgress, read_progress
from rollfeed.orchestrator.step_output import put_step, rebuild, step_samples

logger = logging.getLogger(__name__)
Key = tuple[int, str, int]  # (step, prompt id, sample)


class Producer:
    """Samples, records and writes steps (see the module doc)."""

    def __init__(
        self,
        client: CaptureClient,
        directory: str | os.PathLike[str],
        prompts: Sequence[Prompt],
        *,
        reward: Callable[[Prompt, Rollout], float],
        config: ProducerConfig,
        next_turn: Callable[[Prompt, Rollout], Sequence[int] | None] | None = None,
        sync: Callable[[TrainerProgress | None], None] | None = None,
        store: Mapping[str, object] | None = None,
    ) -> None:
        check_prompts(prompts)
        self.client, self.directory, self.store = client, directory, store
        self.prompts, self.by_id = list(prompts), {p.id: p for p in prompts}
        self.reward, self.config, self.next_turn = reward, config, next_turn
        self.sync = sync or (lambda progress: None)
        self.total = config.steps
        if self.total is None:
            self.total = step_count(len(prompts), config.prompts_per_step)
        elif self.total * config.prompts_per_step > len(prompts):
            raise OrchestratorError(
                f"{self.total} steps of {config.prompts_per_step} prompts need "
                f"{self.total * config.prompts_per_step} prompts, {len(prompts)} were given"
            )
        self.metrics = dict.fromkeys(
            ("steps_written", "steps_adopted", "rollouts", "turns", "resent", "retried"), 0
        )
        self.metrics |= {"outages": 0, "torn_bytes": 0, "wait_trainer_s": 0.0}
        self._live: dict[Key, Rollout] = {}
        self._pending: dict[Future, tuple[Key, list[int]]] = {}
        self._held: list[tuple[Key, list[int]]] = []
        self._down_since: float | None = None

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """Produce every step; the metrics (see the module doc)."""
        with (
            RolloutCursor(self.directory, store=self.store, fsync=self.config.fsync) as cursor,
            ThreadPoolExecutor(self.config.concurrency) as pool,
        ):
            self._cursor, self._pool = cursor, pool
            check_resume(cursor.state, self.prompts, self.config, self.directory, self.store)
            self.metrics["resent"] = cursor.metrics["in_flight"]
            self.metrics["torn_bytes"] = cursor.metrics["torn_bytes"]
            progress = read_progress(self.directory, store=self.store)
            self._sync(progress)
            for k, step in sorted(cursor.state.steps.items()):
                for (p, s), r in step.rollouts.items():
                    if step.written is None and not r.finished:
                        self._live[(k, p, s)] = rebuild(r)
                        self._advance((k, p, s))
            while not self._done():
                seen = read_progress(self.directory, store=self.store)
                if seen != progress:
                    progress = seen
                    if self._down_since is None:
                        self._sync(progress)
                self._begin_steps(progress)
                self._write_finished()
                if self._done():
                    break
                self._settle(progress)
        return self.metrics

    def _done(self) -> bool:
        steps = self._cursor.state.steps
        return len(steps) == self.total and all(s.written is not None for s in steps.values())

    def _begin_steps(self, progress: TrainerProgress | None) -> None:
        consumed = 0 if progress is None else progress.step
        begun = len(self._cursor.state.steps)
        while begun < self.total and begun <= consumed + self.config.max_ahead:
            if self._down_since is None:
                self._sync(progress)
            prompts = step_prompts(self.prompts, begun, self.config.prompts_per_step)
            self._cursor.record(
                StepBegun(
                    step=begun, prompts=[p.id for p in prompts], group_size=self.config.group_size
                )
            )
            for p in prompts:
                for s in range(self.config.group_size):
                    self._live[(begun, p.id, s)] = Rollout()
                    self._advance((begun, p.id, s))
            begun += 1

    def _write_finished(self) -> None:
        state = self._cursor.state
        for k in sorted(state.steps):
            step = state.steps[k]
            if step.written is not None:
                continue
            if not step.finished:
                return  # steps go out in order
            samples = step_samples(step, {p: len(self.by_id[p].token_ids) for p in step.prompts})
            adopted = put_step(
                self.directory,
                k,
                samples,
                store=self.store,
                vocab_size=self.config.vocab_size,
                fsync=self.config.fsync,
            )
            self._cursor.record(StepWritten(step=k, samples=len(samples)))
            self.metrics["steps_adopted" if adopted else "steps_written"] += 1
            for key in [key for key in self._live if key[0] == k]:
                del self._live[key]
            logger.info(
                "step %d %s: %d samples", k, "adopted" if adopted else "written", len(samples)
            )

    # -- rollouts ---------------------------------------------------------------------------

    def _advance(self, key: Key) -> None:
        """Send the rollout's next turn, or finish it (reward recorded)."""
        step, pid, sample = key
        prompt, rollout = self.by_id[pid], self._live[key]
        turn = len(rollout.turns)
        new = list(prompt.token_ids) if turn == 0 else None
        if turn and self.next_turn is not None:
            more = self.next_turn(prompt, rollout)
            new = None if more is None else [int(t) for t in more]
        if new is None:
            reward = float(self.reward(prompt, rollout))
            self._cursor.record(RolloutDone(step=step, prompt=pid, sample=sample, reward=reward))
            self.metrics["rollouts"] += 1
            return
        state = self._cursor.state.steps[step].rollouts[(pid, sample)]
        if state.sent <= turn:  # a turn in flight at a crash was recorded as sent already
            self._cursor.record(TurnSent(step=step, prompt=pid, sample=sample, turn=turn))
        self._send(key, new)

    def _send(self, key: Key, new: list[int]) -> None:
        if self._down_since is not None:
            self._held.append((key, new))
            return
        step, pid, sample = key
        rollout = self._live[key]
        sampling = dict(self.config.sampling)
        if "seed" in sampling:
            sampling["seed"] = turn_seed(int(sampling["seed"]), pid, sample, len(rollout.turns))
        future = self._pool.submit(
            self.client.generate,
            [*rollout.token_ids, *new],
            group=f"{self.config.group_prefix}step_{step:06d}",
            sampling=sampling,
            prompt_start=len(rollout.token_ids),
            policy=self.config.policy,
        )
        self._pending[future] = (key, new)
        self.metrics["turns"] += 1

    def _settle(self, progress: TrainerProgress | None) -> None:
        """Wait a little for answers; record them; bring a server back that went away."""
        if self._down_since is not None and not self._pending:
            self._probe(progress)
            return
        if not self._pending:
            t0 = time.monotonic()
            time.sleep(self.config.poll_s)  # waiting for the trainer, nothing in flight
            self.metrics["wait_trainer_s"] += time.monotonic() - t0
            return
        done, _ = wait(self._pending, timeout=self.config.poll_s, return_when=FIRST_COMPLETED)
        for future in done:
            key, new = self._pending.pop(future)
            try:
                response = future.result()
            except CaptureServerError as err:
                self._lost(err)
                self._held.append((key, new))
                continue
            self._answered(key, new, response)

    def _answered(self, key: Key, new: list[int], response: GenerateResponse) -> None:
        step, pid, sample = key
        rollout = self._live[key]
        turn = len(rollout.turns)
        rollout.add(new, response)  # checks the answer before it is recorded
        self._cursor.record(
            TurnDone(
                step=step, prompt=pid, sample=sample, turn=turn, new_ids=new, response=response
            )
        )
        self._advance(key)

    def _lost(self, err: CaptureServerError) -> None:
        """The server gave no answer (or a 5xx): hold every turn until it answers again; any
        other refusal stops the producer."""
        if err.status is not None and err.status < 500:
            raise err
        if self._down_since is None:
            logger.warning("capture server lost (%s); holding its turns", err.message)
            self._down_since = time.monotonic()
            self.metrics["outages"] += 1

    def _sync(self, progress: TrainerProgress | None) -> bool:
        """Run ``sync``; False when the server went away meanwhile (an outage begins)."""
        try:
            self.sync(progress)
        except CaptureServerError as err:
            self._lost(err)
            return False
        return True

    def _probe(self, progress: TrainerProgress | None) -> None:
        """Is the server back? Then ``sync`` it and send the held turns again."""
        try:
            self.client.info()
            self.sync(progress)
        except CaptureServerError as err:
            if err.status is not None and err.status < 500:
                raise
            assert self._down_since is not None
            if time.monotonic() - self._down_since > self.config.server_wait_s:
                raise CaptureServerError(
                    f"the capture server did not come back within server_wait_s="
                    f"{self.config.server_wait_s}; its turns are recorded as sent and are sent "
                    f"again when the producer starts again: {err.message}",
                    status=err.status,
                ) from None
            time.sleep(self.config.poll_s)
            return
        self._down_since = None
        logger.info("capture server back; sending %d held turns again", len(self._held))
        held, self._held = self._held, []
        self.metrics["retried"] += len(held)
        for key, new in held:
            self._send(key, new)

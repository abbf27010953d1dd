"""Attack family ``loader_states`` of the adversary harness (:mod:`tests.payload.adversary`): loader
states that cannot be resumed exactly.

A run of two steps (:data:`SIZES` inline samples) is the oracle: a fresh sampler's passes, as
index lists. Each case loads one state into a fresh sampler (or a loader without workers) and
runs the passes left (at most :data:`MAX_PASSES`):

- every state the sampler saves (after each micro batch of both steps), through JSON: must resume
  with exactly the rest of the run (a refusal is a failure);
- crafted states: consumed counts at and past the step's plan, ``2**62``, negative, a bool, a
  float, a string; bad steps, seeds, world sizes, versions, plans and sample identities; not a
  dict at all: must be refused with a typed error (yielding anything, a pass of nothing included,
  is ``wrong``);
- the step file rewritten between save and resume (fewer samples, more, the same record sizes
  with other tokens, other samples, the same samples again, removed; or only the next step
  rewritten),
  under each ``on_reshard``: the typed error, or exactly the policy's stream (``restart_step``:
  the new step from its start, then the next; ``next_step``: the next step), or -- the same
  samples again, the next step rewritten -- exactly the rest of the saved run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from tests.payload.adversary_tally import Tally, Wrong

SIZES = (13, 7)  # samples of steps 0 and 1
SEQ, MAX_LEN = 32, 30
MAX_PASSES = 4


def steps_dir(directory: Path, steps: list) -> Path:
    """``directory`` holding one step file per list of samples, from step 0."""
    from rollfeed.loaders.step_files import write_step_file

    for step, samples in enumerate(steps):
        write_step_file(directory, step, samples)
    return directory


def make_sampler(directory: Path, **config):
    from rollfeed.collate import PlanConfig
    from rollfeed.loaders import LoaderConfig, MicroBatchSampler, RolloutDataset, Topology

    config = LoaderConfig(plan=PlanConfig(seq_len=SEQ), step_timeout_s=0.2, **config)
    return MicroBatchSampler(RolloutDataset.from_step_dir(directory), Topology(), config)


def make_loader(directory: Path, **config):
    from rollfeed.collate import PlanConfig
    from rollfeed.loaders import LoaderConfig, RolloutDataset, Topology, build_dataloader

    config = LoaderConfig(plan=PlanConfig(seq_len=SEQ), step_timeout_s=0.2, **config)
    return build_dataloader(RolloutDataset.from_step_dir(directory), Topology(), config, root=None)


def run(obj, last_step: int) -> list:
    """The rest of the run from ``obj``'s state: passes while its step is at most ``last_step``
    (at most MAX_PASSES: a state stuck on a step shows as a stream that is not the oracle's)."""
    out = []
    for _ in range(MAX_PASSES):
        if obj.state_dict()["step"] > last_step:
            break
        for mb in obj:
            out.append(mb.input_ids.tolist() if hasattr(mb, "input_ids") else list(mb))
    return out


def saved_states(directory: Path) -> list[dict]:
    """Every state a sampler saves over the run, through JSON (the first: before any)."""
    sampler = make_sampler(directory)
    states = [json.loads(json.dumps(sampler.state_dict()))]
    for _ in SIZES:
        for _ in sampler:
            states.append(json.loads(json.dumps(sampler.state_dict())))
    return states


def crafted(state: dict, planned: int, other: dict) -> list[tuple[str, object]]:
    """``(what, state)``: states no loader saves, from ``state`` (mid step 0, ``planned`` micro
    batches in its plan; ``other``: the identity of step 1's samples)."""
    out: list[tuple[str, object]] = []
    for k in (planned, planned + 1, planned + 5, 2**31, 2**62 - 1, 2**62, 2**63, 2**64, -1):
        out.append((f"micro_batches={k}", {**state, "micro_batches": k}))
    for v in (True, 1.5, "2", None, [2]):
        out.append((f"micro_batches={v!r}", {**state, "micro_batches": v}))
    for v in (-1, 5, 2**31, 2**62, 1.0, "0", None, True):
        out.append((f"step={v!r}", {**state, "step": v}))
    for v in (-1, 2**63, "0", 0.0, 3):
        out.append((f"seed={v!r}", {**state, "seed": v}))
    for key in ("dp_size", "cp_size"):
        for v in (0, -1, 2, "1"):
            out.append((f"{key}={v!r}", {**state, key: v}))
    for v in (1, 4, "3", None, 3.0, True):
        out.append((f"version={v!r}", {**state, "version": v}))
    v2 = {k: v for k, v in state.items() if k != "data"} | {"version": 2}
    out.append(("version 2 mid-step (no record of its samples)", v2))
    data = state["data"]
    for what, value in [
        ("None mid-step", None),
        ("no samples mid-step", {"samples": 0, "tokens": 0, "digest": ""}),
        ("no digest, some samples", {**data, "digest": ""}),
        ("a list", [data["samples"], data["tokens"], data["digest"]]),
        ("digest of 31 digits", {**data, "digest": data["digest"][:31]}),
        ("digest upper case", {**data, "digest": data["digest"].upper()}),
        ("digest not hex", {**data, "digest": "z" * 32}),
        ("samples -1", {**data, "samples": -1}),
        ("tokens a string", {**data, "tokens": str(data["tokens"])}),
        ("an extra key", {**data, "file": "step_000000.rfs"}),
        ("one sample fewer, the same digest", {**data, "samples": data["samples"] - 1}),
        ("another digest", {**data, "digest": "0" * 32}),
        ("step 1's samples", other),
    ]:
        out.append((f"data {what}", {**state, "data": value}))
    out.append(("data at a step boundary", {**state, "micro_batches": 0}))
    out.append(("step 1 counted in step 0's samples", {**state, "step": 1}))
    plan = state["plan"]
    for what, value in [
        ("missing seq_len", {k: v for k, v in plan.items() if k != "seq_len"}),
        ("an extra option", {**plan, "width": 8}),
        ("seq_len 64", {**plan, "seq_len": 64}),
        ("seq_len a string", {**plan, "seq_len": str(SEQ)}),
        ("a list", list(plan)),
    ]:
        out.append((f"plan {what}", {**state, "plan": value}))
    out += [("a list", [state]), ("None", None), ("a string", "state"), ("empty", {})]
    out.append(("an extra key", {**state, "epoch": 0}))
    out.append(("no plan", {k: v for k, v in state.items() if k != "plan"}))
    return out


def rewrites(spare: list, same_sizes) -> list[tuple[str, object]]:
    """``(what, samples of step 0 now)``: ``None`` removes its file; a callable maps the saved
    samples."""
    return [
        ("fewer samples", lambda s: s[:4]),
        ("more samples", lambda s: s + spare[:5]),
        ("same record sizes, other tokens", same_sizes),
        ("other samples", lambda s: spare[: len(s)]),
        ("the same samples again", lambda s: s),
        ("the step file removed", None),
    ]


def family_loader_states(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """See the module doc."""
    from tests.collate.gen import inline_batch
    from tests.loaders.step_attacks import same_sizes_other_tokens

    samples = inline_batch(rng, sum(SIZES) * 3, MAX_LEN)
    run_steps = [samples[: SIZES[0]], samples[SIZES[0] : sum(SIZES)]]
    spare = samples[sum(SIZES) :]
    base = steps_dir(workdir / "base", run_steps)
    full = run(make_sampler(base), 1)
    first = len(run(make_sampler(base), 0))  # micro batches of step 0
    states = saved_states(base)
    if len(states) != len(full) + 1 or first < 3:
        raise AssertionError(f"the oracle run is too short: {first} of {len(full)}")

    def exact(state, want, make=make_sampler, directory=base):
        def attack():
            obj = make(directory)
            obj.load_state_dict(state)
            got = run(obj, 1)
            if got != want:
                raise Wrong(f"{len(got)} micro batches, not the {len(want)} of the oracle")

        return attack

    def refused(state, make=make_sampler, directory=base):
        def attack():
            obj = make(directory)
            obj.load_state_dict(state)
            got = list(obj) + run(obj, 1)  # one pass at least, wherever the state points
            raise Wrong(f"accepted: yielded {len(got)} micro batches")

        return attack

    for k, state in enumerate(states):
        tally.case(f"loader_states: saved after {k}", exact(state, full[k:]), refusal_ok=False)
    loaded = run(make_loader(base), 1)  # the loader's micro batches, by token ids
    for k in (1, 2, first, len(full)):
        attack = exact(states[k], loaded[k:], make=make_loader)
        tally.case(f"loader_states: loader, saved after {k}", attack, refusal_ok=False)
    v2 = {k: v for k, v in states[first].items() if k != "data"} | {"version": 2}
    attack = exact(v2, full[first:])
    tally.case("loader_states: version 2 at a step boundary", attack, refusal_ok=False)
    other = make_sampler(base).dataset.step_identity(1)
    for what, state in crafted(states[2], first, other.to_dict()):
        tally.case(f"loader_states: crafted {what}", refused(state))
        if what.startswith("micro_batches=") and what[-1].isdigit():
            tally.case(f"loader_states: loader, crafted {what}", refused(state, make_loader))

    case = 0
    for what, change in rewrites(spare, same_sizes_other_tokens):
        for k in (1, 2):
            for policy in ("error", "restart_step", "next_step"):
                case += 1
                directory = workdir / f"r{case}"
                shutil.copytree(base, directory)
                path = directory / "step_000000.rfs"
                if change is None:
                    path.unlink()
                else:
                    steps_dir(directory, [change(run_steps[0])])
                fresh = run(make_sampler(directory), 1)  # the rewritten run from its start
                want = {
                    "error": None,
                    "restart_step": fresh,
                    "next_step": fresh[-(len(full) - first) :],
                }[policy]
                if what == "the same samples again":
                    want = full[k:]
                make = lambda d, p=policy: make_sampler(d, on_reshard=p)  # noqa: E731
                attack = refused(states[k], make, directory) if want is None else None
                attack = attack or exact(states[k], want, make, directory)
                tally.case(
                    f"loader_states: step 0 rewritten ({what}) after {k}; on_reshard={policy}",
                    attack,
                    refusal_ok=want is None,
                )
        if change is None:
            continue
        case += 1
        directory = workdir / f"r{case}"
        shutil.copytree(base, directory)
        steps_dir(directory, [run_steps[0], change(run_steps[1])])
        want = full[2:first] + run(make_sampler(directory, start_step=1), 1)
        tally.case(
            f"loader_states: step 1 rewritten ({what}) while step 0 was interrupted",
            exact(states[2], want, directory=directory),
            refusal_ok=False,
        )

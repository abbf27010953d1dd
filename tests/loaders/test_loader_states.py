"""A loader state is held to what it counted: a consumed count at or past the step's plan is refused
(never a pass of nothing), a step file rewritten between save and resume is a LoaderStateError
naming the step and what differs (or the on_reshard policy, logged), the same samples written again
or a copied run resume exactly, and a version 2 state is migrated or refused with the way out;
and the attack family ``loader_states`` (:mod:`tests.loaders.state_attacks`) finds nothing
else."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from rollfeed.loaders import LoaderStateError
from tests.collate.gen import inline_batch
from tests.loaders.state_attacks import (
    MAX_LEN,
    SIZES,
    make_loader,
    make_sampler,
    run,
    saved_states,
    steps_dir,
)
from tests.loaders.step_attacks import same_sizes_other_tokens
from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES


@pytest.fixture
def two_steps(tmp_path):
    """Steps 0 and 1 (13 and 7 inline samples), spare samples, the run's stream and states."""
    samples = inline_batch(np.random.default_rng(21), sum(SIZES) * 2, MAX_LEN)
    steps = [samples[: SIZES[0]], samples[SIZES[0] : sum(SIZES)]]
    directory = steps_dir(tmp_path / "steps", steps)
    first = len(run(make_sampler(directory), 0))
    assert first >= 3
    return directory, steps, samples[sum(SIZES) :], run(make_sampler(directory), 1), first


@pytest.mark.parametrize("make", [make_sampler, make_loader], ids=["sampler", "loader"])
def test_count_at_or_past_the_plan_is_refused_not_a_pass_of_nothing(two_steps, make):
    directory, _, _, _, first = two_steps
    mid = saved_states(directory)[2]
    for count in (first, first + 5, 2**62 - 1):
        obj = make(directory)
        obj.load_state_dict({**mid, "micro_batches": count})
        with pytest.raises(LoaderStateError, match=rf"{count} micro batches of step 0") as err:
            len(obj)  # the length of the pass, never negative
        assert f"plan of the step has {first}" in str(err.value) and err.value.step == 0
        with pytest.raises(LoaderStateError, match="step 0"):
            list(obj)
    with pytest.raises(LoaderStateError, match=r"micro_batches=4611686018427387904"):
        make(directory).load_state_dict({**mid, "micro_batches": 2**62})


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda s, spare: s[:4],
        lambda s, spare: s + spare[:3],
        lambda s, spare: same_sizes_other_tokens(s),
        lambda s, spare: spare[: len(s)],
    ],
    ids=["fewer", "more", "same-sizes-other-tokens", "other-samples"],
)
def test_state_of_a_rewritten_step_is_refused_naming_what_differs(two_steps, rewrite):
    directory, steps, spare, _, _ = two_steps
    state = saved_states(directory)[2]
    new = rewrite(steps[0], spare)
    steps_dir(directory, [new])
    resumed = make_sampler(directory)
    resumed.load_state_dict(state)
    with pytest.raises(LoaderStateError) as err:
        list(resumed)
    assert err.value.step == 0
    message = str(err.value)
    assert f"{SIZES[0]} samples" in message and f"-> {len(new)} samples" in message
    assert "rewritten after the state was saved" in message and "on_reshard" in message


def test_rewritten_step_under_a_policy_restarts_it_or_skips_its_rest(two_steps, caplog):
    directory, steps, _, _, _ = two_steps
    state = saved_states(directory)[2]
    steps_dir(directory, [steps[0][:5]])
    fresh = run(make_sampler(directory), 1)  # the rewritten run from its start
    rest = len(fresh) - len(run(make_sampler(directory), 0))
    with caplog.at_level(logging.WARNING, logger="rollfeed.loaders.state"):
        for policy, want in (("restart_step", fresh), ("next_step", fresh[-rest:])):
            resumed = make_sampler(directory, on_reshard=policy)
            resumed.load_state_dict(state)
            assert run(resumed, 1) == want, policy
            again = make_sampler(directory, on_reshard=policy)  # counted in its pass's metrics
            again.load_state_dict(state)
            list(again)
            step, counts = (0, (1, 0)) if policy == "restart_step" else (1, (0, 1))
            got = again.plan_metrics(step)
            assert (got["reshard_restarted"], got["reshard_skipped"]) == counts, policy
    said = [r.getMessage() for r in caplog.records]
    assert any("restarting it" in m and "step 0" in m for m in said), said
    assert any("skipping its rest" in m for m in said), said


def test_same_samples_again_or_a_copied_run_resume_exactly(two_steps, tmp_path):
    """The identity is the content, not the inode: a step written again with the same samples, and
    a run directory copied elsewhere, resume with exactly the rest of the run."""
    directory, steps, _, full, _ = two_steps
    states = saved_states(directory)
    copy = shutil.copytree(directory, tmp_path / "copied")
    steps_dir(directory, [steps[0]])  # a new inode and modification time, the same samples
    for where in (directory, copy):
        for k in (1, 2, len(full) - 1):
            resumed = make_sampler(where)
            resumed.load_state_dict(states[k])
            assert run(resumed, 1) == full[k:], (where, k)


def test_mid_step_state_whose_step_file_is_gone(two_steps):
    directory, _, _, full, first = two_steps
    state = saved_states(directory)[2]
    (directory / "step_000000.rfs").unlink()
    resumed = make_sampler(directory)
    resumed.load_state_dict(state)
    with pytest.raises(LoaderStateError, match="step 0 has no step file now") as err:
        list(resumed)
    assert err.value.step == 0
    skip = make_sampler(directory, on_reshard="next_step")
    skip.load_state_dict(state)
    assert run(skip, 1) == full[first:]
    assert skip.plan_metrics(1)["reshard_skipped"] == 1  # the rest of step 0, gone


def test_version_2_state_is_migrated_at_a_boundary_and_refused_mid_step(two_steps):
    directory, _, _, full, first = two_steps
    states = saved_states(directory)

    def v2(state):
        return {k: v for k, v in state.items() if k != "data"} | {"version": 2}

    boundary = make_sampler(directory)
    boundary.load_state_dict(v2(states[first]))
    assert run(boundary, 1) == full[first:]
    with pytest.raises(LoaderStateError, match=r"version 2: no record.*on_reshard='restart_step'"):
        make_sampler(directory).load_state_dict(v2(states[2]))
    restart = make_sampler(directory, on_reshard="restart_step")
    restart.load_state_dict(v2(states[2]))
    assert run(restart, 1) == full
    assert json.loads(json.dumps(restart.state_dict()))["version"] == 3


def test_loader_state_attacks_never_resume_other_data(tmp_path):
    s = run_family("loader_states", tmp_path, timeout_s=120)
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 120 and s["correct"] >= 40 and s["refused"] >= 70, format_summary(s)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_mid_step_state_loads_through_dcp_into_a_fresh_loaders_state(two_steps, tmp_path):
    """DCP loads a checkpoint into a state dict of the same structure: a fresh loader's (at a step
    boundary) must take a mid-step one, so ``data`` is a dict of the same keys at both."""
    import torch.distributed.checkpoint as dcp

    directory, _, _, full, _ = two_steps
    saved = saved_states(directory)[2]
    dcp.save({"loader": saved}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    fresh = make_sampler(directory)
    template = {"loader": fresh.state_dict()}
    dcp.load(template, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert template["loader"] == saved
    fresh.load_state_dict(template["loader"])
    assert run(fresh, 1) == full[2:]

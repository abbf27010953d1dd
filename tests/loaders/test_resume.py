"""Resume mid-step, at the end of a step and across steps: sampler and loaders, 0 and 2 workers."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    LoaderStateError,
    MicroBatchSampler,
    RolloutDataset,
    Topology,
)
from rollfeed.loaders.build import build_dataloader
from rollfeed.loaders.step_files import write_step_file
from rollfeed.payload import RaggedRows
from tests.collate.gen import inline_batch
from tests.loaders.common import SEQ_LEN, write_batch
from tests.loaders.resume import check_resume, tmb_key


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    """Three steps of by-handle samples (13, 7 and 10 samples), payload beside them."""
    base = tmp_path_factory.mktemp("run")
    samples = write_batch(base / "payload", 30, seed=11)
    (base / "steps").mkdir()
    for step, (lo, hi) in enumerate([(0, 13), (13, 20), (20, 30)], start=4):
        write_step_file(base / "steps", step, samples[lo:hi])
    return base


def test_sampler_resume_in_memory_passes():
    ds = RolloutDataset(inline_batch(np.random.default_rng(2), 25, 30))
    topo = Topology(dp_rank=1, dp_size=2)
    cuts = check_resume(
        lambda: MicroBatchSampler(
            ds, topo, LoaderConfig(plan=PlanConfig(seq_len=32), shuffle=True, seed=3)
        ),
        passes=3,
    )
    assert len(cuts) == 3 and cuts[0] > 2  # several micro batches per step


def test_sampler_resume_step_dir(step_dir):
    ds = RolloutDataset.from_step_dir(step_dir / "steps")
    topo = Topology(dp_rank=0, dp_size=2, cp_rank=1, cp_size=2)
    config = PlanConfig(seq_len=SEQ_LEN, cp_size=topo.cp_size, cp_layout="zigzag")
    check_resume(lambda: MicroBatchSampler(ds, topo, LoaderConfig(plan=config)), passes=3)


@pytest.mark.parametrize("receive_depth", [0, 2])
@pytest.mark.parametrize("finish_passes", [True, False])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_loader_resume_step_dir(step_dir, num_workers, finish_passes, receive_depth):
    ds = RolloutDataset.from_step_dir(step_dir / "steps")
    topo = Topology(dp_rank=1, dp_size=2, cp_rank=0, cp_size=2)

    def make():
        return build_dataloader(
            ds,
            topo,
            LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN, cp_size=2)),
            root=step_dir / "payload",
            options=LoaderOptions(num_workers=num_workers, receive_depth=receive_depth),
        )

    cuts = check_resume(make, passes=3, key=tmb_key, finish_passes=finish_passes)
    assert cuts[0] > 1 and cuts[1] - cuts[0] > 1  # mid-step points exist in two steps


def test_state_refuses_other_world_shape_unless_told():
    ds = RolloutDataset(inline_batch(np.random.default_rng(4), 20, 30))
    config = PlanConfig(seq_len=32)
    two = MicroBatchSampler(ds, Topology(dp_rank=0, dp_size=2), LoaderConfig(plan=config))
    it = iter(two)
    next(it)
    state = two.state_dict()
    assert state["micro_batches"] == 1
    one = MicroBatchSampler(ds, Topology(dp_rank=0, dp_size=1), LoaderConfig(plan=config))
    with pytest.raises(LoaderStateError, match=r"\(dp_size: 2 -> 1\).*on_reshard"):
        one.load_state_dict(state)
    full = one.step_micro_batches(0)
    restart = MicroBatchSampler(
        ds, Topology(dp_rank=0, dp_size=1), LoaderConfig(plan=config, on_reshard="restart_step")
    )
    restart.load_state_dict(state)
    assert list(restart) == full  # the interrupted step, replanned for DP 1, from its start
    skip = MicroBatchSampler(
        ds, Topology(dp_rank=0, dp_size=1), LoaderConfig(plan=config, on_reshard="next_step")
    )
    skip.load_state_dict(state)
    assert skip.state_dict()["step"] == 1 and skip.state_dict()["micro_batches"] == 0
    other_seed = MicroBatchSampler(
        ds, Topology(dp_rank=0, dp_size=2), LoaderConfig(plan=config, seed=9)
    )
    with pytest.raises(LoaderStateError, match="seed"):
        other_seed.load_state_dict(state)
    with pytest.raises(LoaderStateError, match="version"):
        two.load_state_dict({**state, "version": 99})
    with pytest.raises(LoaderStateError, match="plan must map"):
        two.load_state_dict({**state, "plan": {"seq_len": 32}})


def _inline_loader(ds, plan, **config):
    return build_dataloader(ds, Topology(), LoaderConfig(plan=plan, **config), root=None)


def test_state_saved_under_another_plan_is_refused_naming_the_options():
    # A state counts micro batches of its own plan: continuing them in another plan of the same
    # step would skip (or repeat) samples without a sign.
    ds = RolloutDataset(inline_batch(np.random.default_rng(5), 24, 60))
    short = _inline_loader(ds, PlanConfig(seq_len=64))
    it = iter(short)
    next(it)
    state = json.loads(json.dumps(short.state_dict()))
    assert state["plan"]["seq_len"] == 64 and state["micro_batches"] == 1
    for plan, config, named in (
        (PlanConfig(seq_len=128), {}, r"seq_len: 64 -> 128"),
        (
            PlanConfig(seq_len=64, cp_layout="zigzag", overlong="drop"),
            {"shuffle": True},
            r"cp_layout: 'contiguous' -> 'zigzag'; overlong: 'truncate' -> 'drop'; "
            r"shuffle: False -> True",
        ),
        (PlanConfig(seq_len=64, pad_to_multiple_of=8), {}, r"pad_to_multiple_of: None -> 8"),
        (PlanConfig(seq_len=64, quadratic_cost=0.0), {}, r"quadratic_cost: .* -> 0\.0"),
    ):
        other = _inline_loader(ds, plan, **config)
        with pytest.raises(LoaderStateError, match=named) as err:
            other.load_state_dict(state)
        assert err.value.step == 0 and other.state_dict()["micro_batches"] == 0
    # Under a reshard policy: the interrupted step replanned and started over, or skipped.
    plain = _inline_loader(ds, PlanConfig(seq_len=128))
    full = [tmb_key(t) for t in plain]
    assert (plain.metrics["reshard_restarted"], plain.metrics["reshard_skipped"]) == (0, 0)
    restart = _inline_loader(ds, PlanConfig(seq_len=128), on_reshard="restart_step")
    restart.load_state_dict(state)
    assert [tmb_key(t) for t in restart] == full
    assert (restart.metrics["reshard_restarted"], restart.metrics["reshard_skipped"]) == (1, 0)
    list(restart)  # the next pass falls back on nothing
    assert (restart.metrics["reshard_restarted"], restart.metrics["reshard_skipped"]) == (0, 0)
    skip = _inline_loader(ds, PlanConfig(seq_len=128), on_reshard="next_step")
    skip.load_state_dict(state)
    assert (skip.state_dict()["step"], skip.state_dict()["micro_batches"]) == (1, 0)
    list(skip)
    assert (skip.metrics["step"], skip.metrics["reshard_skipped"]) == (1, 1)
    assert skip.metrics["reshard_restarted"] == 0
    # What is read of a micro batch is not its plan: the same position, the rest of the step.
    rest = [t.input_ids.tolist() for t in _inline_loader(ds, PlanConfig(seq_len=64))][1:]
    wider = _inline_loader(ds, PlanConfig(seq_len=64), whole_fields=True)
    wider.load_state_dict(state)
    assert [t.input_ids.tolist() for t in wider] == rest


def test_resume_key_sees_every_tensor_of_a_micro_batch(step_dir):
    # The streams above are compared with tmb_key: one changed element of any tensor the micro
    # batch holds (a tensor field or a payload field) must change the key.
    loader = build_dataloader(
        RolloutDataset.from_step_dir(step_dir / "steps"),
        Topology(dp_rank=0, dp_size=1),
        LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN)),
        root=step_dir / "payload",
    )
    t = next(iter(loader))
    loader.close()
    names = [f.name for f in dataclasses.fields(t) if isinstance(getattr(t, f.name), torch.Tensor)]
    assert len(names) == 11 and len(t.fields) >= 2, (names, sorted(t.fields))

    def changed(x: torch.Tensor) -> torch.Tensor:  # one bit of the first element flipped
        y = x.clone().contiguous()
        y.view(-1).view(torch.uint8)[0] ^= 1
        return y

    key = tmb_key(t)
    for name in names:
        assert tmb_key(dataclasses.replace(t, **{name: changed(getattr(t, name))})) != key, name
    for name, value in t.fields.items():
        if not isinstance(value, RaggedRows):
            fields = {**t.fields, name: changed(value)}
            assert tmb_key(dataclasses.replace(t, fields=fields)) != key, name
            continue
        for part in value.tensors():  # a ragged field: its offsets, then its values
            new = value.apply(lambda x, part=part: changed(x) if x is part else x)
            fields = {**t.fields, name: new}
            assert tmb_key(dataclasses.replace(t, fields=fields)) != key, name
    assert tmb_key(dataclasses.replace(t, cp_rank=t.cp_rank + 1)) != key

"""LoaderConfig: one checked value for what a loader yields; bad fields are typed errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderConfigError,
    MicroBatchCollator,
    MicroBatchSampler,
    RolloutDataset,
    Topology,
)
from tests.collate.gen import inline_batch

PLAN = PlanConfig(seq_len=16)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("plan", {"seq_len": 16}, "plan must be a PlanConfig, got dict"),
        ("seed", -1, "seed must be an int >= 0, got -1"),
        ("seed", 1.5, "seed must be an int >= 0"),
        ("shuffle", 1, "shuffle must be a bool, got 1"),
        ("whole_fields", "yes", "whole_fields must be a bool"),
        ("start_step", -2, "start_step must be None or an int >= 0, got -2"),
        ("on_reshard", "skip", "on_reshard must be one of"),
        ("step_timeout_s", math.inf, "step_timeout_s must be finite seconds >= 0"),
        ("step_timeout_s", -1, "step_timeout_s must be finite seconds >= 0"),
        ("step_timeout_s", "10", "step_timeout_s must be a number of seconds"),
        ("width", 0, "width must be None or an int >= 1, got 0"),
    ],
)
def test_a_bad_field_is_refused_by_name(field, value, match):
    kw = {"plan": PLAN, field: value}
    with pytest.raises(LoaderConfigError, match=rf"LoaderConfig\.{match}"):
        LoaderConfig(**kw)


def test_sampler_and_collator_take_the_config_with_the_topologys_cp_size():
    ds = RolloutDataset(inline_batch(np.random.default_rng(0), 4, 8))
    topo = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    config = LoaderConfig(plan=PlanConfig(seq_len=16, cp_layout="zigzag"), width=3)
    sampler = MicroBatchSampler(ds, topo, config)
    collator = MicroBatchCollator(topo, config, root=None)
    want = PlanConfig(seq_len=16, cp_size=2, cp_layout="zigzag")
    assert sampler.config.plan == collator.config.plan == want
    assert collator.config.width == 3  # the rest of the config as given
    mb = collator(ds.__getitems__(sampler.step_micro_batches(0)[0]))
    assert (mb.cp_rank, mb.cp_size, mb.cp_layout) == (1, 2, "zigzag")
    with pytest.raises(LoaderConfigError, match=r"LoaderConfig\(plan=PlanConfig"):
        MicroBatchSampler(ds, topo, PLAN)
    with pytest.raises(LoaderConfigError, match="needs a step directory"):
        MicroBatchSampler(ds, topo, LoaderConfig(plan=PLAN, stream=True))

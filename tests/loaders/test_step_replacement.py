"""A step file replaced after its step was planned: a pass yields exactly the planned version's
micro batches (the trainer's process reads the file it planned from) or raises
StepReplacedError naming the file and the step (a worker finds another version), never the
replacement's tokens read through the planned index (local step directory and object store); and
the step replacement attack family (:mod:`tests.loaders.step_attacks`) finds nothing else."""

from __future__ import annotations

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderOptions,
    RolloutDataset,
    StepReplacedError,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.step_files import write_step_file
from tests.loaders.common import SEQ_LEN, reference, write_batch
from tests.loaders.resume import tmb_key
from tests.loaders.step_attacks import same_sizes_other_tokens
from tests.loaders.test_object_store_steps import store_options
from tests.payload.adversary import format_summary, run_family
from tests.payload.adversary_tally import FAILURES

CONFIG = PlanConfig(seq_len=SEQ_LEN)
TOPO = Topology(dp_rank=0, dp_size=1)


def _keys(samples, root) -> list:
    ref, _ = reference(samples, dp_size=1, cp_size=1, cp_layout="contiguous", root=root)
    return [tmb_key(t) for t in ref[0, 0]]


@pytest.mark.parametrize("replacement", ["same sizes", "other samples"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_step_replaced_after_planning_reads_the_planned_version_or_is_refused(
    tmp_path, num_workers, replacement
):
    samples = write_batch(tmp_path / "payload", 12, seed=13)
    planned = samples[:6]
    other = same_sizes_other_tokens(planned) if replacement == "same sizes" else samples[6:]
    assert _keys(other, tmp_path / "payload") != _keys(planned, tmp_path / "payload")
    (tmp_path / "steps").mkdir()
    path = write_step_file(tmp_path / "steps", 0, planned)
    ds = RolloutDataset.from_step_dir(tmp_path / "steps")
    loader = build_dataloader(
        ds,
        TOPO,
        LoaderConfig(plan=CONFIG),
        root=tmp_path / "payload",
        options=LoaderOptions(num_workers=num_workers),
    )
    assert len(loader) > 0  # the step is planned from the planned version's index
    write_step_file(tmp_path / "steps", 0, other)  # replaced under the same name
    if num_workers == 0:
        # the trainer's process planned through a descriptor on the planned version: it reads it
        assert [tmb_key(t) for t in loader] == _keys(planned, tmp_path / "payload")
        return
    # forked workers inherit the planned index, but the file at the path is another version
    with pytest.raises(StepReplacedError) as err:
        list(loader)
    assert err.value.file == str(path) and err.value.step == 0
    assert "was replaced after planning" in str(err.value)
    loader.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_step_object_replaced_after_planning_is_refused(
    tmp_path, object_store, s3_url, num_workers
):
    from rollfeed.payload import PayloadRoot

    root = PayloadRoot(f"{s3_url}/payload", **object_store.options())
    samples = write_batch(root, 6, seed=14)
    steps, access = f"{s3_url}/steps", store_options(object_store)
    write_step_file(steps, 0, samples, store=access)
    ds = RolloutDataset.from_step_dir(f"{s3_url}/steps", store=store_options(object_store))
    options = LoaderOptions(num_workers=num_workers)
    loader = build_dataloader(ds, TOPO, LoaderConfig(plan=CONFIG), root=root, options=options)
    assert len(loader) > 0
    write_step_file(steps, 0, same_sizes_other_tokens(samples), store=access)  # another ETag
    if num_workers == 0:  # the trainer's process reads the object pinned to the planned ETag
        assert [tmb_key(t) for t in loader] == _keys(samples, root)
        return
    with pytest.raises(StepReplacedError) as err:  # a worker opens the object anew
        list(loader)
    assert err.value.file == f"{s3_url}/steps/step_000000.rfs" and err.value.step == 0
    loader.close()


def test_step_replacement_attacks_never_read_other_data(tmp_path, object_store):
    # 2 GiB: an s3 loader's workers come from a fork server that imports torch again and starts
    # obstore's runtime threads, under the same per-process limit
    s = run_family(
        "step_replace", tmp_path, timeout_s=120, env=object_store.env(), as_limit=2 << 30
    )
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 50 and s["correct"] and s["refused"], format_summary(s)

"""rollfeed's pieces under torchdata: ``StatefulDataLoader`` over the sampler and the collator
(0 and 2 workers), resumed mid-step and at step ends exactly, and a ``torchdata.nodes``
pipeline over the same pieces, resumed from its state.

What a user writes: the dataset, ``MicroBatchSampler`` as the ``batch_sampler`` and
``MicroBatchCollator`` as the ``collate_fn`` (one ``LoaderConfig`` for both), one pass per
training step. The reference is an uninterrupted run of the same loader, which must itself
equal the project's own loader (``build_dataloader``) bitwise.
"""

from __future__ import annotations

import json

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    MicroBatchCollator,
    MicroBatchSampler,
    RolloutDataset,
    Topology,
)
from rollfeed.loaders.build import build_dataloader
from rollfeed.loaders.step_files import write_step_file
from tests.loaders.common import SEQ_LEN, write_batch
from tests.loaders.resume import check_resume, tmb_key

torchdata = pytest.importorskip("torchdata", reason="torchdata is a test extra")
from torchdata import nodes  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

TOPOLOGY = Topology(dp_rank=1, dp_size=2, cp_rank=0, cp_size=2)
# a pass that looks for a fourth step gives up within 2 s: a wrong resume fails, never hangs
CONFIG = LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN, cp_size=2), step_timeout_s=2.0)
PASSES = 3
# mid-step points of each step and each step's end (the steps yield 6, 3 and 5 micro batches)
KS = [0, 2, 6, 7, 9, 12]
# the torchdata 0.11 loader's own call, not ours
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three steps of by-handle samples (13, 7 and 10 samples), payload beside them."""
    base = tmp_path_factory.mktemp("run")
    samples = write_batch(base / "payload", 30, seed=11)
    (base / "steps").mkdir()
    for step, (lo, hi) in enumerate([(0, 13), (13, 20), (20, 30)], start=4):
        write_step_file(base / "steps", step, samples[lo:hi])
    return base


def _stateful(run, num_workers: int) -> StatefulDataLoader:
    dataset = RolloutDataset.from_step_dir(run / "steps")
    return StatefulDataLoader(
        dataset,
        batch_sampler=MicroBatchSampler(dataset, TOPOLOGY, CONFIG),
        collate_fn=MicroBatchCollator(TOPOLOGY, CONFIG, root=run / "payload"),
        num_workers=num_workers,
    )


def _passes(loader, passes: int = PASSES) -> list:
    return [[tmb_key(mb) for mb in loader] for _ in range(passes)]


@pytest.fixture(scope="module")
def ours(run):
    """The project's own loader's micro batches, per pass (per step)."""
    dataset = RolloutDataset.from_step_dir(run / "steps")
    return _passes(build_dataloader(dataset, TOPOLOGY, CONFIG, root=run / "payload"))


@pytest.mark.parametrize("finish_passes", [True, False])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_bitwise_mid_step_and_at_step_ends(
    run, ours, num_workers, finish_passes
):
    """After k micro batches (mid-step, at a step's end with the pass run to its end or left
    right after its last micro batch), state_dict through JSON, a new loader: the rest equals the
    uninterrupted run, which equals the project's loader."""
    assert _passes(_stateful(run, num_workers)) == ours
    cuts = check_resume(
        lambda: _stateful(run, num_workers),
        passes=PASSES,
        ks=KS,
        key=tmb_key,
        finish_passes=finish_passes,
    )
    assert cuts == [6, 9, 14]  # KS holds mid-step points and both step ends


def _pipeline(run) -> nodes.Loader:
    """Indices from the sampler, samples and a micro batch per index list on two threads."""
    dataset = RolloutDataset.from_step_dir(run / "steps")
    collator = MicroBatchCollator(TOPOLOGY, CONFIG, root=run / "payload")
    indices = nodes.SamplerWrapper(MicroBatchSampler(dataset, TOPOLOGY, CONFIG))
    batches = nodes.ParallelMapper(
        indices,
        lambda planned: collator(dataset.__getitems__(planned)),
        num_workers=2,
        method="thread",
    )
    return nodes.Loader(batches)


def test_nodes_pipeline_yields_the_loaders_micro_batches_and_resumes(run, ours):
    """A ``torchdata.nodes`` pipeline over the sampler and the collator: the project's micro
    batches; after 2 of them (mid-step), or after the first step's 6 and its end, a new
    pipeline loaded from the state goes on with exactly the rest."""
    assert _passes(_pipeline(run)) == ours
    flat = [mb for p in ours for mb in p]
    for k in (2, 6):
        loader = _pipeline(run)
        it = iter(loader)
        taken = [tmb_key(next(it)) for _ in range(k)]
        if k == len(ours[0]):
            assert next(it, None) is None  # the step's end
        state = json.loads(json.dumps(loader.state_dict()))
        resumed = _pipeline(run)
        resumed.load_state_dict(state)
        rest = [mb for p in _passes(resumed, PASSES - (k == len(ours[0]))) for mb in p]
        assert taken + rest == flat, k

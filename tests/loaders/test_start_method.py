"""How a loader's workers start: forked over local files, from a fork server over an object store
(whose client does not survive ``fork``), and the same micro batches either way."""

from __future__ import annotations

import pytest

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderConfigError,
    LoaderOptions,
    RolloutDataset,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.step_files import write_step_file
from tests.loaders.common import SEQ_LEN, reference, write_batch
from tests.loaders.resume import tmb_key


def test_the_start_method_follows_where_the_data_is():
    assert LoaderOptions().start_method(object_store=False) == "fork"
    assert LoaderOptions().start_method(object_store=True) == "forkserver"
    spawn = LoaderOptions(multiprocessing_context="spawn")
    assert spawn.start_method(object_store=True) == "spawn"
    assert spawn.start_method(object_store=False) == "spawn"
    with pytest.raises(LoaderConfigError, match=r"does not survive fork.*'forkserver'"):
        LoaderOptions(multiprocessing_context="fork").start_method(object_store=True)
    with pytest.raises(LoaderConfigError, match=r"multiprocessing_context must be one of"):
        LoaderOptions(multiprocessing_context="thread")  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_forkserver_workers_read_what_forked_ones_read(tmp_path):
    """Workers of a fork server inherit nothing: each reads the step's index itself, and its
    micro batches come back through the memfd handover (the sockets passed to it)."""
    samples = write_batch(tmp_path / "payload", 8, seed=4)
    (tmp_path / "steps").mkdir()
    for step in (0, 1):
        write_step_file(tmp_path / "steps", step, samples[4 * step : 4 * step + 4])
    loader = build_dataloader(
        RolloutDataset.from_step_dir(tmp_path / "steps"),
        Topology(dp_rank=0, dp_size=1),
        LoaderConfig(plan=PlanConfig(seq_len=SEQ_LEN)),
        root=tmp_path / "payload",
        options=LoaderOptions(num_workers=2, multiprocessing_context="forkserver"),
    )
    for step in (0, 1):
        ref = reference(
            samples[4 * step : 4 * step + 4],
            dp_size=1,
            cp_size=1,
            cp_layout="contiguous",
            root=tmp_path / "payload",
        )[0][0, 0]
        assert [tmb_key(t) for t in loader] == [tmb_key(t) for t in ref], step
    assert loader._handover is not None  # the memfd handover, not torch's
    loader.close()

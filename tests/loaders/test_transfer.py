"""Pinning and the device copy: a worker's micro batch is one buffer, pinned once, copied once.

Pinning needs CUDA, which these machines lack: the tests check what holds by construction (the
views rebuilt on a moved buffer equal the source, one move per micro batch), that
``pin_memory=False`` never pins, and that ``pin_memory=True`` without CUDA is a config error.
"""

from __future__ import annotations

import pytest
import torch

from rollfeed.collate import PlanConfig
from rollfeed.loaders import (
    LoaderConfig,
    LoaderConfigError,
    LoaderOptions,
    RolloutDataset,
    Topology,
    build_dataloader,
)
from rollfeed.loaders.collator import share_as_one_storage
from rollfeed.loaders.step_files import write_step_file
from rollfeed.loaders.transfer import move_micro_batch
from tests.loaders.common import SEQ_LEN, assert_bitwise, reference, write_batch

TOPO = Topology(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
CONFIG = PlanConfig(seq_len=SEQ_LEN, cp_size=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("transfer")
    samples = write_batch(base / "payload", 12, seed=3)
    (base / "steps").mkdir()
    write_step_file(base / "steps", 0, samples)
    ref, _ = reference(samples, dp_size=1, cp_size=2, cp_layout="contiguous", root=base / "payload")
    return base, ref[0, 1]


def _loader(base, **kw):
    ds = RolloutDataset.from_step_dir(base / "steps")
    return build_dataloader(
        ds, TOPO, LoaderConfig(plan=CONFIG), root=base / "payload", options=LoaderOptions(**kw)
    )


class Moves:
    """A stand-in for pin / to(device): a copy, counted, with the size of what it moved."""

    def __init__(self) -> None:
        self.sizes: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __call__(self, t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.sizes.append((t.dtype, tuple(t.shape)))
        return t.clone()


def test_one_buffer_moves_once_and_every_view_equals_the_source(run):
    _, ref = run
    for tmb in ref:
        shared = share_as_one_storage(tmb)  # as a worker sends it
        moves = Moves()
        moved = move_micro_batch(shared, moves)
        buffer = shared.input_ids.untyped_storage()
        assert moves.sizes == [(torch.uint8, (buffer.nbytes(),))]  # the whole buffer, once
        assert_bitwise(moved, tmb, "moved")
        storages = {t.untyped_storage().data_ptr() for t in moved.tensors()}
        assert len(storages) == 1 and buffer.data_ptr() not in storages
        assert moved.checks == tmb.checks


def test_a_micro_batch_of_separate_tensors_moves_tensor_by_tensor(run):
    _, ref = run
    moves = Moves()
    moved = move_micro_batch(ref[0], moves)
    assert len(moves.sizes) == len(ref[0].tensors())
    assert_bitwise(moved, ref[0], "moved")


def _refuse_pinning(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pin_memory called")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)


@pytest.mark.parametrize("pin_memory", [False, None])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_false_never_pins(run, monkeypatch, num_workers, pin_memory):
    base, ref = run
    _refuse_pinning(monkeypatch)
    if pin_memory is None:  # auto: pins only where CUDA is available
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loader = _loader(base, num_workers=num_workers, receive_depth=2, pin_memory=pin_memory)
    got = list(loader)
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert_bitwise(a, b, k)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_pin_memory_true_without_cuda_is_a_config_error():
    with pytest.raises(LoaderConfigError, match=r"pin_memory=True, .* needs CUDA"):
        LoaderOptions(num_workers=2, pin_memory=True)
    with pytest.raises(LoaderConfigError, match=r"device='cuda:1'\) needs CUDA"):
        LoaderOptions(device="cuda:1")


@pytest.mark.parametrize("depth", [0, 2])
def test_pinning_pins_each_workers_micro_batch_once_as_one_buffer(run, monkeypatch, depth):
    base, ref = run
    pins = Moves()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # auto: pin
    monkeypatch.setattr(torch.Tensor, "pin_memory", pins)
    got = list(_loader(base, num_workers=2, receive_depth=depth))
    assert len(pins.sizes) == len(got) == len(ref)
    assert all(dtype == torch.uint8 and len(shape) == 1 for dtype, shape in pins.sizes)
    for k, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert_bitwise(a, b, k)


def test_device_gets_each_micro_batch_in_one_copy(run):
    base, ref = run
    got = list(_loader(base, num_workers=2, device="meta", pin_memory=False))
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert all(t.device.type == "meta" for t in a.tensors())
        assert [(t.dtype, t.shape) for t in a.tensors()] == [
            (t.dtype, t.shape) for t in b.tensors()
        ]
        sizes = {t.untyped_storage().nbytes() for t in a.tensors()}
        assert sizes == {b_size(b)}, sizes  # every tensor a view of one moved buffer


def b_size(tmb) -> int:
    """Bytes of the one buffer a worker packs ``tmb`` into."""
    return share_as_one_storage(tmb).input_ids.untyped_storage().nbytes()

import numpy as np
import torch

from rollfeed.collate import PlanConfig, Sample, prepare_batch, to_tensor_micro_batch


def micro_batch():
    sample = Sample(
        np.arange(5),
        loss_mask=np.array([0, 1, 1, 1, 1], bool),
        advantages=np.ones(5, np.float32),
        inference_logprobs=np.zeros(5, np.float32),
        fields={"routed_experts": np.arange(10, dtype=np.uint8).reshape(5, 2)},
    )
    plan = prepare_batch([sample], PlanConfig(seq_len=8), dp_size=1)
    return to_tensor_micro_batch(plan[0][0], cp_rank=0)


def test_apply_maps_every_tensor_in_order_and_keeps_the_rest():
    mb = micro_batch()
    seen = []
    doubled = mb.apply(lambda t: seen.append(t) or t * 2)
    assert len(seen) == len(mb.tensors()) and all(
        a is b for a, b in zip(seen, mb.tensors(), strict=True)
    )
    assert torch.equal(doubled.input_ids, mb.input_ids * 2)
    assert torch.equal(doubled.fields["routed_experts"], mb.fields["routed_experts"] * 2)
    assert (doubled.seq_len, doubled.cp_layout) == (mb.seq_len, mb.cp_layout)


def test_to_moves_every_tensor():
    mb = micro_batch().to("meta")
    assert all(t.device.type == "meta" for t in mb.tensors())
    counts = mb.step_counts  # the step's counts go along: an aggregate on the device reads them
    assert counts.sample_loss_tokens.device.type == "meta" and counts.loss_tokens == 4
    assert mb.fields["routed_experts"].dtype == torch.uint8

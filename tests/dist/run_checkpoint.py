"""Rank script: a tiny Qwen3-MoE sharded with FSDP2 over 2 gloo ranks written as two trainer
checkpoints by :func:`rollfeed.models.save_checkpoint` (launched by tests/capture/test_weights.py).

``run_checkpoint.py MODEL OUT``: loads ``MODEL`` (a ``save_pretrained`` directory), shards every
decoder layer and the root with ``fully_shard``, and writes

- ``OUT/step_000001``: the weights with the LM head negated (sharded parameters changed in place,
  as a training step changes them): a policy that samples other tokens;
- ``OUT/step_000002``: the weights as loaded, negated back.

Each rank checks that both calls return the same absolute path on every rank, and that a second
call for a taken path raises ``CheckpointWriteError`` on every rank (nothing hangs, nothing is
left there).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401  (before the group)

from rollfeed.models import CheckpointWriteError, save_checkpoint
from tests.dist.launch import run_rank
from tests.dist.run_train_resume import release_meshes


def main(model_dir: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        model.lm_head.weight.neg_()  # a DTensor shard on each rank
    first = save_checkpoint(model, f"{out}/step_000001", step=1)
    with torch.no_grad():
        model.lm_head.weight.neg_()
    second = save_checkpoint(model, f"{out}/step_000002", step=2)
    paths = [None, None]
    dist.all_gather_object(paths, (first, second))
    assert paths[0] == paths[1] == (f"{out}/step_000001", f"{out}/step_000002"), paths
    try:
        save_checkpoint(model, f"{out}/step_000002", step=2)
    except CheckpointWriteError as err:
        assert "exists" in str(err), err
    else:
        raise AssertionError("a second checkpoint at a taken path was written")
    release_meshes()  # before run_rank destroys the groups (tests.dist.run_train_resume)


if __name__ == "__main__":
    run_rank(main, sys.argv[1], sys.argv[2])

"""Demo training ranks (dp 2 x cp 2): an uninterrupted run, one cut after step 1 and resumed, and
steps 1 and 2 trained again from the log.

Args: ``first WORK`` (launch A): ``WORK/full`` trains steps 0..2 and checkpoints after the last;
``WORK/cut`` trains step 0 from fresh weights and checkpoints it. ``resume WORK`` (launch B, new
processes): ``WORK/cut`` resumes from its checkpoint and trains to step 3, checkpointing each step;
then steps 1 and 2 are trained again from ``WORK/cut``'s checkpoint of step 1 into
``WORK/retrain.json`` (``--from 1``: model and AdamW from the checkpoint, the loader started at
step 1). The test compares what the runs wrote.
"""

from __future__ import annotations

import gc
import sys

import torch
from torch.distributed.device_mesh import DeviceMesh

# The demo trainer imports the model classes before the process group exists (see launch.py).
from rollfeed.demo import trainer
from tests.dist.launch import run_rank


def run(work: str, *options: str) -> None:
    argv = ["--model-dir", f"{work}/model", "--cp", "2", "--seq-len", "32", "--dtype", "float64"]
    argv += ["--workers", "0", "--lr", "1e-2", *options]
    trainer.train(trainer.parser().parse_args(argv))


def release_meshes() -> None:
    """Let every device mesh still alive drop its process groups, so that run_rank's teardown
    finds no gloo thread: torch's DTensor keeps meshes in process-wide caches and torch has no
    public way to clear them (the demo trainer ends its process without interpreter teardown
    instead; a test may reach the private registry)."""
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            obj._pg_registry.clear()


def main(mode: str, work: str) -> None:
    torch.set_num_threads(1)
    if mode == "first":
        run(work, "--workdir", f"{work}/full", "--steps", "3", "--checkpoint-every", "3")
        run(work, "--workdir", f"{work}/cut", "--steps", "1", "--checkpoint-every", "1")
    else:
        run(work, "--workdir", f"{work}/cut", "--steps", "3", "--checkpoint-every", "1", "--resume")
        again = ["--steps-dir", f"{work}/cut/steps", "--root", f"{work}/cut/payload"]
        again += ["--checkpoints", f"{work}/cut/checkpoints", "--out", f"{work}/retrain.json"]
        run(work, *again, "--steps", "3", "--from", "1")
    release_meshes()  # before run_rank destroys the groups (see the function)


if __name__ == "__main__":
    run_rank(main, sys.argv[1], sys.argv[2])

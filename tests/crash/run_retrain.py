"""Steps trained again from checkpoints in one fresh torchrun launch (2 ranks): for each ``c`` of
the spec's ``starts``, the demo trainer with ``--from c --steps c+1`` (checkpoint ``c``'s model and
AdamW, or the model's weights for 0; the loader at step ``c``) writes ``<out>/from_<c>.json``.

``python -m torch.distributed.run --nproc_per_node=2 tests/crash/run_retrain.py SPEC.json``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# The demo trainer imports the model classes before the process group exists (see launch.py).
from rollfeed.demo import trainer
from tests.dist.launch import run_rank
from tests.dist.run_train_resume import release_meshes


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    Path(spec["out"]).mkdir(exist_ok=True)
    for c in spec["starts"]:
        argv = [*spec["args"], "--from", str(c), "--steps", str(c + 1)]
        argv += ["--out", f"{spec['out']}/from_{c}.json"]
        trainer.train(trainer.parser().parse_args(argv))
        release_meshes()


if __name__ == "__main__":
    run_rank(main, sys.argv[1])

"""The crash test's trainer ranks: the demo trainer (:mod:`rollfeed.demo.trainer`) with the test's
pause points, run under torchrun with the trainer's own flags.

Each step waits at the test's gate first (:meth:`tests.crash.points.Points.gate`). Pause points
(:mod:`tests.crash.points`, rank 0): ``step.mid`` (gradients computed, the AdamW
update not applied), ``checkpoint.mid`` (the DCP checkpoint's files written, its ``.metadata``
not), ``weights.mid`` (the weights for the server saved aside, not yet complete and renamed),
``progress.before`` (checkpoint and weights complete, the progress file not yet written).
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from transformers import PreTrainedModel

# The demo trainer imports the model classes before the process group exists (see its doc).
from rollfeed.demo import publish, trainer
from tests.crash.points import Points

POINTS = Points("trainer")


def install_points() -> None:
    train_step = trainer.train_step

    def gated_step(*args, step: int, **kwargs):
        POINTS.mark(f"step {step}")
        POINTS.gate(step)
        return train_step(*args, step=step, **kwargs)

    trainer.train_step = gated_step
    step = torch.optim.AdamW.step

    def paused_step(self, *args, **kwargs):
        POINTS.at("step.mid")
        return step(self, *args, **kwargs)

    torch.optim.AdamW.step = paused_step
    finish = FileSystemWriter.finish

    def paused_finish(self, *args, **kwargs):
        POINTS.at("checkpoint.mid")
        return finish(self, *args, **kwargs)

    FileSystemWriter.finish = paused_finish
    save = PreTrainedModel.save_pretrained

    def paused_save(self, *args, **kwargs):
        out = save(self, *args, **kwargs)
        POINTS.at("weights.mid")
        return out

    PreTrainedModel.save_pretrained = paused_save
    write_progress = publish.write_progress

    def paused_progress(*args, **kwargs):
        POINTS.at("progress.before")
        return write_progress(*args, **kwargs)

    publish.write_progress = paused_progress


if __name__ == "__main__":
    POINTS.mark("imported")
    install_points()
    trainer.main(sys.argv[1:])
    trainer.end_process()

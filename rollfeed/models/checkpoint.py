"""A trainer's weights as a checkpoint the capture server loads in place: complete or not there.

:func:`save_checkpoint` writes a Hugging Face model's weights (a plain module, or one sharded with
FSDP2 ``fully_shard`` or DTensor tensor parallelism) as a ``save_pretrained`` directory:

1. every rank gathers the full state dict (``get_model_state_dict(full_state_dict=True,
   cpu_offload=True)``: the unsharded tensors reach rank 0's host memory, the other ranks hold
   none), a collective every rank of the default process group calls;
2. rank 0 writes ``save_pretrained`` (and the tokenizer's files, when given) into a fresh
   directory beside ``path``, durable (``fsync``), then the marker
   ``rollfeed-checkpoint.json`` listing every file and its size and the trainer ``step``
   (the policy version of the tokens the weights will sample), durable too, and renames the
   directory to ``path`` at once: a reader finds a complete checkpoint there or nothing;
3. every rank returns once the rename is done (or raises the error rank 0 met, typed
   :class:`CheckpointWriteError`; the aside directory is removed).

The capture server loads it (``POST /rollfeed/v1/weights``) and refuses an incomplete directory:
the marker's format is :mod:`rollfeed.capture.checkpoint`'s.

Example (every rank of a 2-rank FSDP2 job)::

    save_checkpoint(model, "/ckpt/step_000042", step=42, tokenizer=tokenizer)
    client.load_weights("/ckpt/step_000042", version=42)     # one rank, the orchestrator's
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rollfeed.models.errors import ModelError

MARKER = "rollfeed-checkpoint.json"  # the name and format the capture server checks
MARKER_FORMAT = 1


class CheckpointWriteError(ModelError):
    """A checkpoint could not be written (its path is taken, a write failed); nothing was left
    under its path."""


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's unsharded state dict on rank 0's host (empty on other ranks); a collective
    over the default process group when one is initialised."""
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_checkpoint(
    model: Any, path: str | os.PathLike[str], *, step: int, tokenizer: Any = None
) -> str:
    """Write ``model``'s weights (a ``transformers`` ``PreTrainedModel``, sharded or not) as the
    checkpoint of trainer step ``step`` at ``path``; the absolute path, on every rank (see the
    module doc). ``path`` must not exist yet."""
    if type(step) is not int or not 0 <= step < 1 << 31:
        raise CheckpointWriteError(f"step must be an int in [0, 2**31), got {step!r}")
    path = os.path.abspath(os.fspath(path))
    state = full_state_dict(model)
    error, cause = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            _write(model, state, path, step, tokenizer)
        except Exception as err:  # every rank must hear of it, or the others would wait forever
            error, cause = f"{type(err).__name__}: {err}", err
    del state
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointWriteError(
            f"writing the checkpoint {path} failed on rank 0 ({error}); nothing was left there"
        ) from cause
    return path


def _write(
    model: Any, state: dict[str, torch.Tensor], path: str, step: int, tokenizer: Any
) -> None:
    if os.path.lexists(path):
        raise CheckpointWriteError(
            f"{path} exists: a checkpoint is written once, under a path of its own (one per step)"
        )
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    aside = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        model.save_pretrained(aside, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(aside)
        files = {}
        for name in sorted(os.listdir(aside)):
            files[name] = _durable(os.path.join(aside, name))
        marker = {"format": MARKER_FORMAT, "step": step, "files": files}
        with open(os.path.join(aside, MARKER), "w") as f:
            json.dump(marker, f)
        _durable(os.path.join(aside, MARKER))
        _sync_dir(aside)
        os.rename(aside, path)  # refused (ENOTEMPTY) if a checkpoint appeared there meanwhile
        _sync_dir(parent)
    except BaseException:
        shutil.rmtree(aside, ignore_errors=True)
        raise


def _durable(file: str) -> int:
    """``fsync`` ``file``; its size."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _sync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

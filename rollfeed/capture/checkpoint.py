"""A trainer checkpoint the capture server may load: complete, or refused before the engine sees it.

A checkpoint is a ``save_pretrained`` directory (``config.json`` and ``*.safetensors`` weights,
the tokenizer's files if any) renamed into place once written, holding last a marker,
:data:`CHECKPOINT_MARKER`, written after every other file was durable::

    {"format": 1, "step": 42, "files": {"config.json": 812, "model.safetensors": 9437280}}

``step``: the trainer step whose weights these are (the policy version of every token sampled
with them); ``files``: every file of the directory (plain names, no folder) with its size in
bytes. A trainer writes it with :func:`rollfeed.models.checkpoint.save_checkpoint`.

:func:`read_checkpoint` refuses, with a :class:`CheckpointError` naming the path and what is
wrong: a relative path (the server and its client need not share a working directory); a path
that is not a directory; a directory without the marker (still being written, or not a trainer
checkpoint); a marker that is not the format above; a listed file that is missing, not a regular
file (a symlink, a FIFO) or of another size (a copy cut short); no ``config.json`` or no
``*.safetensors`` listed. :func:`config_differences` names where the checkpoint's model config
differs from the served model's (another architecture's weights would load only in part).

Example::

    read_checkpoint("/ckpt/step_000042")  -> Checkpoint(path="/ckpt/step_000042", step=42, ...)
    read_checkpoint("/ckpt/step_000043.tmp-91f2")  -> CheckpointError: ... no marker ...
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollfeed.capture.errors import CaptureRequestError

CHECKPOINT_MARKER = "rollfeed-checkpoint.json"
MARKER_FORMAT = 1
MAX_MARKER_BYTES = 1 << 20  # a marker names files and sizes: a megabyte is thousands of files
# The model config keys a reload must agree on with the served model, where both have them.
CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
)


class CheckpointError(CaptureRequestError):
    """A weight update names a checkpoint that is not a complete one of the served model (see
    :mod:`rollfeed.capture.checkpoint`); nothing was loaded."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    """A complete checkpoint: its absolute ``path``, ``step`` and ``files`` (name -> bytes)."""

    path: str
    step: int
    files: Mapping[str, int]

    def config(self) -> dict[str, Any]:
        """Its ``config.json``, parsed (a :class:`CheckpointError` when it is not JSON)."""
        try:
            with open(os.path.join(self.path, "config.json"), "rb") as f:
                data = json.loads(f.read(MAX_MARKER_BYTES + 1))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{self.path}/config.json cannot be read: {err}") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{self.path}/config.json is not a JSON object")
        return data


def read_checkpoint(path: str) -> Checkpoint:
    """The checkpoint at ``path`` once it is complete; :class:`CheckpointError` otherwise."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise CheckpointError(
            f"checkpoint path {path!r} is not absolute: the server resolves it, in its own "
            "working directory; pass the absolute path"
        )
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is not a directory (or is not there)")
    marker = _marker(path)
    for name, size in marker["files"].items():
        try:
            st = os.lstat(os.path.join(path, name))
        except OSError:
            raise CheckpointError(
                f"checkpoint {path} lists {name} ({size} bytes), which is not there: the "
                "directory was changed after it was written"
            ) from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            what = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise CheckpointError(
                f"checkpoint {path}: {name} is {what}, its marker says {size} bytes: a copy cut "
                "short, or changed after it was written"
            )
    return Checkpoint(path=path, step=marker["step"], files=marker["files"])


def _marker(path: str) -> dict[str, Any]:
    where = os.path.join(path, CHECKPOINT_MARKER)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        raise CheckpointError(
            f"checkpoint {path} has no {CHECKPOINT_MARKER}, which a trainer writes last: it is "
            "still being written (load it once it is renamed into place) or not a trainer "
            "checkpoint (write it with rollfeed.models.checkpoint.save_checkpoint)"
        ) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_MARKER} is not a regular file")
        raw = f.read(MAX_MARKER_BYTES + 1)
    try:
        data = json.loads(raw) if len(raw) <= MAX_MARKER_BYTES else None
    except ValueError:
        data = None
    files = data.get("files") if isinstance(data, dict) else None
    ok = (
        isinstance(data, dict)
        and set(data) == {"format", "step", "files"}
        and data["format"] == MARKER_FORMAT
        and type(data["step"]) is int
        and data["step"] >= 0
        and isinstance(files, dict)
        and all(
            isinstance(k, str)
            and k not in ("", ".", "..")
            and "/" not in k
            and "\0" not in k
            and type(v) is int
            and v >= 0
            for k, v in files.items()
        )
    )
    if not ok:
        raise CheckpointError(
            f"checkpoint {path}: {CHECKPOINT_MARKER} is not a marker of format {MARKER_FORMAT} "
            '({"format": 1, "step": <int >= 0>, "files": {<name>: <bytes>, ...}})'
        )
    assert isinstance(files, dict)
    if "config.json" not in files or not any(k.endswith(".safetensors") for k in files):
        raise CheckpointError(
            f"checkpoint {path} lists no config.json or no *.safetensors weights: not a "
            "save_pretrained directory"
        )
    return data


def config_differences(checkpoint: Mapping[str, Any], served: Mapping[str, Any]) -> list[str]:
    """``"key: served -> checkpoint"`` for each of :data:`CONFIG_KEYS` both configs hold and
    that differ (empty: the checkpoint's weights fit the served model)."""
    return [
        f"{k}: {served[k]!r} -> {checkpoint[k]!r}"
        for k in CONFIG_KEYS
        if k in checkpoint and k in served and checkpoint[k] != served[k]
    ]

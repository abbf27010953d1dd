"""What the demo trainer records of each step it trains, so a run can be audited from its log.

- :func:`sample_fingerprints`: the samples of one micro batch, each named by a hash of its token
  ids (:func:`fingerprint`; the whole sample, gathered over the ``cp`` group, reported by
  ``cp`` rank 0 only), so a step's record says which samples it trained and an audit matches them
  with the step files' samples (a multiset: two samples of the same tokens count twice);
- :func:`weights_digest`: a SHA-256 of the model's full weights (every parameter and buffer of the
  full state dict, by name, dtype, shape and bytes), so two runs that trained the same steps from
  the same checkpoint are compared bitwise without keeping their weights.

- :func:`partial_rollouts`: the samples of one micro batch whose tokens were sampled by more
  than one policy version (a rollout the capture server continued across a weight update), each
  with its per-token versions as the micro batch's ``versions`` tensor holds them.

Example: a micro batch of samples ``[5, 6, 7]`` and ``[8, 9]`` ->
``[fingerprint([5, 6, 7]), fingerprint([8, 9])]`` from cp rank 0, ``[]`` from the others; a
sample of labels sampled under versions ``[-1, 3, 3, 4, 4, -1]`` (its prompt and last position
carry none) -> ``{"sample": fingerprint(...), "versions": [-1, 3, 3, 4, 4, -1]}``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rollfeed.collate import TensorMicroBatch


def fingerprint(token_ids: Sequence[int] | np.ndarray) -> str:
    """16 hex digits of the SHA-256 of a sample's token ids as int64."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def whole_row(
    mb: TensorMicroBatch, values: torch.Tensor, cp_group: dist.ProcessGroup | None, fill: int
) -> torch.Tensor:
    """``[seq_len]`` int64: this rank's ``values`` (at ``mb.positions``) and its cp peers',
    in canonical order; collective over ``cp_group``. A micro batch holding prefix trees splits
    its flat rows unevenly (``mb.tree.flat_counts``): each rank's part is padded to the largest
    for the all-gather and read back to its own count."""
    row = torch.full((mb.seq_len,), fill, dtype=torch.int64)
    if mb.cp_size > 1:
        n = mb.positions.numel()
        counts = (n,) * mb.cp_size if mb.tree is None else mb.tree.flat_counts
        mine = torch.zeros((2, max(counts)), dtype=torch.int64)
        mine[0, :n] = mb.positions
        mine[1, :n] = values.to(torch.int64)
        parts = [torch.empty_like(mine) for _ in range(mb.cp_size)]
        dist.all_gather(parts, mine, group=cp_group)
        for part, count in zip(parts, counts, strict=True):
            row[part[0, :count]] = part[1, :count]
    else:
        row[mb.positions] = values.to(torch.int64)
    return row


def _samples(mb: TensorMicroBatch, row: torch.Tensor) -> list[torch.Tensor]:
    starts = mb.cu_seqlens.tolist()
    return [row[starts[i] : starts[i] + int(n)] for i, n in enumerate(mb.seq_lens.tolist())]


def sample_fingerprints(mb: TensorMicroBatch, cp_group: dist.ProcessGroup | None) -> list[str]:
    """The fingerprints of ``mb``'s samples (see the module doc); collective over ``cp_group``."""
    row = whole_row(mb, mb.input_ids, cp_group, 0)
    if mb.cp_rank != 0:
        return []
    return [fingerprint(tokens.numpy()) for tokens in _samples(mb, row)]


def partial_rollouts(mb: TensorMicroBatch, cp_group: dist.ProcessGroup | None) -> list[dict]:
    """The samples of ``mb`` holding tokens of two or more policy versions (see the module
    doc), from cp rank 0; collective over ``cp_group`` when ``mb`` carries versions."""
    if mb.versions is None:
        return []
    tokens = whole_row(mb, mb.input_ids, cp_group, 0)
    versions = whole_row(mb, mb.versions, cp_group, -1)
    if mb.cp_rank != 0:
        return []
    out = []
    for ids, v in zip(_samples(mb, tokens), _samples(mb, versions), strict=True):
        if len(set(v[v >= 0].tolist())) > 1:
            out.append({"sample": fingerprint(ids.numpy()), "versions": v.tolist()})
    return out


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The SHA-256 of a full state dict (see the module doc), as hex."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

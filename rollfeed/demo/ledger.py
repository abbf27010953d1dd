"""What the demo trainer records of each step it trains, so a run can be audited from its log.

- :func:`sample_fingerprints`: the samples of one micro batch, each named by a hash of its token
  ids (:func:`fingerprint`; the whole sample, gathered over the ``cp`` group, reported by
  ``cp`` rank 0 only), so a step's record says which samples it trained and an audit matches them
  with the step files' samples (a multiset: two samples of the same tokens count twice);
- :func:`weights_digest`: a SHA-256 of the model's full weights (every parameter and buffer of the
  full state dict, by name, dtype, shape and bytes), so two runs that trained the same steps from
  the same checkpoint are compared bitwise without keeping their weights.

Example: a micro batch of samples ``[5, 6, 7]`` and ``[8, 9]`` ->
``[fingerprint([5, 6, 7]), fingerprint([8, 9])]`` from cp rank 0, ``[]`` from the others.
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


def sample_fingerprints(mb: TensorMicroBatch, cp_group: dist.ProcessGroup | None) -> list[str]:
    """The fingerprints of ``mb``'s samples (see the module doc); collective over ``cp_group``."""
    row = torch.zeros(mb.seq_len, dtype=torch.int64)
    if mb.cp_size > 1:
        mine = torch.stack([mb.positions, mb.input_ids])
        parts = [torch.empty_like(mine) for _ in range(mb.cp_size)]
        dist.all_gather(parts, mine.contiguous(), group=cp_group)
        for part in parts:
            row[part[0]] = part[1]
    else:
        row[mb.positions] = mb.input_ids
    if mb.cp_rank != 0:
        return []
    starts = mb.cu_seqlens.tolist()
    return [
        fingerprint(row[starts[i] : starts[i] + int(n)].numpy())
        for i, n in enumerate(mb.seq_lens.tolist())
    ]


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The SHA-256 of a full state dict (see the module doc), as hex."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

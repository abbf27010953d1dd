"""Plain float64 reference for support scoring, and random support batches.

The reference loops over rows and treats each support row as a Python set, so it shares no code (and
no vectorised masking trick) with the library.
"""

from __future__ import annotations

import torch


def reference_scores(
    logits: torch.Tensor,
    labels: torch.Tensor,
    support: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    fallback_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp [N], entropy [N], valid [N])`` in float64, differentiable w.r.t. ``logits``.

    Rows in ``fallback_mask`` and rows whose label is missing from their support are scored over
    the full vocabulary (the ``missing_label="full_vocab"`` policy).
    """
    t = torch.as_tensor(temperature, dtype=torch.float64)
    scaled = logits.double() / (t[:, None] if t.dim() else t)
    logps, entropies, valid = [], [], []
    for n in range(scaled.shape[0]):
        ids = sorted({int(i) for i in support[n] if int(i) >= 0})
        fallback = fallback_mask is not None and bool(fallback_mask[n])
        if fallback or (ids and int(labels[n]) not in ids):
            ids = list(range(scaled.shape[1]))
        if not ids:
            logps.append(scaled[n, 0] * 0)
            entropies.append(scaled[n, 0] * 0)
            valid.append(False)
            continue
        x = scaled[n, ids]
        lse = torch.logsumexp(x, 0)
        p = torch.softmax(x, 0)
        logps.append(scaled[n, int(labels[n])] - lse)
        entropies.append(-(p * torch.log_softmax(x, 0)).sum())
        valid.append(True)
    return torch.stack(logps), torch.stack(entropies), torch.tensor(valid)


def random_batch(
    rows: int, vocab: int, *, seed: int, width: int = 9, hidden: int | None = None
) -> dict[str, torch.Tensor]:
    """Logits ``[N, V]`` (or hidden ``[N, H]`` + weight ``[V, H]``), labels, support ``[N, width]``.

    Rows mix singletons (~40%), small sets, full-width sets, an id repeated in its row, a label
    outside its support, and all-padding rows; padding is trailing ``-1``.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    if hidden is None:
        out["logits"] = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    else:
        out["hidden"] = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
        out["weight"] = (
            torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5 * 3
        )
    support = torch.full((rows, width), -1, dtype=torch.int64)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    for n in range(rows):
        kind = n % 10
        size = {0: 0, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 3, 7: width, 8: 4, 9: 5}[kind]
        ids = torch.randperm(vocab, generator=g)[:size]
        if size:
            ids[0] = labels[n]
        if kind == 8:  # a repeated id
            ids[-1] = ids[1]
        if kind == 9:  # label outside the support
            ids[0] = (labels[n] + 1) % vocab
        support[n, :size] = ids
    out["labels"] = labels
    out["support"] = support
    return out

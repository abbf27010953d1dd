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


def padded_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    padded: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    fallback_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp [N], entropy [N], kept [N, W], valid [N])``: the padded scorer's math written over
    dense ``[N, V]`` masks (float64, differentiable w.r.t. ``logits``), for parity with the ragged
    scorer. ``kept[n, k] = l_v − logsumexp_S l`` on a row's first slot of each id, ``-inf`` on
    padding, repeats and rows not scored over their support. Labels missing from their support
    make a fallback row (``missing_label="full_vocab"``)."""
    t = torch.as_tensor(temperature, dtype=torch.float64)
    scaled = logits.double() / (t[:, None] if t.dim() else t)
    rows, vocab = scaled.shape
    ids = padded.long()
    held = ids >= 0
    counts = torch.zeros(rows, vocab, dtype=torch.int64).scatter_add(
        1, ids.clamp(min=0), held.long()
    )
    in_set = counts > 0
    has = in_set.any(1)
    label_in = in_set.gather(1, labels.long()[:, None]).squeeze(1)
    fallback = torch.zeros(rows, dtype=torch.bool) if fallback_mask is None else fallback_mask
    fallback = fallback | (has & ~label_in)
    valid = has | fallback
    mask = in_set | fallback[:, None]
    # Unscored rows take the whole row (a finite lse, so no NaN gradient through the masking).
    masked = scaled.masked_fill(~(mask | ~valid[:, None]), float("-inf"))
    lse = torch.where(valid, masked.logsumexp(1), 0)
    logp = torch.where(valid, scaled.gather(1, labels.long()[:, None]).squeeze(1) - lse, 0)
    logq = torch.where(mask, scaled - lse[:, None], 0)
    entropy = torch.where(valid, -(logq.exp() * logq * mask).sum(1), 0)
    # First slot of each id in its row: no earlier slot of the row holds it.
    ordered, perm = ids.sort(dim=1, stable=True)
    repeat_sorted = torch.zeros_like(held)
    repeat_sorted[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    repeat = torch.zeros_like(held).scatter(1, perm, repeat_sorted)
    first = held & ~repeat & ~fallback[:, None]
    kept = torch.where(first, scaled.gather(1, ids.clamp(min=0)) - lse[:, None], float("-inf"))
    return logp, entropy, kept, valid


def ragged_batch(
    rows: int,
    vocab: int,
    *,
    seed: int,
    max_width: int,
    hidden: int | None = None,
    dtype: torch.dtype = torch.int64,
) -> dict:
    """Heavy-tailed kept sets as ``RaggedRows`` (key ``support``) and padded (``padded``), with
    labels and logits ``[N, V]`` (or hidden ``[N, H]`` + weight ``[V, H]``), unit scale.

    Row kinds: ~45% singletons, empty rows, log-uniform widths up to ``max_width`` (one row exactly
    ``max_width``), a row with a repeated id, a row with ``-1`` inside, a row of only ``-1``, a
    label missing from its support. The label is the first slot where it is a member.
    """
    from rollfeed.collate import RaggedRows

    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    if hidden is None:
        out["logits"] = torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    else:
        out["hidden"] = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
        out["weight"] = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    labels = torch.randint(0, vocab, (rows,), generator=g)
    values, lengths = [], []
    for n in range(rows):
        u = float(torch.rand((), generator=g))
        if n == 1:
            size = max_width
        elif u < 0.45:
            size = 1
        elif u < 0.55:
            size = 0
        else:
            size = int(torch.exp(torch.rand((), generator=g) * torch.log(torch.tensor(max_width))))
            size = max(2, min(size, max_width))
        ids = torch.randperm(vocab, generator=g)[:size]
        ids = ids[ids != labels[n]][: max(size - 1, 0)]
        row = torch.cat([labels[n : n + 1], ids]) if size else ids
        kind = n % 11
        if kind == 3 and size >= 3:
            row[-1] = row[1]  # a repeated id
        if kind == 5 and size >= 3:
            row[1] = -1  # padding inside the row
        if kind == 7:
            row = torch.full((2,), -1, dtype=torch.int64)  # a row of padding only
        if kind == 9 and size >= 2:
            row = row[1:]  # the label is missing
        values.append(row)
        lengths.append(row.numel())
    support = RaggedRows.from_lengths(torch.tensor(lengths), torch.cat(values).to(dtype))
    out.update(labels=labels, support=support, padded=support.padded(fill=-1))
    return out

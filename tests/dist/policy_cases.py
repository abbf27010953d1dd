"""Shared cases for the scorer tests: samples with masks and routing, and an independent reference.

The reference scores each sample alone with a stock HF forward (sdpa attention, the model's own
causal mask), full logits and the support formula written out in float64 — it shares no code with
the scorer except the router replay hooks (tested on their own) when routing is replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from rollfeed.collate import MicroBatch, Sample
from rollfeed.models.router_replay import RouterReplay, Routing
from tests.models.tiny import VOCAB

EXPERTS = 8


def make_samples(
    seed: int,
    lengths: list[int],
    *,
    own_routing: list[np.ndarray] | None = None,
    routing_weights: bool = False,
) -> list[Sample]:
    """Samples with a prompt (no loss, no mask), a sampled completion whose kept set holds the
    sampled token plus 0-3 others (some completion tokens without a mask), temperatures 0.7/1.0 and,
    when ``own_routing`` is given, routing ``[T, layers, top_k]`` shifted by 3 of 8 experts from the
    model's own choice on the forwarded rows (the last token has none), with random recorded
    weights if ``routing_weights``."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, T in enumerate(lengths):
        ids = rng.integers(0, VOCAB, T)
        prompt = int(rng.integers(1, max(2, T // 2)))
        loss = np.arange(T) >= prompt
        counts = np.zeros(T, np.int64)
        values: list[int] = []
        for t in range(prompt, T):
            if rng.random() < 0.15:
                continue  # a sampled token whose mask was not recorded
            extra = rng.choice(np.setdiff1d(np.arange(VOCAB), [ids[t]]), rng.integers(0, 4), False)
            row = [int(ids[t]), *map(int, extra)]
            rng.shuffle(row)
            counts[t] = len(row)
            values += row
        fields: dict = {"sampling_mask": (counts, np.asarray(values, np.int32))}
        if own_routing is not None:
            # Rows for the forwarded positions [0, T - 1): the final token has no routing row.
            fields["routed_experts"] = ((own_routing[i][:-1] + 3) % EXPERTS).astype(np.uint8)
            if routing_weights:
                shape = own_routing[i][:-1].shape  # [T - 1, layers, top_k]
                fields["routed_expert_weights"] = rng.random(shape, dtype=np.float32)
        samples.append(
            Sample(
                ids,
                loss_mask=loss,
                advantages=rng.standard_normal(T).astype(np.float32),
                inference_logprobs=-rng.random(T, dtype=np.float32),
                temperatures=rng.choice([0.7, 1.0], T).astype(np.float32),
                fields=fields,
                uid=f"s{i}",
            )
        )
    return samples


def own_routing(model, token_lists: list[np.ndarray]) -> list[np.ndarray]:
    """The model's own routing of each sample alone, ``[T, layers, top_k]``."""
    replay = RouterReplay(model)
    out = []
    for ids in token_lists:
        with torch.no_grad(), replay.recording() as rec:
            model(input_ids=torch.as_tensor(ids)[None])
        out.append(rec[0].experts.numpy())
    replay.remove()
    return out


def stock_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """One sample ``ids [T]`` alone through the model's stock forward -> logits ``[T, V]``."""
    return model(input_ids=ids[None]).logits[0]


def reference(
    model,
    mb: MicroBatch,
    *,
    replay_weights: bool = False,
    forward: Callable[[object, torch.Tensor], torch.Tensor] = stock_forward,
    route: Callable[[object, Routing], AbstractContextManager] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy, valid) [S]`` in row coordinates; ``model`` uses sdpa attention.
    ``replay_weights``: replay the samples' recorded routing weights too. ``forward``: how one
    sample runs alone; ``route(model, routing)``: a context in which the model routes as recorded
    (default: the router replay hooks)."""
    S = mb.length
    logp = torch.zeros(S, dtype=torch.float64)
    ent = torch.zeros(S, dtype=torch.float64)
    valid = torch.zeros(S, dtype=torch.bool)
    routed = "routed_experts" in (mb.samples[0].fields or {})
    replay = None
    if routed and route is None:
        replay = RouterReplay(model, replay_weights=replay_weights)
        route = lambda _, routing: replay.replaying(routing)  # noqa: E731
    for sample, start in zip(mb.samples, mb.starts, strict=True):
        ids = torch.as_tensor(sample.token_ids)
        T = ids.numel()
        context: AbstractContextManager = nullcontext()
        if route is not None and routed:
            recorded = torch.as_tensor(sample.fields["routed_experts"])
            experts = torch.zeros((T, *recorded.shape[1:]), dtype=recorded.dtype)
            experts[: len(recorded)] = recorded
            weights = None
            if replay_weights:
                weights = torch.zeros(experts.shape, dtype=torch.float32)
                weights[: len(recorded)] = torch.as_tensor(sample.fields["routed_expert_weights"])
            covered = torch.arange(T) < len(recorded)
            context = route(model, Routing(experts=experts, covered=covered, weights=weights))
        with context:
            logits = forward(model, ids).double()
        counts, values = sample.fields["sampling_mask"]
        offsets = np.concatenate([[0], np.cumsum(counts)])
        temps = torch.as_tensor(sample.temperatures).double()
        rows_lp, rows_ent, rows = [], [], []
        for j in range(T - 1):
            kept = values[offsets[j + 1] : offsets[j + 2]]
            if len(kept) == 0:
                continue
            scaled = logits[j] / temps[j + 1]
            sup = scaled[torch.as_tensor(kept, dtype=torch.long)]
            lse = torch.logsumexp(sup, 0)
            p = torch.exp(sup - lse)
            rows_lp.append(scaled[ids[j + 1]] - lse)
            rows_ent.append(-(p * (sup - lse)).sum())
            rows.append(start + j)
        if rows:
            index = torch.as_tensor(rows)
            logp = logp.index_put((index,), torch.stack(rows_lp))
            ent = ent.index_put((index,), torch.stack(rows_ent))
            valid[index] = True
    if replay is not None:
        replay.remove()
    return logp, ent, valid


def loss_weights(S: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, S, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

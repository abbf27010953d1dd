"""Kept sets as ``{id: logprob}`` per completion token, from the payload and from vLLM's
standard ``/v1/completions`` endpoint, for comparisons between the two."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import torch

from rollfeed.payload import read_fields

CUT = -9999.0  # vLLM's endpoints clamp -inf (an id the sampler's filters removed) to -9999


def read_kept(segments, root, lo, hi, sampled) -> list[dict[int, np.float32]]:
    """``{id: float32 logprob}`` of the kept set at each position of ``[lo, hi)``, read back.

    ``sampled``: the sampled token of each position; the mask stores its ids without it, and
    the read puts it back first in each recorded row, where its logprob row holds its logprob.
    """
    windows = {"sampling_mask": (lo, hi), "sampling_mask_logprobs": (lo, hi)}
    labels = {"sampling_mask": np.asarray(sampled, np.int64)}
    got = read_fields(segments, windows, root=root, labels=labels)
    ids, lps = got["sampling_mask"].values, got["sampling_mask_logprobs"].values
    assert lps.dtype == torch.float32 and torch.equal(ids.offsets, lps.offsets)
    out = []
    for a, b in zip(ids.offsets[:-1].tolist(), ids.offsets[1:].tolist(), strict=True):
        row_ids, row_lps = ids.values[a:b].tolist(), lps.values[a:b].numpy()
        assert len(set(row_ids)) == len(row_ids)
        out.append({int(t): np.float32(lp) for t, lp in zip(row_ids, row_lps, strict=True)})
    return out


def completions_call(url, model, prompt_ids, sampling, logprobs):
    """vLLM's ``/v1/completions`` on token ids, ``logprobs`` entries per token, as token ids."""
    body = dict(sampling, model=model, prompt=list(prompt_ids), logprobs=logprobs)
    body["return_tokens_as_token_ids"] = True
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _tid(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.split(":", 1)[1])


def completions_kept(choice) -> tuple[list[int], list[dict[int, np.float32]], list[np.float32]]:
    """``(sampled ids, kept sets, sampled logprobs)`` of one ``/v1/completions`` choice."""
    lp = choice["logprobs"]
    ids = [_tid(t) for t in lp["tokens"]]
    kept = [
        {_tid(t): np.float32(v) for t, v in row.items() if v > CUT} for row in lp["top_logprobs"]
    ]
    return ids, kept, [np.float32(v) for v in lp["token_logprobs"]]

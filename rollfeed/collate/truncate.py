"""Truncation: cut every per-token stream and every segment of a sample at one position.

Worked example (T = 5 cut at 3; a mask segment at positions 2..4)::

    token_ids [1, 2, 3, 4, 5] -> [1, 2, 3]; ragged counts [0, 0, 2, 1, 1] -> [0, 0, 2]
    segment pos=2, rows=3 -> pos=2, rows=1   (clip_segments: metadata only, no I/O)
"""

from __future__ import annotations

from dataclasses import replace

from rollfeed.collate.sample import Sample
from rollfeed.payload import clip_segments


def truncate_sample(sample: Sample, length: int) -> Sample:
    """The first ``length`` tokens of ``sample`` (the sample itself when it is no longer)."""
    if len(sample) <= length:
        return sample
    fields = {}
    for name, data in sample.fields.items():
        if isinstance(data, tuple):
            counts = data[0][:length]
            fields[name] = (counts, data[1][: int(counts.sum())])
        else:
            fields[name] = data[:length]
    cut = None if sample.temperatures is None else sample.temperatures[:length]
    return replace(
        sample,
        token_ids=sample.token_ids[:length],
        loss_mask=sample.loss_mask[:length],
        advantages=sample.advantages[:length],
        inference_logprobs=sample.inference_logprobs[:length],
        temperatures=cut,
        fields=fields,
        payload=clip_segments(sample.payload, 0, length),
    )

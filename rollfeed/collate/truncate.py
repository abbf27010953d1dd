"""Truncation: cut every per-token stream, every segment, the images and the policy version spans
of a sample at one position.

Images whose placeholder run ends at or before the cut stay; a cut inside a run is refused (the
planner cuts before such an image: :mod:`rollfeed.collate.image_runs`).

Worked example (T = 5 cut at 3; a mask segment at positions 2..4)::

    token_ids [1, 2, 3, 4, 5] -> [1, 2, 3]; ragged counts [0, 0, 2, 1, 1] -> [0, 0, 2]
    segment pos=2, rows=3 -> pos=2, rows=1   (clip_segments: metadata only, no I/O)
    version spans [[1, 2, 7], [2, 5, 8]] -> [[1, 2, 7], [2, 3, 8]]
"""

from __future__ import annotations

from dataclasses import replace

from rollfeed.collate.errors import SampleLengthError
from rollfeed.collate.image_runs import image_cut
from rollfeed.collate.sample import Sample
from rollfeed.collate.versions import clip_version_spans
from rollfeed.payload import clip_segments


def truncate_sample(sample: Sample, length: int) -> Sample:
    """The first ``length`` tokens of ``sample`` (the sample itself when it is no longer)."""
    if len(sample) <= length:
        return sample
    if image_cut(sample.images, length) != length:
        raise SampleLengthError(
            f"a cut at {length} splits an image's placeholder run; cut before the image "
            f"(at {image_cut(sample.images, length)})",
            sample=sample.uid,
            field="images",
            pos=length,
        )
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
        images=[im for im in sample.images if im.end <= length],
        version_spans=clip_version_spans(sample.version_spans, length),
    )

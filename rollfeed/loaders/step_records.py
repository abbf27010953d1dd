"""A :class:`~rollfeed.collate.Sample` as a step record and back: what each of its parts becomes.

A step record (:class:`~rollfeed.payload.StepRecord`) knows token ids, a mask, named columns,
texts and segment records; this is where a sample's parts get their names:

- ``token_ids`` -> the record's ids (stored at the narrowest unsigned dtype holding the largest,
  or at the one a writer's ``vocab_size`` calls for), ``loss_mask`` -> its mask (stored as runs;
  the step's index repeats them for planning);
- ``advantages``, ``inference_logprobs`` and, when given, ``temperatures`` -> float32 columns of
  those names (an advantage the same for every token is stored once);
- an inline field ``name`` -> the column ``field:name`` (fixed width ``[R, *shape]``), or the two
  columns ``field:name:counts`` and ``field:name:values`` (ragged);
- ``uid`` -> the text ``uid``; ``payload`` -> the segment records, as they are;
- ``images`` (:class:`~rollfeed.payload.ImageSpan`) -> the record's marked spans (each image's
  placeholder run, which the index repeats so that a planner never cuts inside an image) and the
  text ``images``, the image records as JSON (a handle or inline bytes each);
- ``version_spans`` (:mod:`rollfeed.collate.versions`) -> the column ``version_spans``, ``[K, 3]``
  ``(start, end, version)`` rows (stored at the narrowest integer dtype: 3 bytes a span for
  versions below 256 in a sample below 256 tokens), absent when the sample has none; the index's
  policy version is their oldest (:func:`record_policy_version`).

A record holding a column or text of another name is not a sample's: ``ValueError`` naming
it (the reader adds the file, step and sample); so is one whose index row's policy version is not
the oldest of its version spans. The record's group id and shared prefix are the step index's,
not the sample's (:class:`~rollfeed.loaders.step_files.StepWriter`).

Example::

    sample_record(Sample([5, 6, 7], loss_mask=[0, 1, 1], advantages=[0.5] * 3,
                         inference_logprobs=[0.0, -0.7, -0.1], uid="a"))
    -> StepRecord(ids=[5, 6, 7], mask=[F, T, T], columns={"advantages": ..., "inference_logprobs":
       ...}, texts={"uid": "a"})
"""

from __future__ import annotations

import json

import numpy as np

from rollfeed.collate import Sample, oldest_version
from rollfeed.payload import ImageSpan, StepRecord

_ARRAYS = ("advantages", "inference_logprobs", "temperatures")
_FIELD = "field:"
VERSIONS = "version_spans"  # the column of a sample's version spans


def record_policy_version(sample: Sample, given: int | None = None) -> int | None:
    """The index's policy version of ``sample``: the oldest of its version spans. A sample
    without spans may be given one for all its tokens (``given``: the step an orchestrator knows
    it came from); one that has spans takes theirs, and a ``given`` other than their oldest is a
    ``ValueError``."""
    oldest = oldest_version(sample.version_spans)
    if oldest is not None and given is not None and given != oldest:
        raise ValueError(
            f"policy_version={given} is not the oldest version of the sample's version spans "
            f"({oldest}); leave it out: a sample with version spans gives its own"
        )
    return oldest if oldest is not None else given


def sample_record(
    sample: Sample,
    *,
    group: str | None = None,
    shared_prefix: int = 0,
    policy_version: int | None = None,
) -> StepRecord:
    """``sample`` as a step record (module doc); ``policy_version``: see
    :func:`record_policy_version`. A sample with images claims no shared prefix (they are not
    packed as trees: the planner would refuse the step), so one given is ``ValueError``."""
    if shared_prefix and sample.images:
        raise ValueError(
            f"a sample with images is not packed as a tree, so it claims no shared prefix (got "
            f"shared_prefix={shared_prefix}); write it with shared_prefix=0 (its group may stay)"
        )
    columns: dict[str, np.ndarray] = {
        name: value for name in _ARRAYS if (value := getattr(sample, name)) is not None
    }
    if len(sample.version_spans):
        columns[VERSIONS] = sample.version_spans
    for name, data in sample.fields.items():
        if isinstance(data, tuple):
            columns[f"{_FIELD}{name}:counts"], columns[f"{_FIELD}{name}:values"] = data
        else:
            columns[f"{_FIELD}{name}"] = data
    texts = {} if sample.uid is None else {"uid": sample.uid}
    if sample.images:
        texts["images"] = json.dumps([im.model_dump(mode="json") for im in sample.images])
    return StepRecord(
        ids=sample.token_ids,
        mask=sample.loss_mask,
        columns=columns,
        texts=texts,
        segments=sample.payload,
        spans=np.array([(im.start, im.end) for im in sample.images], np.int64).reshape(-1, 2),
        policy_version=record_policy_version(sample, policy_version),
        group=group,
        shared_prefix=shared_prefix,
    )


def record_sample(record: StepRecord) -> Sample:
    """The sample of ``record``; ``ValueError`` for parts no sample has, and the sample's own
    typed errors (:mod:`rollfeed.collate.errors`) for values it refuses."""
    columns = dict(record.columns)
    arrays = {name: columns.pop(name, None) for name in _ARRAYS}
    versions = columns.pop(VERSIONS, None)
    fields: dict[str, object] = {}
    for key in sorted(columns):
        if not key.startswith(_FIELD):
            raise ValueError(f"a column {key!r} that no sample has")
        name = key[len(_FIELD) :]
        if name.endswith(":values"):
            continue
        if name.endswith(":counts"):
            base = name.removesuffix(":counts")
            values = columns.get(f"{_FIELD}{base}:values")
            if values is None:
                raise ValueError(f"field {base!r} has row counts but no values")
            fields[base] = (columns[key], values)
        else:
            fields[name] = columns[key]
    lone = [k for k in columns if k.endswith(":values") and k[len(_FIELD) : -7] not in fields]
    other = sorted(set(record.texts) - {"uid", "images"})
    if lone or other:
        raise ValueError(f"columns {lone} or texts {other} that no sample has")
    for name in ("advantages", "inference_logprobs"):
        if arrays[name] is None:
            raise ValueError(f"no {name} column")
    sample = Sample(
        record.ids,
        loss_mask=record.mask,
        advantages=arrays["advantages"],
        inference_logprobs=arrays["inference_logprobs"],
        temperatures=arrays["temperatures"],
        fields=fields,  # type: ignore[arg-type]
        payload=record.segments,
        images=_images(record),
        version_spans=versions,
        uid=record.texts.get("uid"),
    )
    oldest = oldest_version(sample.version_spans)
    if oldest is not None and oldest != record.policy_version:
        raise ValueError(
            f"the index gives the record policy version {record.policy_version}, the oldest of "
            f"its version spans is {oldest}: the index is not its record's"
        )
    return sample


def _images(record: StepRecord) -> list[ImageSpan]:
    """The record's image records, each one's placeholder run held to its marked span."""
    text = record.texts.get("images")
    images = [] if text is None else json.loads(text)
    if not isinstance(images, list):
        raise ValueError("the images text is not a list of image records")
    out = [ImageSpan.parse(im) for im in images]
    runs = np.array([(im.start, im.end) for im in out], np.int64).reshape(-1, 2)
    if not np.array_equal(runs, np.asarray(record.spans).reshape(-1, 2)):
        raise ValueError(
            f"the image records' placeholder runs {runs.tolist()} are not the record's marked "
            f"spans {np.asarray(record.spans).tolist()}"
        )
    return out

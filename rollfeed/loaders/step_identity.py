"""StepIdentity: which samples a step holds, by content, so a saved count is held to its samples.

A state saved mid-step says "3 micro batches of step 7 consumed": micro batches of the plan of
step 7's samples *as they were*. Were the step file rewritten before the resume (other samples,
fewer, the same number with other content), the same count would skip samples never trained on,
or run past the new plan and train on nothing. So the state carries the identity of the samples it
counted in: how many, their tokens, and a digest of each sample's token count and content hash
(the step index's ``tokens`` and ``crc32c`` of each record, :mod:`rollfeed.payload.format.
step_layout`), in file order::

    StepIdentity.of(np.array([3, 5]), np.array([938304012, 2867502917]))
    -> StepIdentity(samples=2, tokens=8, digest="<32 hex digits>")
    str(identity) -> "2 samples, 8 tokens, digest 3fa1c2d04b5e"

It is the content, not the step file's inode or modification time (its
:class:`~rollfeed.loaders.step_version.StepVersion`, which a plan carries for the reads of one
pass): a run directory copied to another machine or restored from a backup resumes, and so does a
step written again with the very same samples (a record's bytes are a function of its sample).
An in-memory list's identity is taken from its samples' token counts and token ids (the list is
the caller's and has no records). A state saved mid-step over a JSON-lines step file meets other
bytes in its converted step record file: it is refused as a rewritten step (or its ``on_reshard``
policy applies); one saved at a step boundary resumes.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from rollfeed.collate import Sample
from rollfeed.loaders.errors import LoaderStateError

_HEX = re.compile(r"^[0-9a-f]{32}$")
_KEYS = ("samples", "tokens", "digest")
# What a state at a step boundary holds: no samples counted. Always a dict of the same keys, so
# the state keeps one structure (a DCP checkpoint loads into a state of the same structure).
NO_SAMPLES: dict[str, Any] = {"samples": 0, "tokens": 0, "digest": ""}


@dataclass(frozen=True, kw_only=True, slots=True)
class StepIdentity:
    """A step's samples by content; see the module doc."""

    samples: int
    tokens: int
    digest: str

    @classmethod
    def of(cls, lengths: np.ndarray, hashes: np.ndarray) -> StepIdentity:
        """The identity of samples of ``lengths [n]`` tokens and content ``hashes [n]`` (each a
        CRC-32C, in ``[0, 2**32)``), in step order."""
        blob = np.asarray(lengths, "<i8").tobytes() + np.asarray(hashes, "<u4").tobytes()
        digest = hashlib.blake2b(blob, digest_size=16).hexdigest()
        return cls(samples=len(lengths), tokens=int(np.sum(lengths)), digest=digest)

    @classmethod
    def of_samples(cls, samples: Sequence[Sample]) -> StepIdentity:
        """An in-memory list's identity: token counts and a CRC-32C of each one's token ids."""
        lengths = np.fromiter((len(s) for s in samples), np.int64, len(samples))
        ids = (np.ascontiguousarray(s.token_ids, "<i8") for s in samples)
        return cls.of(lengths, np.fromiter(map(crc32c.crc32c, ids), np.int64, len(samples)))

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _KEYS}

    @classmethod
    def from_dict(cls, value: object) -> StepIdentity | None:
        """A state's ``data`` entry (``None`` for :data:`NO_SAMPLES`); :class:`LoaderStateError`
        unless it is what :meth:`to_dict` gives or :data:`NO_SAMPLES`."""
        ok = isinstance(value, Mapping) and set(value) == set(_KEYS)
        if ok:
            assert isinstance(value, Mapping)
            counts, digest = (value["samples"], value["tokens"]), value["digest"]
            ok = all(type(v) is int and 0 <= v < 1 << 62 for v in counts)
            ok = ok and isinstance(digest, str) and bool(_HEX.match(digest) or digest == "")
            if ok and digest == "":
                if counts == (0, 0):
                    return None
                ok = False
        if not ok:
            raise LoaderStateError(
                f"sampler state data must be {{'samples': int, 'tokens': int, 'digest': 32 hex "
                f"digits}}, or {NO_SAMPLES} at a step boundary, got {value!r}; pass the dict "
                "that state_dict() returned"
            )
        assert isinstance(value, Mapping)
        return cls(samples=value["samples"], tokens=value["tokens"], digest=value["digest"])

    def __str__(self) -> str:
        return f"{self.samples} samples, {self.tokens} tokens, digest {self.digest[:12]}"

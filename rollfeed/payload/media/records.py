"""Media records: a content-addressed handle to encoded media bytes, and one image of a sample.

:class:`MediaRef` names bytes stored once under the payload root, at ``media/<sha256>`` (the
lowercase hex SHA-256 of the bytes, :func:`media_file`): the same image written by any writer of
any step lands under the same name, so a GRPO group of 16 samples sharing one image stores it
once, and a name is never written twice (:mod:`rollfeed.payload.media.store`)::

    MediaRef(sha256="9f86d0...", size=5310)   ->   <root>/media/9f86d0...

:class:`ImageSpan` is one image of a sample: the run of placeholder tokens that stands for it in
the sample's ``token_ids`` (``[start, start + tokens)``), the patch grid ``(t, h, w)`` the
model's image processor made of it (``image_grid_thw``; an image has ``t == 1``), the encoded
bytes by handle (``media``) or inline (``data``, base64 in JSON), and the SHA-256 of the
processor settings that made the grid (``processor``, :class:`~rollfeed.payload.media.processor.
ImageProcessorSpec`). The placeholder run is the grid merged ``merge x merge``:
``tokens * merge**2 == h * w``, which fixes ``merge`` (:attr:`ImageSpan.merge`) from the record
itself. Worked example (a 32 x 48 pixel image, patch 8, merge 2: a 4 x 6 patch grid, 6 tokens)::

    ImageSpan(start=3, tokens=6, grid=(1, 4, 6), media=MediaRef(...), processor="c0ffee...")
    span.end == 9, span.merge == 2, span.llm_grid == (1, 2, 3)

Records are frozen and validated however they are made; a malformed one is a
:class:`~rollfeed.payload.errors.PayloadMediaError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from rollfeed.payload.errors import PayloadMediaError

MEDIA_DIR = "media"
_SHA = re.compile(r"^[0-9a-f]{64}$")


def media_file(sha256: str) -> str:
    """The handle of media bytes with this digest: ``media/<sha256>``."""
    return f"{MEDIA_DIR}/{sha256}"


class _Record(BaseModel):
    """A frozen record; a malformed one (constructed or parsed) is a :class:`PayloadMediaError`."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64"
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise _typed(type(self), err) from None

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Any:
        """A copy with ``update`` applied, checked as a new record (pydantic's own copy checks
        nothing)."""
        if not update:
            return super().model_copy(deep=deep)
        return type(self)(**{**self.__dict__, **update})

    @classmethod
    def from_json(cls, text: str | bytes) -> Any:
        try:
            return cls.model_validate_json(text)
        except ValidationError as err:
            raise _typed(cls, err) from None

    @classmethod
    def parse(cls, data: Any) -> Any:
        """A record from its JSON form (``model_dump(mode="json")``: bytes as base64)."""
        if isinstance(data, cls):
            return data
        try:
            text = json.dumps(data)
        except (TypeError, ValueError) as err:
            raise PayloadMediaError(f"malformed {cls.__name__} record: {err}") from None
        return cls.from_json(text)


def _typed(cls: type, err: ValidationError) -> PayloadMediaError:
    """The record's own :class:`PayloadMediaError` when a check of ours failed, else one that
    carries pydantic's account of the malformed value."""
    for problem in err.errors():
        found = (problem.get("ctx") or {}).get("error")
        if isinstance(found, PayloadMediaError):
            return found
    return PayloadMediaError(f"malformed {cls.__name__} record: {err}")


class MediaRef(_Record):
    """Bytes stored once at ``media/<sha256>``: their digest and length."""

    sha256: str
    size: StrictInt

    def model_post_init(self, _: Any) -> None:
        if not _SHA.match(self.sha256) or self.size < 0:
            raise PayloadMediaError(
                f"a media handle is a lowercase hex SHA-256 (64 digits) and a size >= 0, got "
                f"{self.sha256!r:.80} and {self.size}"
            )

    @property
    def file(self) -> str:
        return media_file(self.sha256)

    @classmethod
    def of(cls, data: bytes | memoryview) -> MediaRef:
        """The handle ``data`` is stored under."""
        return cls(sha256=hashlib.sha256(data).hexdigest(), size=len(data))


class ImageSpan(_Record):
    """One image of a sample and its placeholder run; see the module doc."""

    start: StrictInt
    tokens: StrictInt
    grid: tuple[StrictInt, StrictInt, StrictInt]
    media: MediaRef | None = None
    data: bytes | None = None
    processor: str | None = None

    def model_post_init(self, _: Any) -> None:
        t, h, w = self.grid
        why = None
        if self.start < 0 or self.tokens < 1:
            why = f"start {self.start} must be >= 0 and tokens {self.tokens} >= 1"
        elif t != 1 or h < 1 or w < 1:
            why = f"an image's grid is (1, h, w) with h, w >= 1, got {self.grid}"
        elif (self.media is None) == (self.data is None):
            why = "give the image's bytes by handle (media) or inline (data), exactly one"
        elif self.processor is not None and not _SHA.match(self.processor):
            why = f"processor must be the SHA-256 of processor settings, got {self.processor!r:.80}"
        elif _merge(h * w, self.tokens, h, w) is None:
            why = (
                f"{self.tokens} placeholder tokens cannot stand for a {h} x {w} patch grid: "
                "tokens * merge**2 must equal h * w with merge dividing h and w"
            )
        if why is not None:
            raise PayloadMediaError(f"image record: {why}", pos=self.start)

    @property
    def end(self) -> int:
        """One past the last placeholder token."""
        return self.start + self.tokens

    @property
    def merge(self) -> int:
        """Patches merged per side into one token (the vision tower's spatial merge size)."""
        _, h, w = self.grid
        merge = _merge(h * w, self.tokens, h, w)
        assert merge is not None  # checked on construction
        return merge

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        """The grid of placeholder tokens ``(t, h / merge, w / merge)``."""
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge

    @property
    def patches(self) -> int:
        """Rows of the processed ``pixel_values`` (``t * h * w``)."""
        return math.prod(self.grid)

    def shifted(self, delta: int) -> ImageSpan:
        """The same image at ``start + delta`` (row coordinates of a packed micro batch)."""
        return self if delta == 0 else self.model_copy(update={"start": self.start + delta})

    @property
    def key(self) -> tuple[str, tuple[int, int, int]]:
        """What makes two images the same vision input: their bytes and grid."""
        sha = self.media.sha256 if self.media is not None else MediaRef.of(self.data or b"").sha256
        return sha, self.grid


def _merge(area: int, tokens: int, h: int, w: int) -> int | None:
    """The merge size ``m`` with ``tokens * m * m == area`` and ``m | h``, ``m | w``, or None."""
    if area % tokens:
        return None
    m = math.isqrt(area // tokens)
    return m if m * m * tokens == area and h % m == 0 and w % m == 0 else None

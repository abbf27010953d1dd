"""The model's image processor as a record: its settings travel, the processor is built where used.

:class:`ImageProcessorSpec` names a transformers image processor that runs on PIL (its class
name, e.g. ``"Qwen2VLImageProcessorPil"``: no torchvision) and its settings (``to_dict()``, JSON
values). It is what a rollout and a trainer must agree on: the processor's resizing fixes each
image's patch grid, hence its placeholder run and its mRoPE positions. Its digest
(:attr:`ImageProcessorSpec.sha256`, over canonical JSON) is what each
:class:`~rollfeed.payload.media.records.ImageSpan` records as ``processor``; the spec itself is
stored once, content-addressed, beside the media (``MediaWriter.put(spec.to_bytes())``).

:meth:`ImageProcessorSpec.process` decodes encoded bytes (PNG, JPEG, ... through PIL) and runs
the processor in this process (a DataLoader worker: the processor is built once per process and
kept): ``pixel_values [P, D]`` float32 (``P = t * h * w`` patches, ``D = channels *
temporal_patch * patch**2``) and the grid ``(t, h, w)``. Worked example (patch 8, merge 2, a
30 x 45 image resized to 32 x 48)::

    spec = ImageProcessorSpec.of(Qwen2VLImageProcessorPil(patch_size=8, ...))
    spec.process(png) -> ProcessedImage(pixel_values [24, 384], grid (1, 4, 6))

Bytes that do not decode, and images larger than ``MAX_IMAGE_PIXELS`` (checked from the header,
before decoding), are :class:`~rollfeed.payload.errors.PayloadMediaError`.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, PrivateAttr

from rollfeed.payload.errors import PayloadMediaError

MAX_IMAGE_PIXELS = 1 << 26  # 64 Mpixel: far above any processor's max_pixels, far below a bomb


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ProcessedImage:
    """One image as the model's vision tower takes it: ``pixel_values [P, D]`` float32 and its
    patch ``grid`` ``(t, h, w)`` with ``t * h * w == P``."""

    pixel_values: np.ndarray
    grid: tuple[int, int, int]


class ImageProcessorSpec(BaseModel):
    """A PIL image processor of transformers by class ``name`` and its ``config``; see the
    module doc."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    config: dict[str, Any]
    _built: Any = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:  # the settings, never the built processor
        if not isinstance(other, ImageProcessorSpec):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["__pydantic_private__"] = {"_built": None}  # built again where it is used
        return state

    @classmethod
    def of(cls, processor: Any) -> ImageProcessorSpec:
        """The spec of an image processor instance (its class name and ``to_dict()``)."""
        config = json.loads(json.dumps(processor.to_dict(), default=_plain))
        config.pop("image_processor_type", None)
        return cls(name=type(processor).__name__, config=config)

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no whitespace): what :attr:`sha256` digests."""
        record = {"name": self.name, "config": self.config}
        return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def merge_size(self) -> int:
        """Patches merged per side into one placeholder token."""
        return int(self.config.get("merge_size", 1))

    @property
    def patch_dim(self) -> int:
        """Values per patch row of ``pixel_values``: ``3 * temporal_patch_size * patch_size**2``."""
        config = self.config
        return 3 * int(config.get("temporal_patch_size", 1)) * int(config["patch_size"]) ** 2

    def build(self) -> Any:
        """The processor, built once in this process."""
        if self._built is None:
            import transformers
            from transformers.image_processing_backends import PilBackend

            cls = getattr(transformers, self.name, None)
            if not (isinstance(cls, type) and issubclass(cls, PilBackend)):
                raise PayloadMediaError(
                    f"image processor {self.name!r} is not a transformers image processor that "
                    "runs on PIL (e.g. Qwen2VLImageProcessorPil)"
                )
            self._built = cls(**self.config)
        return self._built

    def process(self, data: bytes, *, file: str | None = None) -> ProcessedImage:
        """Decode ``data`` and run the processor on it (see the module doc); ``file`` names the
        bytes in errors."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size
                if w * h > MAX_IMAGE_PIXELS:
                    raise PayloadMediaError(
                        f"image of {w} x {h} pixels exceeds {MAX_IMAGE_PIXELS}; nothing decoded",
                        file=file,
                    )
                img.load()
                out = self.build()(images=[img], return_tensors="np")
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
            raise PayloadMediaError(
                f"image bytes do not decode ({type(err).__name__}: {err})", file=file
            ) from None
        grid = tuple(int(v) for v in np.asarray(out["image_grid_thw"]).reshape(-1))
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        return ProcessedImage(pixel_values=pixels, grid=grid)  # type: ignore[arg-type]


def _plain(value: Any) -> Any:
    """JSON form of the few non-JSON values a processor's ``to_dict`` holds (enums, tuples)."""
    if hasattr(value, "value"):
        return value.value
    raise TypeError(f"processor setting {value!r} is not JSON")

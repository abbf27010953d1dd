"""Media by handle: encoded images stored once under the payload root, named by their digest
(:mod:`~rollfeed.payload.media.store`), the image records a sample carries
(:mod:`~rollfeed.payload.media.records`) and the model's image processor as a record
(:mod:`~rollfeed.payload.media.processor`)."""

from rollfeed.payload.media.processor import ImageProcessorSpec, ProcessedImage
from rollfeed.payload.media.records import ImageSpan, MediaRef, media_file
from rollfeed.payload.media.store import MediaWriter, read_media

__all__ = [
    "ImageProcessorSpec",
    "ImageSpan",
    "MediaRef",
    "MediaWriter",
    "ProcessedImage",
    "media_file",
    "read_media",
]

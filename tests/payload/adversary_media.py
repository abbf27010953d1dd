"""The media family: images by handle under attack.

The oracle is the image bytes a writer stored and the processor's own output for them:

- stored media files flipped, cut, grown, swapped for a symlink to a canary outside the root, a
  FIFO or a directory, read through their handle: the exact bytes, or a typed refusal (a changed
  byte is a digest mismatch), never the canary's bytes;
- handles with wrong digests, sizes at and past the root's output bound, negative or huge: typed;
- image records (JSON) with every field at boundary values and odd types, and samples whose image
  runs lie outside or overlap: a record that holds its own rule (``tokens * merge**2 == h * w``,
  ``t == 1``, one of handle and bytes) or a typed refusal;
- encoded images cut, flipped, emptied, or claiming 10^5 x 10^5 pixels in their header, through
  the processor: the processor's output of a decodable image (rows = its grid's patches), or a
  typed refusal, within the family's address space (nothing decoded past ``MAX_IMAGE_PIXELS``).
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from tests.payload.adversary_tally import Escaped, Tally, Wrong

CANARY = b"CANARY-outside-the-root"
RECORD_VALUES = [-1, 0, 1, 2, 3, 4, 6, 9, 2**31, 2**63, 1.5, True, None, "4", [], {}]


def _png(rng: np.random.Generator, h: int, w: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` pixels, with one tiny IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


def _stored(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    from rollfeed.payload import MediaRef, MediaWriter, PayloadRoot, read_media

    root = workdir / "root"
    (workdir / "canary").write_bytes(CANARY)
    writer = MediaWriter(root)
    images = [_png(rng, int(rng.integers(4, 40)), int(rng.integers(4, 40))) for _ in range(12)]
    refs = [writer.put(data) for data in images]
    quick = PayloadRoot(root, retries=0)

    def read_as(ref, want):
        got = read_media(quick, ref)
        if got == CANARY or CANARY in got:
            raise Escaped("read the canary outside the root")
        if got != want:
            raise Wrong(f"read {len(got)} bytes that are not the stored image")

    for k, (ref, data) in enumerate(zip(refs, images, strict=True)):
        path = root / ref.file
        for trial in range(25):
            kind = ["flip", "cut", "grow", "same"][trial % 4]
            body = bytearray(data)
            if kind == "flip":
                at = int(rng.integers(0, len(body)))
                body[at] ^= 1 << int(rng.integers(0, 8))
            elif kind == "cut":
                body = body[: int(rng.integers(0, len(body)))]
            elif kind == "grow":
                body += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
            path.unlink()
            path.write_bytes(bytes(body))
            tally.case(f"image {k} {kind} {trial}", lambda r=ref, d=data: read_as(r, d))
        path.unlink()
        for kind in ("symlink", "fifo", "dir", "gone"):
            if kind == "symlink":
                path.symlink_to(workdir / "canary")
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "dir":
                path.mkdir()
            tally.case(f"image {k} as a {kind}", lambda r=ref, d=data: read_as(r, d))
            path.rmdir() if kind == "dir" else path.unlink(missing_ok=True)
        path.write_bytes(data)
        tally.case(f"image {k} restored", lambda r=ref, d=data: read_as(r, d), refusal_ok=False)
        for size in (0, ref.size - 1, ref.size + 1, 2**40, 2**62, -1):
            tally.case(
                f"image {k} handle of size {size}",
                lambda s=size, r=ref, d=data: read_as(MediaRef(sha256=r.sha256, size=s), d),
            )
        for sha in (ref.sha256.upper(), ref.sha256[:-1], "0" * 64, "../" + ref.sha256[3:], ""):
            tally.case(
                f"image {k} handle {sha[:12]}",
                lambda s=sha, r=ref, d=data: read_as(MediaRef(sha256=s, size=r.size), d),
            )


def _records(tally: Tally, rng: np.random.Generator) -> None:
    from rollfeed.collate import Sample
    from rollfeed.payload import ImageSpan, MediaRef

    ref = MediaRef.of(b"abc").model_dump(mode="json")
    base = {"start": 2, "tokens": 6, "grid": [1, 4, 6], "media": ref, "processor": None}

    def holds(record):
        span = ImageSpan.parse(record)
        t, h, w = span.grid
        m = span.merge
        if not (t == 1 and span.tokens * m * m == h * w and h % m == 0 and w % m == 0):
            raise Wrong(f"accepted a record breaking its rule: {span}")
        if (span.media is None) == (span.data is None) or span.start < 0:
            raise Wrong(f"accepted a record without one source or at {span.start}: {span}")

    for key in ("start", "tokens", "media", "processor", "data"):
        for value in RECORD_VALUES:
            tally.case(f"record {key}={value!r}", lambda k=key, v=value: holds({**base, k: v}))
    for grid in ([1, 4, 6], [0, 4, 6], [2, 4, 6], [1, 3, 6], [1, 4], [1, 4, 6, 1], [1, -4, -6],
                 [1, 2**40, 6], "146", None):  # fmt: skip
        for tokens in (1, 6, 9, 24, 0, -6):
            record = {**base, "grid": grid, "tokens": tokens}
            tally.case(f"record grid {grid} tokens {tokens}", lambda r=record: holds(r))
    for data in ("AP8=", "not base64!", "", 3, None):
        tally.case(
            f"record data {data!r}", lambda d=data: holds({**base, "media": None, "data": d})
        )
    tally.case("record extra key", lambda: holds({**base, "colour": "red"}))
    tally.case(
        "record missing start", lambda: holds({k: v for k, v in base.items() if k != "start"})
    )
    tally.case("record not a dict", lambda: holds([1, 2, 3]))

    def sample(starts, T):
        images = [{**base, "start": s} for s in starts]
        record = {"token_ids": list(range(T)), "loss_mask": [1] * T, "advantages": [0.0] * T,
                  "inference_logprobs": [0.0] * T, "images": images}  # fmt: skip
        s = Sample.from_json(json.dumps(record))
        ends = [im.end for im in s.images]
        pairs = zip(s.images, s.images[1:], strict=False)
        if any(e > T for e in ends) or any(b.start < a.end for a, b in pairs):
            raise Wrong(f"a sample accepted image runs {[(im.start, im.end) for im in s.images]}")

    for _ in range(120):
        T = int(rng.integers(1, 30))
        starts = sorted(rng.integers(-2, 32, int(rng.integers(0, 4))).tolist())
        if rng.random() < 0.3:
            starts = starts[::-1]
        tally.case(f"sample T={T} image starts {starts}", lambda s=starts, t=T: sample(s, t))


def _decoded(tally: Tally, rng: np.random.Generator) -> None:
    import math

    from transformers import Qwen2VLImageProcessorPil

    from rollfeed.payload import ImageProcessorSpec

    processor = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, max_pixels=48 * 48)
    spec = ImageProcessorSpec.of(processor)

    def processes(data):
        got = spec.process(data)
        if got.pixel_values.shape != (math.prod(got.grid), spec.patch_dim) or got.grid[0] != 1:
            raise Wrong(f"processed to {got.pixel_values.shape} for grid {got.grid}")

    for k in range(8):
        data = _png(rng, int(rng.integers(1, 60)), int(rng.integers(1, 60)))
        tally.case(f"png {k} whole", lambda d=data: processes(d), refusal_ok=False)
        for trial in range(12):
            body = bytearray(data)
            if trial % 3 == 0:
                body = body[: int(rng.integers(0, len(body)))]
            else:
                for at in rng.integers(0, len(body), 1 + trial % 3):
                    body[at] = int(rng.integers(0, 256))
            tally.case(f"png {k} mutated {trial}", lambda b=bytes(body): processes(b))
    for w, h in ((100_000, 100_000), (2**31 - 1, 1), (1, 2**31 - 1), (0, 5), (9000, 9000)):
        tally.case(f"png header {w}x{h}", lambda a=w, b=h: processes(_bomb_png(a, b)))
    for data in (b"", b"\x89PNG", b"GIF89a" + bytes(20), os.urandom(64), b"BM" + bytes(60)):
        tally.case(f"bytes {data[:8]!r}", lambda d=data: processes(d))


def family_media(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """Stored media, handles, records and encoded images (see the module doc)."""
    _stored(tally, workdir, rng)
    _records(tally, rng)
    _decoded(tally, rng)

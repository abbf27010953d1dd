"""Media by handle: encoded images stored once under the payload root, named by their SHA-256,
read back whole and checked; image records; the image processor as a record."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
from PIL import Image

from rollfeed.payload import (
    PayloadMissingFileError,
    PayloadOutputBoundError,
    PayloadPathError,
    PayloadRoot,
    PayloadTruncatedError,
)
from rollfeed.payload.errors import PayloadMediaError
from rollfeed.payload.media import (
    ImageProcessorSpec,
    ImageSpan,
    MediaRef,
    MediaWriter,
    read_media,
)


def png(seed: int, shape=(30, 45)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def disk_bytes(root) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def test_a_group_of_16_samples_sharing_one_image_stores_its_bytes_once(tmp_path):
    image = png(0)
    writer = MediaWriter(tmp_path)
    refs = [writer.put(image) for _ in range(16)]
    assert len(set(refs)) == 1 and refs[0].size == len(image)
    assert disk_bytes(tmp_path) == len(image)  # counted once, nothing beside it
    assert writer.metrics == {
        "media_puts": 16,
        "media_stored": 1,
        "media_present": 0,
        "media_repeated": 15,
        "media_bytes_stored": len(image),
    }
    assert read_media(tmp_path, refs[0]) == image


def test_another_writer_finds_the_image_by_name_and_never_rewrites_it(tmp_path):
    image = png(1)
    ref = MediaWriter(tmp_path).put(image)
    path = tmp_path / ref.file
    before = os.stat(path)
    other = MediaWriter(PayloadRoot(tmp_path))
    assert other.put(image) == ref
    assert other.metrics["media_present"] == 1 and other.metrics["media_stored"] == 0
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert disk_bytes(tmp_path) == len(image)
    # a pickled writer (to a worker) forgets what it stored but still stores nothing twice
    clone = pickle.loads(pickle.dumps(other))
    assert clone.put(image) == ref and clone.metrics["media_present"] == 1


def test_distinct_images_are_stored_each_once(tmp_path):
    writer = MediaWriter(tmp_path)
    images = [png(k) for k in range(3)]
    refs = [writer.put(images[k % 3]) for k in range(9)]
    assert len(set(refs)) == 3
    assert disk_bytes(tmp_path) == sum(map(len, images))


def test_read_media_refuses_altered_short_missing_and_oversized_media(tmp_path):
    image = png(2)
    ref = MediaWriter(tmp_path).put(image)
    path = tmp_path / ref.file
    flipped = bytearray(image)
    flipped[len(image) // 2] ^= 1
    os.chmod(path, 0o644)
    path.write_bytes(bytes(flipped))
    with pytest.raises(PayloadMediaError, match="hash to") as err:
        read_media(tmp_path, ref)
    assert err.value.file == ref.file
    path.write_bytes(image[:-1])
    with pytest.raises(PayloadTruncatedError, match=f"says {len(image)}"):
        read_media(PayloadRoot(tmp_path, retries=0), ref)
    path.unlink()
    with pytest.raises(PayloadMissingFileError):
        read_media(PayloadRoot(tmp_path, retries=0), ref)
    with pytest.raises(PayloadOutputBoundError):
        read_media(PayloadRoot(tmp_path, max_output_bytes=len(image) - 1), ref)
    outside = tmp_path.parent / "outside"
    outside.write_bytes(image)
    path.symlink_to(outside)
    with pytest.raises(PayloadPathError, match="symlink"):
        read_media(PayloadRoot(tmp_path, retries=0), ref)


def test_object_store_media_is_stored_once_and_read_back(object_store, s3_url):
    image = png(3)
    root = PayloadRoot(s3_url, **object_store.options())
    first, second = MediaWriter(root), MediaWriter(root)
    ref = first.put(image)
    assert second.put(image) == ref
    assert (first.metrics["media_stored"], second.metrics["media_present"]) == (1, 1)
    assert read_media(root, ref) == image
    other = MediaRef.of(png(4))
    with pytest.raises(PayloadMissingFileError):
        read_media(PayloadRoot(s3_url, retries=0, **object_store.options()), other)


def test_image_records_round_trip_and_refuse_what_cannot_be(tmp_path):
    ref = MediaRef.of(b"abc")
    span = ImageSpan(start=3, tokens=6, grid=(1, 4, 6), media=ref, processor="a" * 64)
    assert (span.end, span.merge, span.llm_grid, span.patches) == (9, 2, (1, 2, 3), 24)
    assert ImageSpan.parse(span.model_dump(mode="json")) == span
    inline = ImageSpan(start=0, tokens=1, grid=(1, 1, 1), data=b"\x00\xff")
    assert ImageSpan.from_json(inline.model_dump_json()) == inline
    assert inline.shifted(7).start == 7 and inline.shifted(7).data == inline.data
    bad = [
        (dict(start=0, tokens=5, grid=(1, 4, 6), media=ref), "cannot stand for"),
        (dict(start=0, tokens=6, grid=(2, 4, 6), media=ref), r"grid is \(1, h, w\)"),
        (dict(start=-1, tokens=6, grid=(1, 4, 6), media=ref), "start -1"),
        (dict(start=0, tokens=6, grid=(1, 4, 6)), "exactly one"),
        (dict(start=0, tokens=6, grid=(1, 4, 6), media=ref, data=b"x"), "exactly one"),
        (dict(start=0, tokens=6, grid=(1, 4, 6), media=ref, processor="xyz"), "processor"),
        (dict(start=1.5, tokens=6, grid=(1, 4, 6), media=ref), "start"),
    ]
    for fields, match in bad:
        with pytest.raises(PayloadMediaError, match=match):
            ImageSpan(**fields)
    with pytest.raises(PayloadMediaError, match="SHA-256"):
        MediaRef(sha256="ABC", size=3)


def test_processor_spec_runs_the_model_processor_in_any_process():
    from transformers import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=64 * 64, patch_size=8, merge_size=2
    )
    spec = ImageProcessorSpec.of(hf)
    image = png(5)
    got = spec.process(image)
    want = hf(images=[Image.open(io.BytesIO(image))], return_tensors="np")
    assert got.pixel_values.dtype == np.float32
    assert np.array_equal(got.pixel_values, want["pixel_values"])
    assert got.grid == tuple(want["image_grid_thw"][0].tolist()) == (1, 4, 6)
    spec.build()
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec and clone.sha256 == spec.sha256 and clone._built is None
    assert np.array_equal(clone.process(image).pixel_values, got.pixel_values)
    assert ImageProcessorSpec(**{**spec.model_dump(), "config": {}}).sha256 != spec.sha256
    with pytest.raises(PayloadMediaError, match="do not decode") as err:
        spec.process(b"not an image", file="media/x")
    assert err.value.file == "media/x"
    with pytest.raises(PayloadMediaError, match="runs on PIL"):
        ImageProcessorSpec(name="AutoModel", config={}).process(image)

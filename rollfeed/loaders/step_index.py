"""Step index: a sidecar giving each sample's token count, where its line lies in the step file, a
hash of the line's bytes and where its loss tokens are.

With it, planning reads the token counts and counts the step's loss tokens without parsing the
step file, and a worker seeks to and parses only the lines of the samples it is asked for, instead
of the whole file.

Layout (version 2): ``step_000042.index.json`` beside ``step_000042.jsonl`` (:func:`index_path`),
one JSON object in UTF-8. :func:`write_step_index` writes exactly these bytes: this key order,
separators ``,`` and ``:`` with no whitespace, no newline at the end (one line; broken here for
width)::

    {"format":"rollfeed.step_index","version":2,"file_bytes":270,"lengths":[3,5],
    "offsets":[0,119],"sizes":[119,151],"lines":[1,2],"crc32c":[1754268348,2130331739],
    "loss_runs":[1,2],"loss_spans":[1,3,0,2,3,5]}

(the index of ``write_step_file(d, 0, [Sample([5, 6, 7], loss_mask=[0, 1, 1], advantages=[0] *
3, inference_logprobs=[0] * 3), Sample([8, 9, 1, 2, 3], loss_mask=[1, 1, 0, 1, 1],
advantages=[0] * 5, inference_logprobs=[0] * 5)])``)

- ``format``: the string ``"rollfeed.step_index"``; ``version``: ``2``;
- ``file_bytes``: the step file's size in bytes;
- six arrays, one entry per sample, in the step file's sample order: ``lengths`` its token count
  (``len(Sample)``), ``offsets`` the byte offset of its line, ``sizes`` the bytes of the line (its
  ``"\\n"`` included), ``lines`` its 1-based line number (blank lines hold no sample), ``crc32c``
  the CRC-32C (Castagnoli, the payload's block checksum) of the line's bytes
  ``[offset, offset + size)``, ``loss_runs`` the number of its loss runs (below);
- ``loss_spans``: the loss runs of every sample, sample after sample, each as two integers
  ``start, end``: a run is a maximal range ``[start, end)`` of token positions whose
  ``loss_mask`` is 1 (:mod:`rollfeed.collate.loss_runs`). Sample ``i``'s runs are the
  ``loss_runs[i]`` pairs after those of samples ``0 .. i - 1``, so ``loss_spans`` holds
  ``2 * sum(loss_runs)`` integers. Within a sample the runs are in token order, non-empty, inside
  the sample and apart (``0 <= start < end <= length``, each ``start`` greater than the previous
  run's ``end``): one ``loss_mask`` has exactly one such list. In the example, sample 0
  (``loss_mask [0, 1, 1]``) has the run ``[1, 3)``, sample 1 (``[1, 1, 0, 1, 1]``) ``[0, 2)``
  and ``[3, 5)``; a sample without a loss token has ``loss_runs`` 0 and no pair;
- ``image_runs`` and ``image_spans`` (only in the index of a step whose samples hold images):
  each sample's image placeholder runs (:mod:`rollfeed.collate.image_runs`), laid out as
  ``loss_runs`` and ``loss_spans`` (runs in token order, inside the sample, apart or touching),
  so a planner never cuts a sample inside an image without reading it;
- every number a JSON integer written in decimal, in ``[0, 2**62)``.

A reader accepts any JSON object with exactly these keys and values (any whitespace). The runs let
a planner count the step's loss tokens after truncation from the index alone
(:mod:`rollfeed.collate.step_counts`); a worker holds each line's ``loss_mask`` to them.

Version 1 (without ``crc32c``, ``loss_runs`` and ``loss_spans``), and version 2 without the
two loss-run arrays (as written before they were added), are not used: :func:`read_step_index`
raises :class:`StepIndexVersionError`, and a dataset treats such a step as one without an index
(its ``missing_index`` policy: parse the step file whole, with a warning and counted, taking the
runs from the parsed samples, or refuse); run :func:`build_step_index` to write the current
layout. Not rebuilt by the reader: a trainer may only read the step directory (or an object
store), and rebuilding means parsing the whole file anyway.

:func:`~rollfeed.loaders.step_files.write_step_file` writes the index first and then moves the
step file into place, so a reader that sees a step file sees its index. A step file that has none
(written by another producer) gets one from :func:`build_step_index`. Both files are opened by the
payload's open rule (:mod:`rollfeed.loaders.step_open`). The checks of an index against its file
are :mod:`rollfeed.loaders.step_index_check`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollfeed.collate import ImageRuns, LossRuns, Sample
from rollfeed.loaders.errors import StepFileError, StepIndexVersionError
from rollfeed.loaders.step_index_check import check_index
from rollfeed.loaders.step_lines import parse_sample, step_lines
from rollfeed.loaders.step_open import Pread, fd_pread, open_step, read_index_bytes
from rollfeed.payload import ImageSpan
from rollfeed.payload.format.checksum import crc

FORMAT = "rollfeed.step_index"
VERSION = 2
OLD_VERSIONS = (1,)  # indexes without a content hash per sample
ARRAYS = ("lengths", "offsets", "sizes", "lines", "crc32c")  # StepIndex's, one entry per sample
RUNS = ("loss_runs", "loss_spans")  # StepIndex.runs: counts [n], spans [2 * R]
IMAGES = ("image_runs", "image_spans")  # StepIndex.images, present when a sample has images
_MAX = 1 << 62  # bound on every index value, so that sums of two stay in int64


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepIndex:
    """Per sample ``[n]`` int64 arrays and the step file's size in bytes (see the module doc);
    ``runs``: the samples' loss runs (``loss_runs`` and ``loss_spans``); ``images``: their
    image placeholder runs, or None when no sample holds an image."""

    file_bytes: int
    lengths: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    lines: np.ndarray
    crc32c: np.ndarray
    runs: LossRuns
    images: ImageRuns | None = None

    def __len__(self) -> int:
        return len(self.lengths)


def index_of_lines(lines: list[bytes], samples: list[Sample] | tuple[Sample, ...]) -> StepIndex:
    """The index of a step file made of ``lines`` back to back (no blank line), those of
    ``samples``: what a writer knows as it writes them."""
    sizes = np.fromiter(map(len, lines), np.int64, len(lines))
    ends = np.cumsum(sizes)
    return StepIndex(
        file_bytes=int(ends[-1]) if len(ends) else 0,
        lengths=np.fromiter(map(len, samples), np.int64, len(samples)),
        offsets=ends - sizes,
        sizes=sizes,
        lines=np.arange(1, len(lines) + 1, dtype=np.int64),
        crc32c=np.fromiter(map(crc, lines), np.int64, len(lines)),
        runs=LossRuns.of_samples(samples),
        images=ImageRuns.of_samples(samples) if any(s.images for s in samples) else None,
    )


def index_path(step_path: str | os.PathLike[str]) -> Path:
    """``.../step_000042.index.json`` for ``.../step_000042.jsonl``."""
    path = Path(step_path)
    return path.with_name(f"{path.stem}.index.json")


def step_index_bytes(index: StepIndex) -> bytes:
    """The sidecar's bytes for ``index`` (the layout of the module doc)."""
    record = {"format": FORMAT, "version": VERSION, "file_bytes": int(index.file_bytes)}
    record.update({k: getattr(index, k).tolist() for k in ARRAYS})
    record.update(
        loss_runs=index.runs.counts.tolist(), loss_spans=index.runs.spans.ravel().tolist()
    )
    if index.images is not None:
        record.update(
            image_runs=index.images.counts.tolist(),
            image_spans=index.images.spans.ravel().tolist(),
        )
    return json.dumps(record, separators=(",", ":")).encode("utf-8")


def write_step_index(step_path: str | os.PathLike[str], index: StepIndex) -> Path:
    """Write ``index`` as ``step_path``'s sidecar atomically (temporary name, ``os.replace``);
    a failed write leaves no temporary file (its ``OSError`` goes on to the caller)."""
    path = index_path(step_path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(step_index_bytes(index))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_step_index(
    step_path: str | os.PathLike[str], *, size: int | None = None, pread: Pread | None = None
) -> StepIndex | None:
    """The checked index of ``step_path`` (``size``, ``pread``: of the step file version it
    is checked against, default the file at the path), or ``None`` when it has no sidecar."""
    ipath = index_path(step_path)
    text = read_index_bytes(ipath)
    if text is None:
        return None
    return step_index_from_bytes(
        text, os.fspath(step_path), os.fspath(ipath), size=size, pread=pread
    )


def step_index_from_bytes(
    text: bytes,
    step_file: str,
    where: str,
    *,
    size: int | None = None,
    pread: Pread | None = None,
) -> StepIndex:
    """The index ``text`` (read from ``where``), checked against ``step_file``: its ``size`` and
    ``pread(n, offset)`` (default: the local file's)."""
    try:
        index = _parse(text)
    except (ValueError, RecursionError) as err:
        if isinstance(err, StepIndexVersionError):
            raise StepIndexVersionError(err.message, file=where) from None
        raise StepFileError(
            f"unreadable step index ({type(err).__name__}: {err}), expected {FORMAT} version "
            f"{VERSION}; rebuild it with build_step_index or delete it",
            file=where,
        ) from None
    check_index(index, step_file, where, size=size, pread=pread)
    return index


def _parse(text: bytes) -> StepIndex:
    """The index record as a :class:`StepIndex`; ``ValueError`` for anything but JSON ints in
    ``[0, 2**62)`` where the layout has them (no floats, booleans or wrapping huge ints)."""
    if b"true" in text or b"false" in text:  # JSON booleans would pass as the ints 1 and 0
        raise ValueError("a boolean where an integer belongs")
    record = json.loads(text)
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    version = record.get("version")
    if record.get("format") == FORMAT and type(version) is int and version in OLD_VERSIONS:
        raise StepIndexVersionError(
            f"step index is version {version}, which holds no content hash of each line, so a "
            f"line rewritten in place could not be told; rebuild it (version {VERSION}) with "
            "build_step_index"
        )
    if (
        record.get("format") == FORMAT
        and type(version) is int
        and version == VERSION
        and set(record) == {*_KEYS} - {*RUNS}
    ):
        raise StepIndexVersionError(
            "step index holds no loss runs (written before they were added), so the step's "
            "loss tokens cannot be counted from it; rebuild it with build_step_index"
        )
    keys = set(record)
    if record.get("format") != FORMAT or version != VERSION or keys - {*IMAGES} != {*_KEYS}:
        got = f"{record.get('format')!r}, version {version!r}, keys {sorted(record)}"
        raise ValueError(f"format {got}")
    file_bytes = record.get("file_bytes")
    if type(file_bytes) is not int or not 0 <= file_bytes < _MAX:
        raise ValueError(f"file_bytes {file_bytes!r} is not an integer in [0, 2**62)")
    arrays = {k: _array(record, k) for k in ARRAYS}
    runs = LossRuns(**_runs(record, RUNS))
    images = ImageRuns(**_runs(record, IMAGES)) if keys & {*IMAGES} else None
    return StepIndex(file_bytes=file_bytes, runs=runs, images=images, **arrays)


def _runs(record: dict, keys: tuple[str, str]) -> dict[str, np.ndarray]:
    """``counts`` and ``spans`` of a runs pair of the record; ``ValueError`` unless the spans
    hold two integers per counted run."""
    counts, spans = (_array(record, k) for k in keys)
    pairs = len(spans) // 2  # each count at most this, so that their sum cannot wrap
    if len(spans) % 2 or (counts.size and counts.max() > pairs) or counts.sum() != pairs:
        raise ValueError(f"{keys[1]!r} holds {len(spans)} integers, not two per run of {keys[0]!r}")
    return {"counts": counts, "spans": spans}


def _array(record: dict, key: str) -> np.ndarray:
    """``record[key]`` as ``[n]`` int64, every value in ``[0, 2**62)``; else ``ValueError``."""
    values = record.get(key)
    arr = np.asarray(values) if isinstance(values, list) else None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind != "i"):
        raise ValueError(f"{key!r} is not a list of integers")
    arr = arr.astype(np.int64)
    if arr.size and not (arr.min() >= 0 and arr.max() < _MAX):
        raise ValueError(f"{key!r} holds a value outside [0, 2**62)")
    return arr


_KEYS = ("format", "version", "file_bytes", *ARRAYS, *RUNS)


def build_step_index(step_path: str | os.PathLike[str]) -> Path:
    """Index an existing step file (parses it once); returns the sidecar's path.

    For step files written without one, e.g. by another producer, or with an index of an older
    version. Overwrites a present index.
    """
    path = os.fspath(step_path)
    fd = open_step(path, what="step file")
    if fd is None:
        raise StepFileError("no step file to index", file=path)
    rows: list[tuple[int, int, int, int, int]] = []
    masks: list[np.ndarray] = []
    images: list[tuple[ImageSpan, ...]] = []
    try:
        size = os.fstat(fd).st_size
        for number, offset, line in step_lines(fd_pread(fd), size, file=path):
            if line.strip():
                sample = parse_sample(line, file=path, line_number=number)
                rows.append((len(sample), offset, len(line), number, crc(line)))
                masks.append(sample.loss_mask)
                images.append(sample.images)
    finally:
        os.close(fd)
    table = np.asarray(rows, dtype=np.int64).reshape(-1, len(ARRAYS))
    columns = {k: table[:, j] for j, k in enumerate(ARRAYS)}
    runs = ImageRuns.of_images(images) if any(images) else None
    index = StepIndex(file_bytes=size, runs=LossRuns.of_masks(masks), images=runs, **columns)
    return write_step_index(path, index)

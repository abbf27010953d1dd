"""Step index: a sidecar giving each sample's token count, where its line lies in the step file and
a hash of the line's bytes.

With it, planning reads the token counts without parsing the step file, and a worker seeks to and
parses only the lines of the samples it is asked for, instead of the whole file.

Layout (version 2): ``step_000042.index.json`` beside ``step_000042.jsonl`` (:func:`index_path`),
one JSON object in UTF-8. :func:`write_step_index` writes exactly these bytes: this key order,
separators ``,`` and ``:`` with no whitespace, no newline at the end (one line; broken here for
width)::

    {"format":"rollfeed.step_index","version":2,"file_bytes":97,"lengths":[3,5],
    "offsets":[0,41],"sizes":[41,56],"lines":[1,2],"crc32c":[938304012,2867502917]}

- ``format``: the string ``"rollfeed.step_index"``; ``version``: ``2``;
- ``file_bytes``: the step file's size in bytes;
- five arrays, one entry per sample, in the step file's sample order: ``lengths`` its token count
  (``len(Sample)``), ``offsets`` the byte offset of its line, ``sizes`` the bytes of the line (its
  ``"\\n"`` included), ``lines`` its 1-based line number (blank lines hold no sample), ``crc32c``
  the CRC-32C (Castagnoli, the payload's block checksum) of the line's bytes
  ``[offset, offset + size)``;
- every number a JSON integer written in decimal, in ``[0, 2**62)``.

A reader accepts any JSON object with exactly these keys and values (any whitespace).

Version 1 (the same without ``crc32c``) is not used: :func:`read_step_index` raises
:class:`StepIndexVersionError`, and a dataset treats such a step as one without an index (its
``missing_index`` policy: parse the step file whole, with a warning, or refuse); run
:func:`build_step_index` to write version 2. Not rebuilt by the reader: a trainer may only read
the step directory (or an object store), and rebuilding means parsing the whole file anyway.

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

from rollfeed.loaders.errors import StepFileError, StepIndexVersionError
from rollfeed.loaders.step_index_check import check_index
from rollfeed.loaders.step_lines import parse_sample, step_lines
from rollfeed.loaders.step_open import Pread, fd_pread, open_step, read_index_bytes
from rollfeed.payload.format.checksum import crc

FORMAT = "rollfeed.step_index"
VERSION = 2
OLD_VERSIONS = (1,)  # indexes without a content hash per sample
ARRAYS = ("lengths", "offsets", "sizes", "lines", "crc32c")
_MAX = 1 << 62  # bound on every index value, so that sums of two stay in int64


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepIndex:
    """Per sample ``[n]`` int64 arrays (see the module doc) and the step file's size in bytes."""

    file_bytes: int
    lengths: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    lines: np.ndarray
    crc32c: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def index_of_lines(lines: list[bytes], lengths: list[int]) -> StepIndex:
    """The index of a step file made of ``lines`` back to back (no blank line), the samples of
    ``lengths`` tokens: what a writer knows as it writes them."""
    sizes = np.fromiter(map(len, lines), np.int64, len(lines))
    ends = np.cumsum(sizes)
    return StepIndex(
        file_bytes=int(ends[-1]) if len(ends) else 0,
        lengths=np.asarray(lengths, np.int64).reshape(-1),
        offsets=ends - sizes,
        sizes=sizes,
        lines=np.arange(1, len(lines) + 1, dtype=np.int64),
        crc32c=np.fromiter(map(crc, lines), np.int64, len(lines)),
    )


def index_path(step_path: str | os.PathLike[str]) -> Path:
    """``.../step_000042.index.json`` for ``.../step_000042.jsonl``."""
    path = Path(step_path)
    return path.with_name(f"{path.stem}.index.json")


def step_index_bytes(index: StepIndex) -> bytes:
    """The sidecar's bytes for ``index`` (the layout of the module doc)."""
    record = {"format": FORMAT, "version": VERSION, "file_bytes": int(index.file_bytes)}
    record.update({k: getattr(index, k).tolist() for k in ARRAYS})
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
    if record.get("format") == FORMAT and version in OLD_VERSIONS and type(version) is int:
        raise StepIndexVersionError(
            f"step index is version {version}, which holds no content hash of each line, so a "
            f"line rewritten in place could not be told; rebuild it (version {VERSION}) with "
            "build_step_index"
        )
    if record.get("format") != FORMAT or version != VERSION or set(record) != {*_KEYS}:
        got = f"{record.get('format')!r}, version {version!r}, keys {sorted(record)}"
        raise ValueError(f"format {got}")
    file_bytes = record.get("file_bytes")
    if type(file_bytes) is not int or not 0 <= file_bytes < _MAX:
        raise ValueError(f"file_bytes {file_bytes!r} is not an integer in [0, 2**62)")
    arrays = {}
    for k in ARRAYS:
        values = record.get(k)
        arr = np.asarray(values) if isinstance(values, list) else None
        if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind != "i"):
            raise ValueError(f"{k!r} is not a list of integers")
        arr = arr.astype(np.int64)
        if arr.size and not (arr.min() >= 0 and arr.max() < _MAX):
            raise ValueError(f"{k!r} holds a value outside [0, 2**62)")
        arrays[k] = arr
    return StepIndex(file_bytes=file_bytes, **arrays)


_KEYS = ("format", "version", "file_bytes", *ARRAYS)


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
    try:
        size = os.fstat(fd).st_size
        for number, offset, line in step_lines(fd_pread(fd), size, file=path):
            if line.strip():
                sample = parse_sample(line, file=path, line_number=number)
                rows.append((len(sample), offset, len(line), number, crc(line)))
    finally:
        os.close(fd)
    table = np.asarray(rows, dtype=np.int64).reshape(-1, len(ARRAYS))
    index = StepIndex(file_bytes=size, **{k: table[:, j] for j, k in enumerate(ARRAYS)})
    return write_step_index(path, index)

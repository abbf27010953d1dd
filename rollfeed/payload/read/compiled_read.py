"""The compiled window read: the common case of :func:`~rollfeed.payload.read_fields` in one
native pass (``_window.c``), with the planned NumPy reader as its fallback and its authority.

The planned reader (:mod:`rollfeed.payload.read.fixed_read`,
:mod:`rollfeed.payload.read.ragged_read`) handles every case and names what is wrong; for a 64-file
window most of its time is per-call NumPy planning, not I/O. The compiled read takes the records,
the windows and the files as the lease opened them, and either returns every field, bitwise what
the planned reader returns, or *declines*; then the planned reader runs from the start and raises
the typed error, or handles the rare case. It declines, never guesses: a file of an earlier format
version, a checking read (``verify_checksums``), a store without file descriptors (an object
store), a fixed field with integer ids of several widths or read nowhere, a field of placeholders
only, a read large enough for the store's thread pool, and any record, file or header the planned
reader would refuse or treat specially (a stale file id, a file that may have grown, a header
that disagrees, an output past the root's
``max_output_bytes``).

The kernel is built by ``pip install`` (``setup.py``; it needs a C compiler). Where it is not
built, every read takes the planned reader; ``COMPILED`` says which is the case.

Worked example (routing ``[T, 2]`` uint8 over positions 0..4 from a record at 2..5, the mask over
1..3 from a record at 1..3)::

    read_compiled(segs, {"routed_experts": [(0, 4)], "sampling_mask": [(1, 3)]}, root, None,
                  PAYLOAD_FIELDS, {"sampling_mask": tokens})
    -> {"routed_experts": (uint8 [4, 2], bool [4]: F F T T, 0),
        "sampling_mask": ((int64 [3], int32 [nnz]), bool [2]: T T, widest)}  or None (declined)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np

from rollfeed.payload.errors import PayloadError
from rollfeed.payload.fields import PayloadField
from rollfeed.payload.format.layout import DTYPE_CODES, RAGGED_INT_DTYPES
from rollfeed.payload.root import PayloadRoot
from rollfeed.payload.segment import FLOAT_DTYPES, INTEGER_DTYPES, PayloadSegment

try:
    from rollfeed.payload.read import _window
except ImportError:  # not built (no C compiler at install, or a big-endian host)
    _window = None

COMPILED = _window is not None
_NONE = -1  # the spec's width when each field takes its widest row
_NO_LIMIT = (1 << 63) - 1


def _kernel_spec(spec: PayloadField) -> tuple[bool, int, int, bytes]:
    """``(ragged, lead, allowed, fills)`` of a field for the kernel: ``allowed`` a bit per
    dtype code a record may store (for a fixed field only those whose dtype holds an int fill,
    as the planned reader requires), ``fills`` the fill at the output dtype of each code (8 bytes
    per code, little endian; a ragged field's output is ``int32`` / ``float32``)."""
    # keyed by the fill's type too: PayloadField(fill=0) == PayloadField(fill=0.0)
    return _spec_of(spec, type(spec.fill))


@functools.cache
def _spec_of(spec: PayloadField, _fill_type: type) -> tuple[bool, int, int, bytes]:
    if spec.ragged:
        kinds = RAGGED_INT_DTYPES if spec.is_int else ("float32",)
    else:
        kinds = tuple(INTEGER_DTYPES if spec.is_int else FLOAT_DTYPES)
    fills, allowed = bytearray(8 * len(DTYPE_CODES)), 0
    for code, name in enumerate(DTYPE_CODES):
        if name not in kinds:
            continue
        out = spec.ragged_dtype if spec.ragged else np.dtype(name)
        if out.kind in "iu" and not np.iinfo(out).min <= spec.fill <= np.iinfo(out).max:
            continue
        fills[8 * code : 8 * code + out.itemsize] = np.array(spec.fill, out).tobytes()
        allowed |= 1 << code
    return spec.ragged, int(spec.label == "omitted"), allowed, bytes(fills)


def read_compiled(
    segments: Sequence[PayloadSegment],
    windows: Mapping[str, list[tuple[int, int]]],
    root: PayloadRoot,
    width: int | None,
    fields: Mapping[str, PayloadField],
    labels: Mapping[str, np.ndarray],
) -> dict[str, tuple[np.ndarray | tuple[np.ndarray, np.ndarray], np.ndarray, int]] | None:
    """Every field of ``windows`` (checked ranges) that some segment carries, as ``(values,
    coverage, widest)`` (as :class:`~rollfeed.payload.FieldRead`; a ragged field's values
    ``(offsets, values)``, which the reader pads for ``width``), or ``None`` when declined.
    ``labels``: a ``label="omitted"`` field's tokens (int32 or int64), one per window row, for
    its label slots."""
    store = root.store
    if _window is None or not store.descriptors or root.verify_checksums:
        return None
    wide = _NONE if width is None else width
    specs = []
    for name, ranges in windows.items():
        if name not in fields:
            return None
        spec = fields[name]
        n = sum(hi - lo for lo, hi in ranges)
        if spec.ragged and width is not None and n * width * 4 > root.max_output_bytes:
            return None  # the planned reader's bound error
        specs.append((name, *_kernel_spec(spec), ranges, wide, labels.get(name)))
    plan = _window.plan(segments, tuple(specs))
    if plan is None or not plan.files:
        return None
    parallel = store.threads >= 2 and len(plan.files) >= 2
    try:  # the kernel reads the lease's entries (fd and columns)
        lease = store.lease(plan.files, root.retry)
    except PayloadError:  # the planned reader opens them again, under the root's policy
        return None
    with lease:
        bound = store.parallel_min_bytes if parallel else _NO_LIMIT  # type: ignore[attr-defined]
        got = plan.read(lease.entries, bound, root.max_output_bytes)  # type: ignore[attr-defined]
    if got is None:
        return None
    out = {}
    for name, values, coverage, code, row, offsets, widest in got:
        array = np.frombuffer(values, DTYPE_CODES[code])
        if offsets is None:
            array = array.reshape(len(coverage), *row)
        else:
            array = (np.frombuffer(offsets, np.int64), array)
        out[name] = (array, np.frombuffer(coverage, bool), widest)
    return out

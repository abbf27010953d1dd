"""Writing a step record file as its records come: ``append`` each, ``close`` to commit it whole.

:class:`StepRecordWriter` streams: each :meth:`~StepRecordWriter.append` encodes one record
(:mod:`~rollfeed.payload.format.step_record_codec`) and writes it at once to the file being
written aside (``root.store.stage``: a temporary file beside the name, or memory until one PUT),
keeping only its index row; :meth:`~StepRecordWriter.close` writes the index and the footer
(:mod:`~rollfeed.payload.format.step_layout`) and puts the file under its name at once, replacing
any file there. Until then nothing under the name changes; a writer that fails or is aborted
(an exception in its ``with`` block) leaves nothing behind. Bad input is
:class:`~rollfeed.payload.errors.PayloadInputError` before anything of the record is written; a
failed write :class:`~rollfeed.payload.errors.PayloadIOError`, after which the writer is closed.

``id_dtype``: the stored dtype of every record's token ids (``"uint32"`` for a vocabulary of
151,936); by default each record's narrowest. ``fsync="always"`` makes the file durable before it
appears under its name.

Example::

    with StepRecordWriter(root, "step_000003.rfs", id_dtype="uint32") as w:
        for record in finished_rollouts():
            w.append(record)              # written now; 56 bytes of index kept
    # step_000003.rfs appears here, whole
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from rollfeed.payload.errors import PayloadInputError
from rollfeed.payload.format.checksum import crc
from rollfeed.payload.format.step_layout import (
    FILE_HEADER,
    INDEX_ROW,
    NO_POLICY_VERSION,
    file_header,
    footer,
    group_hash,
    index_bytes,
    new_file_id,
)
from rollfeed.payload.format.step_record_codec import ID_DTYPES, encode_record, mask_runs
from rollfeed.payload.root import PayloadRoot
from rollfeed.payload.step_record import StepRecord
from rollfeed.payload.stores.store import Staged


class StepRecordWriter:
    """Step record file ``rel`` of ``root``, written as its records come (see the module doc)."""

    def __init__(
        self,
        root: PayloadRoot,
        rel: str,
        *,
        id_dtype: str | None = None,
        fsync: Literal["always", "never"] = "never",
    ) -> None:
        if id_dtype is not None and id_dtype not in ID_DTYPES:
            raise PayloadInputError(f"id_dtype must be one of {ID_DTYPES}, got {id_dtype!r}")
        if fsync not in ("always", "never"):
            raise PayloadInputError(f"fsync must be 'always' or 'never', got {fsync!r}")
        self.root, self.rel, self.id_dtype, self.fsync = root, rel, id_dtype, fsync
        self.file_id = new_file_id()
        self._staged: Staged | None = None
        self._rows: list[tuple] = []
        self._spans: list[np.ndarray] = []
        self._marked: list[np.ndarray] = []
        self._at = FILE_HEADER.size
        self.closed = False

    def __enter__(self) -> StepRecordWriter:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def __len__(self) -> int:
        return len(self._rows)

    def _write(self, data: bytes) -> None:
        try:
            if self._staged is None:
                self._staged = self.root.store.stage(self.rel, fsync=self.fsync == "always")
                self._staged.write(file_header(self.file_id))
            self._staged.write(data)
        except BaseException:
            self.closed = True  # a staged file that failed has removed itself
            raise

    def append(self, record: StepRecord) -> None:
        """Encode ``record`` and write it now (module doc)."""
        if self.closed:
            raise PayloadInputError(f"append to a closed step record writer of {self.rel}")
        data = encode_record(record, id_dtype=self.id_dtype)
        version = NO_POLICY_VERSION if record.policy_version is None else record.policy_version
        shared, T = record.shared_prefix, len(record.ids)
        if type(version) is not int or not NO_POLICY_VERSION <= version < 1 << 63:
            raise PayloadInputError(f"policy_version must be None or an int >= 0, got {version!r}")
        if record.group is not None and not isinstance(record.group, str):
            raise PayloadInputError(f"group must be a string or None, got {record.group!r:.60}")
        if type(shared) is not int or not 0 <= shared <= T or (record.group is None and shared):
            raise PayloadInputError(
                f"shared_prefix must be an int in [0, {T}] (0 without a group), got {shared!r}"
            )
        runs = mask_runs(record.mask)
        marked = np.asarray(record.spans, np.int64).reshape(-1, 2)
        self._write(data)
        row = (self._at, len(data), T, crc(data), len(runs), len(marked), 0, version)
        self._rows.append((*row, group_hash(record.group), shared))
        self._spans.append(runs)
        self._marked.append(marked)
        self._at += len(data)

    def close(self) -> None:
        """Write the index and footer and put the file under its name (an empty step too)."""
        if self.closed:
            return
        rows = np.array(self._rows, INDEX_ROW) if self._rows else np.zeros(0, INDEX_ROW)
        none = np.zeros((0, 2), np.int64)
        spans = np.concatenate([none, *self._spans])
        index = index_bytes(rows, spans, np.concatenate([none, *self._marked]))
        self._write(index + footer(self._at, index, len(rows), self.file_id))
        self.closed = True
        assert self._staged is not None
        self._staged.commit()

    def abort(self) -> None:
        """Leave nothing behind (the name keeps what it held)."""
        self.closed = True
        if self._staged is not None:
            self._staged.abort()

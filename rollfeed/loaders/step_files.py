"""Step files: one step record file per training step, dropped by an orchestrator beside the
payload root.

Naming: step ``42`` lives in ``step_000042.rfs`` (:func:`step_file_name`), a step record file
(:mod:`rollfeed.payload.format.step_layout`: each sample a record of its token ids, loss mask
runs and per-token arrays at their own dtype, :mod:`rollfeed.loaders.step_records`; at the end the
index every rank plans from). The directory is a local one or an object-store prefix
(``s3://bucket/run7/steps``); both are reached through a :class:`~rollfeed.payload.PayloadRoot`'s
store.

A :class:`StepWriter` streams: an orchestrator appends each sample as its rollout finishes (it is
written at once; only its index row is kept) and ``close`` puts the file under its name whole,
replacing any file of that step (an exception inside its ``with`` block leaves nothing behind);
:func:`write_step_file` writes a list at once. A write that fails (disk full, a file size limit,
an I/O error, a store that refuses) raises :class:`StepWriteError` naming the file and leaves
nothing of it behind.

Step files of the JSON-lines format (``step_000042.jsonl`` and ``step_000042.index.json``) are not
read: a step directory holding one without its ``.rfs`` is refused naming it and the command that
converts the directory once, ``python -m rollfeed steps convert DIR``
(:mod:`rollfeed.cli.step_convert`).

Example::

    with StepWriter("/run/steps", 3, vocab_size=151_936) as w:   # token ids stored as uint32
        for sample in finished():
            w.append(sample, group="prompt-17", shared_prefix=1024)
    read_step_file("/run/steps/step_000003.rfs")  -> [Sample, ...]
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from rollfeed.collate import Sample
from rollfeed.errors import RollfeedError
from rollfeed.loaders.errors import StepFileError, StepReplacedError, StepWriteError
from rollfeed.loaders.step_records import record_sample, sample_record
from rollfeed.payload import (
    PayloadError,
    PayloadPathError,
    PayloadRoot,
    PayloadStaleFileError,
    PayloadTruncatedError,
    StepRecordError,
    StepRecordFile,
    StepRecordWriter,
)

SUFFIX = ".rfs"
STEP_STRIDE = 1 << 32  # a dataset index is step * STEP_STRIDE + sample
MAX_STEP = (1 << 31) - 1  # the largest step whose dataset indices fit int64
_NAME = re.compile(r"^step_(\d+)\.rfs$")
_JSON_NAME = re.compile(r"^step_(\d+)\.jsonl$")
_ID_DTYPES = ("uint8", "uint16", "uint32", "uint64")


def step_file_name(step: int) -> str:
    """``step_000042.rfs`` for ``step=42`` (six digits, more when needed)."""
    if step < 0:
        raise StepFileError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}{SUFFIX}"


def listing_start(step: int) -> str:
    """A name that the files of ``step`` and of every later step (``.rfs``, and ``.jsonl`` of
    the old format) sort after: a listing's ``after``
    (:meth:`~rollfeed.payload.stores.store.Store.names`).

    Names sort as text, and numbers grow past six digits: ``step_1000000.rfs`` sorts before
    ``step_999999.rfs``. So the bound is the lower of ``step``'s name and that of the first step
    with more digits than six or ``step``'s, without its suffix (a listing may hold more than the
    steps asked for, never fewer).

    Example: ``listing_start(5)`` -> ``"step_000005"``; ``listing_start(999_999)`` ->
    ``"step_1000000"`` (step 999,999's name sorts after it, as does every later step's).
    """
    wider = 10 ** max(6, len(str(step)))  # the first step whose name has more digits
    return min(step_file_name(step), step_file_name(wider)).removesuffix(SUFFIX)


def parse_step_name(name: str) -> int | None:
    """The step number of a step file name, or ``None`` for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def parse_json_step_name(name: str) -> int | None:
    """The step number of a JSON-lines step file's name (``step_000042.jsonl``), or ``None``."""
    m = _JSON_NAME.match(name)
    return int(m.group(1)) if m else None


def step_root(directory: str | os.PathLike[str], store: Mapping[str, object] | None) -> PayloadRoot:
    """The root of a step directory or prefix (``store``: endpoint and credentials of an object
    store, as :class:`~rollfeed.payload.PayloadRoot` takes them)."""
    return PayloadRoot(directory, retries=0, **(store or {}))


class StepWriter:
    """Step ``step`` of ``directory``, written as its samples come (see the module doc).

    ``vocab_size``: token ids are stored at the narrowest dtype holding ``vocab_size - 1`` (a
    larger id is refused); by default each sample's narrowest. ``store``: an object store's
    endpoint and credentials. ``fsync="always"``: durable before it appears.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        step: int,
        *,
        vocab_size: int | None = None,
        store: Mapping[str, object] | None = None,
        fsync: Literal["always", "never"] = "never",
    ) -> None:
        if vocab_size is not None and (type(vocab_size) is not int or vocab_size < 1):
            raise StepFileError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        id_dtype = None
        if vocab_size is not None:
            id_dtype = next(d for d in _ID_DTYPES if vocab_size - 1 <= np.iinfo(d).max)
        self.step, self.vocab_size = step, vocab_size
        root = step_root(directory, store)
        name = step_file_name(step)
        self.path = root.store.where(name)
        self._writer = StepRecordWriter(root, name, id_dtype=id_dtype, fsync=fsync)

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            self._writer.abort()

    def __len__(self) -> int:
        return len(self._writer)

    def append(
        self,
        sample: Sample,
        *,
        group: str | None = None,
        shared_prefix: int = 0,
        policy_version: int | None = None,
    ) -> None:
        """Write ``sample`` now (``group``: its group id, e.g. the prompt's, with the
        ``shared_prefix`` tokens it shares with the group). The index's policy version is the
        oldest of the sample's version spans; ``policy_version`` gives one to a sample without
        spans (every token of it), and must be left out, or be that oldest, for one with spans
        (:class:`StepFileError`)."""
        if self.vocab_size is not None and int(sample.token_ids.max()) >= self.vocab_size:
            raise StepFileError(
                f"sample {len(self)} holds token id {int(sample.token_ids.max())}, not below "
                f"vocab_size={self.vocab_size}",
                file=self.path,
                step=self.step,
                sample=len(self),
            )
        try:
            record = sample_record(
                sample, group=group, shared_prefix=shared_prefix, policy_version=policy_version
            )
        except ValueError as err:
            raise StepFileError(
                str(err), file=self.path, step=self.step, sample=len(self)
            ) from None
        self._guard(lambda: self._writer.append(record))

    def close(self) -> str:
        """Put the step file under its name (whole); its path or URL."""
        self._guard(self._writer.close)
        return self.path

    def abort(self) -> None:
        """Leave nothing behind."""
        self._writer.abort()

    def _guard(self, write) -> None:
        try:
            write()
        except OSError as err:  # PayloadIOError: the staged file has removed itself
            raise StepWriteError(
                f"writing step {self.step} failed ({err}); nothing of it was left behind: free "
                "space (or raise the file size limit) and write the step again",
                file=self.path,
                step=self.step,
            ) from err
        except PayloadError as err:
            raise StepFileError(err.message, file=self.path, step=self.step) from err


def write_step_file(
    directory: str | os.PathLike[str],
    step: int,
    samples: Sequence[Sample],
    **options: object,
) -> str:
    """Write step ``step`` of ``directory`` whole (``options``: :class:`StepWriter`'s); its
    path or URL."""
    with StepWriter(directory, step, **options) as writer:  # type: ignore[arg-type]
        for sample in samples:
            writer.append(sample)
    return writer.path


def step_error(
    err: ValueError, *, file: str, step: int | None = None, sample: int | None = None
) -> RollfeedError:
    """The loader's error for ``err``, raised reading step ``step`` (its file ``file``; sample
    ``sample`` when known): the file is not a regular one, was replaced (an object's ETag
    changed) or cut short while read, or its bytes or a record are not a step's
    (:class:`StepFileError`, :class:`StepReplacedError`); a sample's own typed error names the
    sample; a store's errors (I/O, time, credentials) are returned as they are."""
    if isinstance(err, PayloadStaleFileError):
        return StepReplacedError(
            f"step {step}'s file was replaced while it was read: {err.message}; a written step "
            "file must not be replaced (write the step under a new step number)",
            file=file,
            step=step,
        )
    if isinstance(err, PayloadPathError):
        return StepFileError(
            f"the step file is not a regular file ({err.message}): step files are opened "
            "without following symlinks and never wait on a FIFO; put the file itself there",
            file=file,
            step=step,
        )
    if isinstance(err, StepRecordError | PayloadTruncatedError) or not isinstance(
        err, PayloadError
    ):
        at = getattr(err, "record", None)
        return StepFileError(
            getattr(err, "message", str(err)),
            file=file,
            step=step,
            sample=sample if at is None else at,
        )
    return err


def read_step_file(
    path: str | os.PathLike[str], *, store: Mapping[str, object] | None = None
) -> list[Sample]:
    """Every sample of the step file ``path`` (a local path or an ``s3://`` URL), in order;
    :class:`StepFileError` naming the file and the sample for what cannot be read."""
    text = os.fspath(path)
    directory, name = text.rsplit("/", 1) if "/" in text else (".", text)
    root = step_root(directory, store)
    i = None
    try:
        with StepRecordFile(root, name) as f:
            index = f.index()
            out = []
            for i in range(len(index)):
                out.append(record_sample(f.read(index, i)))
            return out
    except ValueError as err:
        raise step_error(err, file=text, sample=i) from err
    finally:
        root.close()

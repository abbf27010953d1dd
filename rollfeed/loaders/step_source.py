"""Where a dataset's steps come from, chosen once: samples in memory, or step files in a store.

A :class:`StepSource` answers what planning asks of a step (its samples' token counts, loss runs,
identity and version: :class:`LoadedStep`) and hands out its samples:

- :class:`SampleSteps`: an in-memory list; every training step is the whole list, indices are
  list positions, nothing is waited for;
- :class:`StoredSteps`: the step files of a local directory or an object-store prefix
  (:mod:`rollfeed.loaders.step_files`), through a :class:`~rollfeed.payload.PayloadRoot`'s store
  and its one client: the listing, the files opened by the payload's open rule, every read.
  Training step ``k`` is file ``k``; an index encodes ``(step, sample)`` as
  ``step * STEP_STRIDE + sample``, so a worker resolves indices of steps that appeared after it
  was started. Planning reads a step's index only (footer and index: a few ranges); a sample is
  one ranged read of its record. Each process keeps the last ``cache_steps`` steps (their index,
  and the step file open on the version it was read from); a forked worker keeps the inherited
  indexes but opens the file itself, and a file that is not the version a plan was made from is
  :class:`~rollfeed.loaders.errors.StepReplacedError`. A process's threads read records of its
  steps concurrently (:mod:`rollfeed.loaders.step_held`).

Example: steps 3 and 4 of two and one samples -> ``source.indices(4) == [4 * 2**32 + 0]``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rollfeed.collate import ImageRuns, LossRuns, Sample, SharedPrefixes, oldest_version
from rollfeed.loaders.errors import (
    LoaderConfigError,
    StepFileError,
    StepMissingError,
    StepReplacedError,
)
from rollfeed.loaders.step_files import MAX_STEP, STEP_STRIDE, step_error, step_file_name, step_root
from rollfeed.loaders.step_held import HeldSteps
from rollfeed.loaders.step_identity import StepIdentity
from rollfeed.loaders.step_records import record_sample
from rollfeed.loaders.step_version import StepVersion, replaced_error
from rollfeed.loaders.step_wait import StepDirectory
from rollfeed.payload import PayloadMissingFileError, StepRecordFile, StepRecordIndex, is_store_url


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class LoadedStep:
    """One step as a process holds it: the ``version`` of its file (``None`` in memory), its
    samples' ``lengths [n]``, loss ``runs``, image placeholder runs (``images``; ``None`` when no
    sample holds an image), oldest policy versions (``policy_versions [n]`` int64, -1: none),
    claimed shared ``prefixes`` (each sample's group and shared-prefix length from the index;
    ``None`` when no sample claims one) and ``identity``, and its file's ``index``."""

    version: StepVersion | None
    lengths: np.ndarray
    runs: LossRuns
    images: ImageRuns | None
    policy_versions: np.ndarray
    identity: StepIdentity
    index: StepRecordIndex | None = None
    prefixes: SharedPrefixes | None = None


def _oldest(sample: Sample) -> int:
    oldest = oldest_version(sample.version_spans)
    return -1 if oldest is None else oldest


class StepSource(Protocol):
    """What a :class:`~rollfeed.loaders.RolloutDataset` asks of where its samples come from."""

    directory: str | None  # the step directory or prefix as given (None in memory)
    streams: bool  # whether steps come one by one, so a pass may wait for the next

    def __len__(self) -> int: ...
    def steps_from(self, step: int) -> list[int]: ...
    def wait_for_step(self, step: int, *, timeout_s: float, exact: bool) -> int: ...
    def indices(self, step: int) -> np.ndarray: ...
    def locate(self, index: int) -> tuple[int, int]: ...
    def loaded(self, step: int, want: StepVersion | None = None) -> LoadedStep: ...
    def sample(self, step: int, i: int, want: StepVersion | None) -> Sample: ...
    def where(self, step: int) -> str | None: ...
    def metrics(self) -> dict[str, int]: ...


class SampleSteps:
    """An in-memory list: every step is the whole list (module doc)."""

    directory: str | None = None
    streams = False

    def __init__(self, samples: Sequence[Sample]) -> None:
        self.samples = samples
        self._step: LoadedStep | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def steps_from(self, step: int) -> list[int]:
        return [step]

    def wait_for_step(self, step: int, *, timeout_s: float, exact: bool) -> int:
        return step  # a list has every step

    def indices(self, step: int) -> np.ndarray:
        return np.arange(len(self.samples), dtype=np.int64)

    def locate(self, index: int) -> tuple[int, int]:
        return 0, int(index)

    def loaded(self, step: int, want: StepVersion | None = None) -> LoadedStep:
        if self._step is None:
            lengths = np.fromiter((len(s) for s in self.samples), np.int64, len(self.samples))
            self._step = LoadedStep(
                version=None,
                lengths=lengths,
                runs=LossRuns.of_samples(self.samples),
                images=(
                    ImageRuns.of_samples(self.samples)
                    if any(s.images for s in self.samples)
                    else None
                ),
                policy_versions=np.array([_oldest(s) for s in self.samples], np.int64).reshape(-1),
                identity=StepIdentity.of_samples(self.samples),
            )
        return self._step

    def sample(self, step: int, i: int, want: StepVersion | None) -> Sample:
        return self.samples[i]

    def where(self, step: int) -> str | None:
        return None

    def metrics(self) -> dict[str, int]:
        return {"steps_loaded": 0, "samples_read": 0}


class StoredSteps:
    """The step files of ``directory`` (a local directory or ``s3://bucket/prefix``; ``store``:
    an object store's endpoint and credentials), picklable: what a process opens stays in it."""

    streams = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        cache_steps: int = 2,
        store: Mapping[str, object] | None = None,
    ) -> None:
        if cache_steps < 1:
            raise LoaderConfigError(f"cache_steps must be >= 1, got {cache_steps}")
        text = os.fspath(directory)
        self.directory = text if is_store_url(text) else os.path.abspath(text)
        self.root = step_root(self.directory, store)
        self.steps = StepDirectory(self.root, self.directory)
        self.cache_steps = cache_steps
        self._reset()

    def _reset(self) -> None:
        """Per-process state (cached steps, open step files, counters), by process id."""
        self._procs: dict[int, HeldSteps] = {os.getpid(): HeldSteps()}

    def __getstate__(self) -> dict:
        keys = ("directory", "root", "steps", "cache_steps")
        return {k: getattr(self, k) for k in keys}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._reset()

    def _held(self) -> HeldSteps:
        """This process's state. A forked worker keeps the inherited indexes (copy-on-write) but
        opens its own files and starts its own counts and lock; its threads may ask at once
        (``setdefault``: one state wins, made before any file is opened)."""
        pid = os.getpid()
        held = self._procs.get(pid)
        if held is None:
            parent = next(reversed(self._procs.values()))
            held = self._procs.setdefault(pid, HeldSteps(parent.cache.copy()))
        return held

    def __len__(self) -> int:
        """Samples of the steps cached in this process."""
        held = self._held()
        with held.lock:
            return sum(len(v.lengths) for v in held.cache.values())

    def where(self, step: int) -> str:
        return self.root.store.where(step_file_name(step))

    def metrics(self) -> dict[str, int]:
        held = self._held()
        with held.lock:
            return {k: held.counts[k] for k in ("steps_loaded", "samples_read")}

    def check(self) -> None:
        """Refuse at once a local directory that cannot be a step directory (``from_step_dir``;
        :meth:`~rollfeed.loaders.step_wait.StepDirectory.check`)."""
        self.steps.check()

    def steps_from(self, step: int) -> list[int]:
        return self.steps.steps_from(step)

    def wait_for_step(self, step: int, *, timeout_s: float, exact: bool) -> int:
        return self.steps.wait_for_step(step, timeout_s=timeout_s, exact=exact)

    def indices(self, step: int) -> np.ndarray:
        return step * STEP_STRIDE + np.arange(len(self.loaded(step).lengths), dtype=np.int64)

    def locate(self, index: int) -> tuple[int, int]:
        step, i = divmod(int(index), STEP_STRIDE)
        return step, i

    def _open(self, step: int) -> StepRecordFile | None:
        try:
            return StepRecordFile(self.root, step_file_name(step))
        except PayloadMissingFileError:
            return None
        except ValueError as err:
            raise step_error(err, file=self.where(step), step=step) from None

    def loaded(self, step: int, want: StepVersion | None = None) -> LoadedStep:
        """Step ``step`` as this process holds it, of version ``want`` when given.

        This process's copy is read again when it cannot be read as it is (a forked worker
        inherits indexes but not open files, and the file at the name is now another version)
        or is not ``want`` (a worker's copy older than the plan); :class:`StepReplacedError`
        when the step file is still not ``want``."""
        held = self._held()
        with held.lock:
            return self._loaded(held, step, want)

    def _loaded(self, held: HeldSteps, step: int, want: StepVersion | None) -> LoadedStep:
        got = held.cache.get(step)
        if got is not None and (
            not self._readable(held, step, got) or want not in (None, got.version)
        ):
            held.forget(step)
            got = None
        if got is None:
            f = self._open(step)
            if (
                want is not None
                and f is not None
                and StepVersion(size=f.size, stamp=f.stamp) != want
            ):
                f.close()  # another file than the plan's: whatever it holds, it is not read
                raise replaced_error(
                    step, self.where(step), want, StepVersion(size=f.size, stamp=f.stamp)
                )
            got = held.cache[step] = self._load(held, step, f)
            while len(held.cache) > self.cache_steps:
                held.forget(next(iter(held.cache)))
        else:
            held.cache.move_to_end(step)
        if want is not None and got.version != want:
            raise replaced_error(step, self.where(step), want, got.version)
        return got

    def _readable(self, held: HeldSteps, step: int, got: LoadedStep) -> bool:
        """Whether this process reads ``got``'s records through a file open on its version."""
        if step in held.files:
            return True
        f = self._open(step)
        if f is None:
            return False
        if StepVersion(size=f.size, stamp=f.stamp) != got.version:
            f.close()
            return False
        held.files[step] = f
        return True

    def _load(self, held: HeldSteps, step: int, f: StepRecordFile | None) -> LoadedStep:
        """Step ``step``'s index, read from ``f``, its file opened now (kept open for its
        records)."""
        if step > MAX_STEP:
            raise StepFileError(
                f"step {step} is beyond the largest step a loader reads, {MAX_STEP} (a dataset "
                "index is step * 2**32 + sample, in int64); number steps from 0",
                file=self.where(step),
                step=step,
            )
        if f is None:
            raise self._missing(step)
        try:
            index = f.index()
        except ValueError as err:
            f.close()
            raise step_error(err, file=self.where(step), step=step) from None
        held.files[step] = f
        held.counts["steps_loaded"] += 1
        return LoadedStep(
            version=StepVersion(size=f.size, stamp=f.stamp),
            lengths=index.tokens,
            runs=LossRuns(counts=index.run_counts, spans=index.run_spans),
            images=(
                ImageRuns(counts=index.span_counts, spans=index.span_spans)
                if index.span_counts.sum()
                else None
            ),
            policy_versions=index.policy_version,
            identity=StepIdentity.of(index.tokens, index.crc32c),
            index=index,
            prefixes=_prefixes(index),
        )

    def _missing(self, step: int) -> StepMissingError:
        present = self.steps_from(0)  # a JSON-lines step file of this step is named here
        have = f"steps {present[0]}..{present[-1]} ({len(present)} files)" if present else "none"
        return StepMissingError(
            f"step {step} has no step file {step_file_name(step)} in {self.directory} (present: "
            f"{have}); ask for a step that is there, or wait for it (stream=True)",
            file=self.where(step),
            step=step,
        )

    def sample(self, step: int, i: int, want: StepVersion | None) -> Sample:
        """Sample ``i`` of step ``step``: looked up under the process's lock, its record read
        and decoded without it (threads read at once; :mod:`~rollfeed.loaders.step_held`)."""
        held = self._held()
        with held.lock:
            got = self._loaded(held, step, want)
            if not 0 <= i < len(got.lengths):
                raise StepReplacedError(
                    f"dataset index {step * STEP_STRIDE + i} asks for sample {i} of step {step}, "
                    f"which has {len(got.lengths)}: the step file changed after the step was "
                    "planned; a written step file must not be replaced",
                    file=self.where(step),
                    step=step,
                )
            assert got.index is not None
            held.counts["samples_read"] += 1
            f = held.take(step)
        try:
            return record_sample(f.read(got.index, i))
        except ValueError as err:
            raise step_error(err, file=self.where(step), step=step, sample=i) from None
        finally:
            held.release(f)


def _prefixes(index: StepRecordIndex) -> SharedPrefixes | None:
    """The shared prefixes the index's records claim (group hash 0: none), or None. The
    index holds each 64-bit hash as int64 bits; read unsigned, since a negative id claims
    nothing (:meth:`SharedPrefixes.of_groups`) and half the hashes have their top bit set."""
    claims = (index.group != 0) & (index.shared > 0)
    if not claims.any():
        return None
    hashes = index.group.view(np.uint64).tolist()
    groups = [int(g) if c else None for g, c in zip(hashes, claims, strict=True)]
    return SharedPrefixes.of_groups(groups, index.shared)

"""Attack family ``step_replace`` of the adversary harness (:mod:`tests.payload.adversary`): a step
file replaced between planning and the reads of its samples.

The trainer plans a step; then the step file is replaced under its name (other tokens in records
of the same sizes, other samples, fewer or more, the same bytes again, the replacement's records
under the planned file's index, a replacement cut before its index, the step file removed: a pass
then waits ``step_timeout_s`` for it), before the pass starts or after its first micro batch.
The pass runs in the trainer's process, in a fresh copy of the dataset (a worker started by
``spawn``) or in two DataLoader workers (forked; over an object store, from a fork server).
With the session's S3 server (``AWS_*`` passed on by the test) the step objects under a prefix
are replaced too. The oracle is the planned version's micro batches (a single-process
reference): a pass must yield exactly those or raise a typed error; yielding anything else is
``wrong``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rollfeed.collate import Sample
from tests.loaders.common import SEQ_LEN, reference, write_batch
from tests.loaders.resume import tmb_key
from tests.payload.adversary_tally import Tally, Wrong

SAMPLES = 6


def same_sizes_other_tokens(samples: list[Sample]) -> list[Sample]:
    """Each sample with its token ids reversed: every record keeps its size and token count, so
    the planned index fits the replacement exactly (only a version check can tell)."""
    return [
        Sample(
            s.token_ids[::-1].copy(),
            loss_mask=s.loss_mask,
            advantages=s.advantages,
            inference_logprobs=s.inference_logprobs,
            temperatures=s.temperatures,
            payload=s.payload,
            uid=s.uid,
        )
        for s in samples
    ]


def _replacements(planned, spare):
    """``(what, samples, index)``: the replacement's samples (``None``: the step file removed)
    and what becomes of its index (``"new"``: its own; ``"old"``: the planned file's index and
    footer grafted onto its records; ``"none"``: cut off before its index)."""
    other = same_sizes_other_tokens(planned)
    return [
        ("same record sizes, other tokens", other, "new"),
        ("same record sizes, other tokens, the planned index", other, "old"),
        ("other samples", spare[:SAMPLES], "new"),
        ("other samples, the planned index", spare[:SAMPLES], "old"),
        ("fewer samples", planned[:2], "new"),
        ("more samples", planned + spare[:3], "new"),
        ("the same samples again", planned, "new"),
        ("other samples, cut before their index", spare[:SAMPLES], "none"),
        ("step file removed", None, "none"),
    ]


def step_bytes(samples: list[Sample]) -> bytes:
    """The bytes of a step file of ``samples``."""
    import tempfile

    from rollfeed.loaders.step_files import write_step_file

    with tempfile.TemporaryDirectory() as tmp:
        return Path(write_step_file(tmp, 0, samples)).read_bytes()


def grafted(new: bytes, planned: bytes, index: str) -> bytes:
    """``new`` with what ``index`` says of its index (:func:`_replacements`)."""
    from rollfeed.payload.format.step_layout import FOOTER

    if index == "new":
        return new
    own = FOOTER.unpack(new[-FOOTER.size :])[0]  # where the replacement's index begins
    if index == "none":
        return new[:own]
    at = FOOTER.unpack(planned[-FOOTER.size :])[0]
    return new[:at].ljust(at, b"\0") + planned[at:]


def _local(steps: Path) -> tuple[str, Callable, Callable]:
    """A step directory: its dataset source, and how to write and to replace step 0 (a new file
    moved over the name, as a writer does)."""
    from rollfeed.loaders.step_files import step_file_name, write_step_file

    steps.mkdir()
    path = steps / step_file_name(0)

    def replace(samples, index: str) -> None:
        if samples is None:
            path.unlink()
            return
        tmp = path.with_name(".replacement")
        tmp.write_bytes(grafted(step_bytes(samples), path.read_bytes(), index))
        os.replace(tmp, path)

    return os.fspath(steps), lambda samples: write_step_file(steps, 0, samples), replace


def _stored(url: str) -> tuple[str, Callable, Callable]:
    """The same under an object-store prefix (the object overwritten under its key)."""
    from rollfeed.loaders.step_files import write_step_file
    from rollfeed.payload import PayloadRoot, StepRecordFile

    root = PayloadRoot(url)
    name = "step_000000.rfs"

    def replace(samples, index: str) -> None:
        with StepRecordFile(root, name) as f:
            planned = f._read(0, f.size, "the file")
        staged = root.store.stage(name)
        staged.write(grafted(step_bytes(samples), planned, index))
        staged.commit()

    return url, lambda samples: write_step_file(url, 0, samples), replace


def _noop() -> None:
    pass


def _start_fork_server() -> None:
    """Start this process's fork server with the loader's preload (what its first loader over a
    store would do, in seconds: the server imports torch), so each case's workers fork from it."""
    import multiprocessing

    from rollfeed.loaders.loader import FORKSERVER_PRELOAD

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    child = ctx.Process(target=_noop)
    child.start()
    child.join()


def family_step_replace(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """See the module doc; every attack is one pass over one freshly planned step."""
    from rollfeed.collate import PlanConfig
    from rollfeed.loaders import (
        LoaderConfig,
        LoaderOptions,
        RolloutDataset,
        Topology,
        build_dataloader,
    )

    root = workdir / "payload"
    samples = write_batch(root, 3 * SAMPLES, seed=int(rng.integers(1 << 30)))
    planned, spare = samples[:SAMPLES], samples[SAMPLES:]
    ref_mbs, _ = reference(planned, dp_size=1, cp_size=1, cp_layout="contiguous", root=root)
    want = [tmb_key(t) for t in ref_mbs[0, 0]]
    config, topo = PlanConfig(seq_len=SEQ_LEN), Topology(dp_rank=0, dp_size=1)
    places = [("local", ("trainer", "spawned copy", "2 workers"))]
    if os.environ.get("AWS_ENDPOINT_URL"):  # the session's S3 server, passed on by the test
        places.append(("s3", ("trainer", "2 workers")))
        _start_fork_server()  # once, before the cases: their workers fork from it
    from tests.object_store_server import BUCKET

    base = f"s3://{BUCKET}/adversary-step-replace-{os.getpid()}-{int(rng.integers(1 << 30))}"
    case = 0
    for kind, wheres in places:
        for what, replacement, index in _replacements(planned, spare):
            if kind == "s3" and replacement is None:
                continue  # a removed object is a missing step, as locally
            for where in wheres:
                for when in ("before the pass", "after its first micro batch"):
                    if (where == "2 workers" or kind == "s3") and when != "before the pass":
                        continue  # prefetched by then, or the same as locally: a start's cost
                    case += 1
                    place = _local(workdir / f"c{case}") if kind == "local" else None
                    source, write, replace = place or _stored(f"{base}/c{case}")
                    write(planned)

                    def attack(source=source, replace=replace, replacement=replacement,
                               index=index, where=where, when=when):  # fmt: skip
                        ds = RolloutDataset.from_step_dir(source)
                        workers = 2 if where == "2 workers" else 0
                        options = LoaderOptions(num_workers=workers, timeout_s=10, stopped_s=1)
                        loader = build_dataloader(
                            ds,
                            topo,
                            LoaderConfig(plan=config, step_timeout_s=0.2),
                            root=root,
                            options=options,
                        )
                        try:
                            assert len(loader) == len(want)  # planned
                            if where == "spawned copy":  # reads from a copy that loads it itself
                                loader.dataset = pickle.loads(pickle.dumps(ds))
                            got = []
                            it = iter(loader)
                            if when != "before the pass":
                                got.append(tmb_key(next(it)))
                            replace(replacement, index)
                            got += [tmb_key(t) for t in it]
                        finally:
                            loader.close()
                        if got != want:
                            raise Wrong(
                                f"{len(got)} micro batches, not the planned {len(want)} (or "
                                "they differ)"
                            )

                    tally.case(f"step_replace {kind}: {what}; {where}; {when}", attack)

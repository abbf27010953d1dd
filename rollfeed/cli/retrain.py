"""``python -m rollfeed retrain``: train again over recorded steps, with no inference.

The log of a run (step files, the payload root their records point into, the trainer's
checkpoints) holds everything a trainer needs. ``retrain`` takes steps ``K`` to ``M`` of it:

1. every step file ``K..M`` must be in ``--steps`` (a missing one is a usage error naming it);
2. every record of those steps is checked against ``--root`` first, as ``verify ROOT --steps DIR``
   checks them (:mod:`rollfeed.cli.verify_steps`); any finding is printed and nothing is trained
   (exit 1);
3. the demo's trainer (:mod:`rollfeed.demo.trainer`, the reference trainer rollfeed ships: its
   loss, FSDP2, the loader streaming the step files) is started under ``torchrun`` with
   ``--from K``: the model and AdamW state of checkpoint ``step_<K>`` in ``--checkpoints``
   (``K = 0``: the weights of ``--model``), the loader at step ``K``. It trains steps ``K..M``,
   one optimizer step each, and writes their record to ``--out`` (per step the loss, the
   fingerprints of the samples trained and a digest of the weights after it); it writes no
   checkpoint, so the run's own are left as they are.

The trainer's settings (learning rate, loss flags, sequence length, dtype, ``cp``, the staleness
bound ``--max-staleness`` and its policy ``--on-stale``) default to the ones checkpoint ``K``
recorded, so the steps are trained as the run trained them: from the same
checkpoint, with the same world size, the weights after each step are bitwise the run's (compare
the digests with the run's ``trainer.json``).

Example::

    python -m rollfeed retrain --steps run/steps --root run/payload --checkpoints \\
        run/checkpoints --model ~/.cache/rollfeed/tiny-qwen3moe-v2 --from 2 --to 3
    verify: 128 of 128 samples in 2 step files have readable records (256 segments read)
    step 2  loss -0.00041  samples 64  weights 5f0c2d1e9a7b...
    step 3  loss -0.00127  samples 64  weights a9e4b7c3d2f1...

Exit statuses: 0 trained, 1 findings (nothing trained) or the trainer failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from rollfeed.cli.errors import UsageError
from rollfeed.cli.progress import Progress
from rollfeed.cli.report import CLEAN, FINDINGS
from rollfeed.cli.root_scan import check_directory
from rollfeed.cli.step_samples import step_numbers
from rollfeed.cli.verify_steps import print_report, verify_records

# What checkpoint K recorded of the run's trainer, as the trainer's flags.
RECORDED = {"lr": "--lr", "clip_eps": "--clip-eps", "correction": "--correction"}
RECORDED |= {"seq_len": "--seq-len", "dtype": "--dtype", "cp": "--cp"}
RECORDED |= {"max_staleness": "--max-staleness", "on_stale": "--on-stale"}


def _recorded(checkpoints: str, start: int) -> dict:
    """What checkpoint ``start`` recorded of its run (``{}`` for step 0)."""
    if start == 0:
        return {}
    path = Path(checkpoints) / f"step_{start:06d}"
    if not (path / ".metadata").is_file():
        raise UsageError(
            f"--from {start}: no complete checkpoint at {path} (a step_NNNNNN directory with "
            ".metadata); --from 0 starts from the weights of --model"
        )
    record = path / "trainer.json"
    return json.loads(record.read_text()) if record.is_file() else {}


def trainer_command(args: argparse.Namespace, recorded: dict) -> list[str]:
    """The ``torchrun`` command line of the trainer (see the module doc)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={args.nproc}", "-m", "rollfeed.demo.trainer"]
    cmd += ["--model-dir", args.model, "--steps-dir", args.steps, "--root", args.root]
    cmd += ["--checkpoints", args.checkpoints, "--out", args.out]
    cmd += ["--from", str(args.start), "--steps", str(args.end + 1), "--workers", "0"]
    for key, flag in RECORDED.items():
        value = getattr(args, key) if getattr(args, key) is not None else recorded.get(key)
        if value is not None:
            cmd += [flag, str(value)]
    centering = args.centering if args.centering is not None else recorded.get("centering")
    if centering is not None:
        cmd.append("--centering" if centering else "--no-centering")
    return cmd


def run_retrain(args: argparse.Namespace) -> int:
    """``retrain --steps DIR --root ROOT --checkpoints C --model M --from K --to M``."""
    if args.start < 0 or args.end < args.start:
        raise UsageError(f"--from {args.start} --to {args.end}: want 0 <= K <= M")
    check_directory(args.root, "payload root")
    present = set(step_numbers(args.steps))
    missing = [k for k in range(args.start, args.end + 1) if k not in present]
    if missing:
        raise UsageError(
            f"step {missing[0]} (step_{missing[0]:06d}.rfs) is not in {args.steps}; "
            f"{len(missing)} of steps {args.start}..{args.end} are missing"
        )
    recorded = _recorded(args.checkpoints, args.start)
    steps = list(range(args.start, args.end + 1))
    report = verify_records(
        args.root,
        args.steps,
        steps,
        checksums=args.checksums,
        progress=Progress("retrain", show=None),
    )
    print("verify: ", end="")
    print_report(report)
    if report["findings"]:
        print("nothing trained: the records above do not read back from the root")
        return FINDINGS
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    proc = subprocess.run(trainer_command(args, recorded), env=env)
    if proc.returncode != 0:
        print(f"the trainer failed with exit code {proc.returncode}", file=sys.stderr)
        return FINDINGS
    for step in json.loads(Path(args.out).read_text())["train"]:
        if step["step"] >= args.start:
            print(
                f"step {step['step']}  loss {step['loss']:.5f}  samples {len(step['samples'])}  "
                f"weights {step['digest'][:12]}"
            )
    return CLEAN

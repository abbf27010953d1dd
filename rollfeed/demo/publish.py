"""What the demo trainer tells others after a step: the weights the capture server loads and
the progress file the producer reads (:func:`announce`); its loss tokens by lag
(:func:`lag_totals`).

Example (after step 4 of a run with ``--weights /run/weights``, every rank)::

    announce(args, model, 5, Path("/run/checkpoints/step_000005"))
    # /run/weights/step_000005 (complete), then steps/trainer_progress.json:
    # {"step": 5, "version": 5, "weights": "/run/weights/step_000005", "checkpoint": ...}
    lag_totals([{"lag0": 3, "lag1": 1}, {"lag0": 2}])  # {"lag0": 5, "lag1": 1}
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from rollfeed.models.checkpoint import MARKER
from rollfeed.models.checkpoint import save_checkpoint as save_weights
from rollfeed.orchestrator.progress import TrainerProgress, write_progress


def lag_totals(per_rank: Iterable[dict[str, int]]) -> dict[str, int]:
    """``{"lag0": n, "lag1": n, ..., "lag_ahead": n, "unversioned": n}``: loss tokens by lag,
    summed over the ranks' loader metrics."""
    out: dict[str, int] = {}
    for lags in per_rank:
        for key, n in lags.items():
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


def announce(args: argparse.Namespace, model: torch.nn.Module, step: int, path: Path) -> None:
    """Tell the producer that ``step`` steps are trained (collective with ``--weights``):
    the weights for the capture server (``--weights``/step_<step>, complete or absent,
    :func:`rollfeed.models.checkpoint.save_checkpoint`, written once) first, then the progress
    file naming them and checkpoint ``path``. Called again after a restart from ``path``, it
    writes what a crash between checkpoint and progress left out."""
    weights = None
    if args.weights is not None:
        weights = args.weights / f"step_{step:06d}"
        if not (weights / MARKER).is_file():
            save_weights(model, weights, step=step)
    if dist.get_rank() == 0:
        progress = TrainerProgress(
            step=step,
            version=step,
            weights=None if weights is None else str(weights.resolve()),
            checkpoint=str(path),
        )
        write_progress(args.steps_dir, progress)

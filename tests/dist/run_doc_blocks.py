"""Rank script: the docs' torchrun blocks (the script ``train.py`` the pages build up) as
printed, in order, in one namespace per rank.

Run by tests/test_doc_blocks.py through :func:`tests.dist.launch.torchrun`::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist/run_doc_blocks.py \\
        --blocks blocks.json --workdir W --out OUT

``blocks.json`` holds ``[{"label", "page", "heading", "line", "code"}, ...]``. Each rank works in
``W`` (where the README's quick start ran, as a reader would), runs the blocks as one script (the
blocks start and end the process group themselves: nothing here does it for them), checks what
each block claims after it ran (:data:`CHECKS`), and writes ``OUT/rank<r>.json``: one
``{"label", "ok", "error"}`` per block it ran, rewritten after each block. A block that fails ends
the rank at once with exit code 1 (torchrun then stops its peer, which may be waiting in a
collective), so the report names the first failing block. After the last block the interpreter
ends as the pages' script would, so a rank that aborts in teardown fails the launch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from tests.readme_blocks import Block, compiled


def _loaders(ns: dict) -> None:
    assert len(ns["batches"]) == 1, len(ns["batches"])  # 4 samples of 15 tokens: one 64-token row
    mb = ns["batches"][0]
    assert (mb.cp_size, mb.input_ids.shape) == (2, (32,)), (mb.cp_size, mb.input_ids.shape)
    assert ns["checkpoint"]["loader"]["step"] == 1, ns["checkpoint"]["loader"]


def _scorer(ns: dict) -> None:
    # The same weights as the quick start's sampler, the row split over 2 cp ranks (Ulysses):
    # the scores over the recorded kept set are the sampler's, at this rank's own positions.
    mb, logp = ns["mb"], ns["logp"].detach()
    delta = (logp - mb.inference_logprobs)[mb.loss_mask].abs()
    assert mb.loss_mask.sum() > 0 and delta.max() < 1e-4, delta


def _sharded(ns: dict) -> None:
    grad = ns["model"].lm_head.weight.grad
    assert grad is not None and grad.to_local().abs().sum() > 0, "no LM-head gradient"


CHECKS: dict[str, Callable[[dict], None]] = {
    "Loaders and resume": _loaders,
    "The policy scorer (packed attention, Ulysses over `cp`, router replay)": _scorer,
    "Sharded models: FSDP2, DTensor tensor parallelism, one `DeviceMesh`": _sharded,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    blocks = [
        (b["label"], Block(**{k: b[k] for k in ("page", "line", "heading", "code")}, lang="python"))
        for b in json.loads(args.blocks.read_text())
    ]
    rank = int(os.environ["RANK"])
    out = args.out / f"rank{rank}.json"
    torch.set_num_threads(1)
    os.chdir(args.workdir)
    ns: dict = {"__name__": "__main__"}
    done: list[dict] = []
    for label, block in blocks:
        try:
            exec(compiled(block), ns)
            check = CHECKS.get(block.heading)
            if check is not None:
                check(ns)
        except BaseException:
            done.append({"label": label, "ok": False, "error": traceback.format_exc()})
            out.write_text(json.dumps(done))
            sys.stdout.flush()
            os._exit(1)
        done.append({"label": label, "ok": True, "error": None})
        out.write_text(json.dumps(done))


if __name__ == "__main__":
    main()

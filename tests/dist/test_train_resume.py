"""Demo training under dp 2 x cp 2 (FSDP2, Ulysses): a run checkpointed after step 1 with DCP and
resumed in new processes gives bitwise the losses and final weights of the run never stopped, and
so does training steps 1 and 2 again from the log, from that checkpoint.

Two torchrun launches of 4 ranks (``tests/dist/run_train_resume.py``): A trains steps 0..2
uninterrupted, then step 0 from fresh weights with a checkpoint; B resumes that checkpoint, then
trains steps 1 and 2 again from it. Float64, a tiny dense Qwen3, three captured steps by handle
(kept sets in a payload root).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rollfeed.collate import Sample
from rollfeed.collate.balance import DEFAULT_QUADRATIC
from rollfeed.loaders import write_step_file
from rollfeed.payload import PayloadWriter
from tests.dist.launch import torchrun
from tests.models.tiny import VOCAB, tiny_qwen3

LENGTHS = [7, 10, 3, 9, 12, 5, 8, 11, 6, 4]


def captured_step(work, step: int = 0, seed: int = 3) -> int:
    """``work/payload`` and ``work/steps/step_<step>.rfs``: prompts, completions whose every
    token has a kept set holding it (1-4 ids) and the sampler's logprob of every kept id, near the
    kept set's uniform value (written by handle as the capture does), advantages of both signs.
    Returns the count of loss tokens."""
    rng = np.random.default_rng(seed)
    samples = []
    with PayloadWriter(work / "payload", group=f"sampler{step}") as writer:
        for i, T in enumerate(LENGTHS):
            ids = rng.integers(0, VOCAB, T)
            prompt = int(rng.integers(1, T // 2 + 1))
            counts = rng.integers(1, 5, T - prompt)
            values, mask_lp = [], []
            logprobs = np.zeros(T, np.float32)
            for t, n in zip(range(prompt, T), counts, strict=True):
                others = np.setdiff1d(np.arange(VOCAB), [ids[t]])
                values += [int(ids[t]), *rng.choice(others, n - 1, replace=False).tolist()]
                logits = rng.normal(0, 0.1, n)
                row = (logits - np.log(np.exp(logits).sum())).astype(np.float32)
                mask_lp += row.tolist()
                logprobs[t] = row[0]  # the sampled token's, as the sampler reports it
            kept = {
                "sampling_mask": (counts, np.asarray(values, np.int32)),
                "sampling_mask_logprobs": (counts, np.asarray(mask_lp, np.float32)),
            }
            samples.append(
                Sample(
                    ids,
                    loss_mask=np.arange(T) >= prompt,
                    advantages=rng.standard_normal(T).astype(np.float32),
                    inference_logprobs=logprobs,
                    payload=writer.write(kept, prompt, sampled=ids[prompt:]),
                    uid=f"s{i}",
                )
            )
    (work / "steps").mkdir(exist_ok=True)
    write_step_file(work / "steps", step, samples)
    return sum(int(s.loss_mask.sum()) for s in samples)


def final_state(checkpoint) -> dict:
    """A DCP checkpoint read back in this process as one plain state dict."""
    out = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


def assert_same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.dist
def test_resumed_run_is_bitwise_the_uninterrupted_run(tmp_path):
    tiny_qwen3(seed=5).save_pretrained(tmp_path / "model")
    loss_tokens = [captured_step(tmp_path / "full", k, seed=3 + k) for k in range(3)]
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    torchrun("tests/dist/run_train_resume.py", nproc=4, args=["first", str(tmp_path)])
    cut_at_1 = json.loads((tmp_path / "cut/checkpoints/step_000001/trainer.json").read_text())
    torchrun("tests/dist/run_train_resume.py", nproc=4, args=["resume", str(tmp_path)])

    full = json.loads((tmp_path / "full/trainer.json").read_text())
    cut = json.loads((tmp_path / "cut/trainer.json").read_text())
    assert [s["step"] for s in cut["train"]] == [0, 1, 2]
    # Step 0 of the cut run comes from its checkpoint, not from a rerun (its timing is copied).
    assert cut["train"][0] == cut_at_1["train"][0] and cut["ranks"] == cut_at_1["ranks"]
    for a, b in zip(full["train"], cut["train"], strict=True):
        assert a["loss"] == b["loss"] and a["delta"] == b["delta"], a["step"]
        assert a["entropy"] == b["entropy"] and a["tokens"] == b["tokens"], a["step"]
    # The steps train: each update moves the trainer's logprobs and the loss.
    losses = [s["loss"] for s in full["train"]]
    assert len(set(losses)) == 3, losses
    assert [s["tokens"] for s in full["train"]] == loss_tokens
    assert len(full["train"][0]["delta"]) == loss_tokens[0]  # every loss token, once over 4 ranks
    assert [len(s["samples"]) for s in full["train"]] == [len(LENGTHS)] * 3  # each sample once
    # Trained again from the log (checkpoint 1, the steps' files): bitwise the same steps.
    again = json.loads((tmp_path / "retrain.json").read_text())
    assert [s["step"] for s in again["train"]] == [1, 2]
    for a, b in zip(full["train"][1:], again["train"], strict=True):
        assert (a["loss"], a["delta"], a["digest"]) == (b["loss"], b["delta"], b["digest"])
        assert a["samples"] == b["samples"]
    assert full["train"][2]["digest"] != full["train"][1]["digest"]

    want = final_state(tmp_path / "full/checkpoints/step_000003")
    got = final_state(tmp_path / "cut/checkpoints/step_000003")
    assert_same(got, want, "state")
    start = final_state(tmp_path / "cut/checkpoints/step_000001")
    moved = [k for k, v in want["model"].items() if not torch.equal(v, start["model"][k])]
    assert moved == list(want["model"]), "some parameters did not change from step 1 to 3"
    plan = {"seq_len": 32, "cp_layout": "zigzag", "pad_to_multiple_of": None}
    plan |= {"overlong": "truncate", "quadratic_cost": DEFAULT_QUADRATIC, "shuffle": False}
    plan |= {"trees": True, "tree_min_saving": 0.2, "drop_staleness": -1}
    assert {k: v for k, v in want.items() if k.startswith("loader")} == {
        f"loader_rank{r}": {"version": 3, "step": 3, "micro_batches": 0, "seed": 0}
        | {"dp_size": 2, "cp_size": 2, "plan": plan}  # the plan fingerprint through DCP
        | {"data": {"samples": 0, "tokens": 0, "digest": ""}}  # none of step 3 consumed
        for r in range(4)
    }

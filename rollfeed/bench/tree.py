"""Shared prefixes packed as trees against the same samples packed flat, and route bytes per group.

``python -m rollfeed.bench tree [--shapes 2048:512:8 256:1024:8] [--models dense moe]
[--repeats 2] [--skip-bytes]``

**Scoring.** For each shape ``prompt:completion:group`` (one GRPO group: a prompt and ``group``
completions of ``completion`` tokens, every completion token with a kept set of 4 ids) and each
model, the group is planned twice, with its shared prefix claimed (``tree``) and with
``PlanConfig(trees=False)`` (``flat``: each sample packed on its own, today's packing), into one
micro batch, and scored by :class:`~rollfeed.models.PolicyScorer` (forward + backward of a loss
over logprobs and entropies), float32 on the CPU:

- ``dense``: a Qwen3 of hidden 256 x 4 layers (4 query / 2 key-value heads of 64, MLP 768,
  vocabulary 1024);
- ``moe``: the demo's tiny Qwen3-MoE (hidden 64, 2 layers, 8 experts top-2), its routes replayed
  (read once per prefix under ``tree``).

Each line gives the tokens the forward computes (the plan's ``tokens``), the best of
``--repeats`` forward + backward times and the peak memory above the inputs (each variant in its
own process: the resident-set high-water mark minus the resident set once model and inputs
exist), with the process's CPU time of the best run beside the wall time (other processes on a
loaded machine disturb it less); ratios are measured side by side in one run. With the planner's
default ``tree_min_saving`` (0.2) a shape whose tree saves less is kept flat by the plan: the
line says so, and the forced tree (``tree_min_saving=0``) is measured beside it.

**Route bytes.** For a group of ``group`` completions of a ``prompt``-token prompt, routes of a
48-layer top-8 MoE (uint8, 384 B per token) written by the capture as today (every completion its
own copy of the prompt's rows) and with the prompt's rows written once
(:func:`rollfeed.capture.capture_request_output` with a shared prompt), measured as bytes on disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rollfeed.bench._process import peak_bytes, resident_bytes, run_variant

MIB = 2**20
VOCAB = 1024


def _model(name: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rollfeed.demo.tiny_model import moe_config_kwargs

    torch.manual_seed(0)
    if name == "moe":
        return Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**moe_config_kwargs(max_position_embeddings=8192))
        )
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config)


def _routes(rng: np.random.Generator, rows: int, layers: int) -> np.ndarray:
    """``[rows, layers, 2]`` uint8: two distinct experts of 8 per row."""
    return np.argsort(rng.random((rows, layers, 8)), -1)[..., :2].astype(np.uint8)


def _samples(prompt: int, completion: int, group: int, layers: int | None):
    """The group's samples (a shared prompt; kept sets of 4 on completion tokens; routes of the
    prompt shared when ``layers`` is given) and their claimed prefixes."""
    from rollfeed.collate import Sample, SharedPrefixes

    rng = np.random.default_rng(0)
    head = rng.integers(0, VOCAB, prompt)
    shared_routes = None if layers is None else _routes(rng, prompt, layers)
    out = []
    for i in range(group):
        ids = np.concatenate([head, rng.integers(0, VOCAB, completion)])
        T = len(ids)
        counts = np.zeros(T, np.int64)
        counts[prompt:] = 4
        values = np.stack(
            [ids[prompt:], *(rng.integers(0, VOCAB, completion) for _ in range(3))], 1
        )
        fields = {"sampling_mask": (counts, values.reshape(-1).astype(np.int32))}
        if layers is not None:
            own = _routes(rng, completion - 1, layers)
            fields["routed_experts"] = np.concatenate([shared_routes, own])
        out.append(
            Sample(
                ids,
                loss_mask=np.arange(T) >= prompt,
                advantages=np.full(T, 0.5, np.float32),
                inference_logprobs=np.full(T, -1.0, np.float32),
                fields=fields,
                uid=f"s{i}",
            )
        )
    return out, SharedPrefixes.of_groups([0] * group, [prompt] * group)


def _child(args: argparse.Namespace) -> None:
    from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
    from rollfeed.models import PolicyScorer

    model = _model(args.model)
    layers = model.config.num_hidden_layers if args.model == "moe" else None
    samples, prefixes = _samples(args.prompt, args.completion, args.group, layers)
    flat = args.group * (args.prompt + args.completion)
    config = PlanConfig(
        seq_len=flat,
        trees=args.mode != "flat",
        tree_min_saving=0.0 if args.mode == "forced" else 0.2,
    )
    plan = prepare_batch(samples, config, dp_size=1, prefixes=prefixes)
    (mb,) = plan[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=0)
    scorer = PolicyScorer(model, compute_entropy=True, entropy_requires_grad=True)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = scorer.score(tmb)
        (-(out.logprobs.sum()) + 0.01 * out.entropy.sum()).backward()

    step()  # warm-up: one-time costs are not the variant's
    base, best, best_cpu = resident_bytes(), float("inf"), float("inf")
    for _ in range(args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    print(
        json.dumps(
            {
                "tokens": plan.metrics["tokens"],
                "trees": plan.metrics["trees"],
                "seconds": best,
                "cpu": best_cpu,
                "peak": peak_bytes() - base,
            }
        )
    )


def _measure(model: str, shape: tuple[int, int, int], mode: str, repeats: int) -> dict:
    prompt, completion, group = shape
    argv = ["--child", mode, "--model", model, "--repeats", str(repeats)]
    argv += ["--prompt", str(prompt), "--completion", str(completion), "--group", str(group)]
    return run_variant("rollfeed.bench.tree", argv, env={"OMP_NUM_THREADS": "1"})


def _report_scoring(args: argparse.Namespace) -> None:
    for shape in args.shapes:
        prompt, completion, group = shape
        print(
            f"group of {group}: prompt {prompt}, completions {completion}; forward+backward, "
            f"fp32 CPU, one thread, best of {args.repeats}"
        )
        for model in args.models:
            flat = _measure(model, shape, "flat", args.repeats)
            tree = _measure(model, shape, "tree", args.repeats)
            kept_flat = tree["trees"] == 0
            if kept_flat:
                forced = _measure(model, shape, "forced", args.repeats)
            for name, r in (("flat", flat), ("tree", tree)) + (
                (("forced tree", forced),) if kept_flat else ()
            ):
                ms, cpu, peak = r["seconds"] * 1e3, r["cpu"] * 1e3, r["peak"] / MIB
                print(
                    f"  {model:>5} {name:>11}  tokens {r['tokens']:6d}  {ms:9.1f} ms (CPU time "
                    f"{cpu:9.1f} ms)  peak {peak:8.1f} MiB"
                )
            if kept_flat:
                print(
                    f"  {model:>5}  the plan kept it flat (a tree saves "
                    f"{1 - forced['tokens'] / flat['tokens']:.0%} < tree_min_saving 20%); the "
                    f"forced tree takes {forced['seconds'] / flat['seconds']:.2f}x flat's time "
                    f"({forced['cpu'] / flat['cpu']:.2f}x in CPU time)"
                )
            else:
                print(
                    f"  {model:>5}  tree: {flat['tokens'] / tree['tokens']:.2f}x fewer tokens, "
                    f"{flat['seconds'] / tree['seconds']:.2f}x faster "
                    f"({flat['cpu'] / tree['cpu']:.2f}x in CPU time), "
                    f"{tree['peak'] / max(flat['peak'], 1):.2f}x flat's peak memory"
                )


def group_route_bytes(
    root: Path, *, prompt: int, completion: int, group: int, layers: int, top_k: int, shared: bool
) -> int:
    """Bytes on disk of one group's captured payload (routes and kept sets) under ``root``: one
    request of ``group`` completions (``shared``: the prompt's routes written once, as the
    capture does) or, as before, each completion captured with its own copy of them."""
    from types import SimpleNamespace

    from rollfeed.capture import CaptureConfig, capture_request_output
    from rollfeed.payload import PayloadWriter

    rng = np.random.default_rng(0)
    ids = rng.integers(10, 1000, prompt).tolist()
    head = rng.integers(0, 128, (prompt, layers, top_k), dtype=np.uint8)
    outputs = []
    for _ in range(group):
        tokens = rng.integers(10, 1000, completion).tolist()
        own = rng.integers(0, 128, (completion - 1, layers, top_k), dtype=np.uint8)
        outputs.append(
            SimpleNamespace(
                token_ids=tokens,
                logprobs=[{t: 0.0} for t in tokens],
                routed_experts=np.concatenate([head, own]),
                sampling_mask=None,
            )
        )
    config = CaptureConfig(top_k=2, num_experts=128)
    request = SimpleNamespace(finished=True, prompt_token_ids=ids, outputs=outputs)
    with PayloadWriter(root, group="g", fsync="never") as writer:
        if shared:
            capture_request_output(writer, request, config)
        else:
            for out in outputs:
                one = SimpleNamespace(finished=True, prompt_token_ids=ids, outputs=[out])
                capture_request_output(writer, one, config)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _report_bytes(args: argparse.Namespace) -> None:
    print("route bytes per group (48 layers, top-8, uint8; bytes on disk, kept sets included)")
    for prompt, completion, group in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            today, once = (
                group_route_bytes(
                    Path(tmp) / mode,
                    prompt=prompt,
                    completion=completion,
                    group=group,
                    layers=48,
                    top_k=8,
                    shared=mode == "once",
                )
                for mode in ("today", "once")
            )
        print(
            f"  prompt {prompt}, {group} x {completion}: today {today / MIB:7.2f} MiB, prompt "
            f"written once {once / MIB:7.2f} MiB ({today / once:.2f}x less)"
        )


def _shape(text: str) -> tuple[int, int, int]:
    prompt, completion, group = (int(x) for x in text.split(":"))
    return prompt, completion, group


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m rollfeed.bench tree")
    p.add_argument("--shapes", nargs="+", type=_shape, default=[(2048, 512, 8), (256, 1024, 8)])
    p.add_argument("--models", nargs="+", choices=("dense", "moe"), default=["dense", "moe"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-bytes", action="store_true")
    p.add_argument("--child", choices=("tree", "flat", "forced"), help=argparse.SUPPRESS)
    p.add_argument("--model", choices=("dense", "moe"), help=argparse.SUPPRESS)
    for name in ("prompt", "completion", "group"):
        p.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.mode = args.child
        torch.set_num_threads(1)
        _child(args)
        return
    _report_scoring(args)
    if not args.skip_bytes:
        _report_bytes(args)


if __name__ == "__main__":
    main(sys.argv[1:])

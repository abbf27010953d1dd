"""``python -m rollfeed demo``: the whole pipeline on one CPU machine, in four stages.

1. build the tiny Qwen3-MoE and its tokenizer into the cache (once);
2. rollouts: a capture server (``python -m rollfeed serve``: vLLM samples, the server writes kept
   sets by handle) and a client process that turns its records into a step file
   (:mod:`rollfeed.demo.rollouts`); ``--server URL`` uses a running server instead;
3. trainer: ``torchrun`` starts 2 DP x 2 CP gloo ranks that load the step with
   ``build_dataloader``, score it with the ``PolicyScorer`` and train on it for ``STEPS`` AdamW
   steps under FSDP2, with a DCP checkpoint after each (:mod:`rollfeed.demo.trainer`);
4. report: text and a PNG (:mod:`rollfeed.demo.report`).

Each run works in a directory of its own, printed first: a fresh one under
``~/.cache/rollfeed/demo`` or the ``--workdir`` it is given, locked while it runs
(:mod:`rollfeed.demo.workdir`), so two demos on one machine never share files. A fresh run deletes
the run directories there beyond the newest five (``workdir.KEEP_RUNS``), never a running one.

Without vLLM it says how to install it and returns 2: the demo never fakes rollouts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from rollfeed.demo.workdir import KEEP_RUNS, DemoRun, DemoWorkdirInUseError, claim_workdir

RANKS, CP = 4, 2
STEPS = 3  # optimizer steps on the captured step (off-policy epochs)


def _stage(number: int, text: str) -> float:
    print(f"[{number}/4] {text}", flush=True)
    return time.perf_counter()


def _run(cmd: list[str], env: dict[str, str], what: str) -> None:
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-8000:])
        raise SystemExit(f"{what} failed with exit code {proc.returncode} (output above)")


def run_demo(
    workdir: str | os.PathLike[str] | None,
    *,
    prompts: int,
    samples: int,
    max_tokens: int,
    server: str | None = None,
    loss: tuple[str, ...] = (),
) -> int:
    """``loss``: the trainer's loss flags (``--clip-eps E``, ``--correction C``,
    ``--no-centering``; :mod:`rollfeed.demo.objective`)."""
    from rollfeed.capture.vllm_adapter import import_vllm

    try:
        import_vllm()
        import matplotlib  # noqa: F401  (the report's plot; checked before minutes of work)
    except ImportError as err:
        hint = "" if "vllm" in str(err).lower() else "pip install 'rollfeed[demo]' "
        print(f"rollfeed demo: {hint}{err}", file=sys.stderr)
        print("(`make demo` builds a virtualenv with the extras installed)", file=sys.stderr)
        return 2
    from rollfeed.demo.tiny_model import default_cache_dir

    try:
        with claim_workdir(workdir, base=default_cache_dir() / "demo") as run:
            return _run_stages(
                run,
                prompts=prompts,
                samples=samples,
                max_tokens=max_tokens,
                server=server,
                loss=loss,
            )
    except DemoWorkdirInUseError as err:
        print(f"rollfeed demo: {err}", file=sys.stderr)
        return 2


def _run_stages(
    run: DemoRun,
    *,
    prompts: int,
    samples: int,
    max_tokens: int,
    server: str | None,
    loss: tuple[str, ...],
) -> int:
    from rollfeed.demo.report import format_report, summarize, write_plot
    from rollfeed.demo.tiny_model import build_tiny_moe

    work = run.workdir
    kind = "a fresh directory for this run" if run.fresh else "locked for this run"
    print(f"work directory {work} ({kind})", flush=True)
    if run.pruned:
        print(
            f"      deleted {len(run.pruned)} older run directories (the newest {KEEP_RUNS} stay)"
        )
    for name in ("rollouts.json", "trainer.json", "demo.png"):
        (work / name).unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")

    t0 = _stage(1, "building the tiny Qwen3-MoE (random weights, local tokenizer)")
    model_dir = build_tiny_moe()
    print(f"      {model_dir} ({time.perf_counter() - t0:.1f} s)")

    t0 = _stage(2, f"rollouts via the capture server: {prompts} prompts x {samples} completions")
    from rollfeed.demo.rollouts import rollout_server

    with rollout_server(server, model_dir, work, run_id=run.run_id, env=env) as (url, started):
        print(f"      capture server {url} ({started:.1f} s to start)", flush=True)
        cmd = [sys.executable, "-m", "rollfeed.demo.rollouts", "--server", url]
        cmd += ["--server-start-s", f"{started:.3f}", "--model-dir", str(model_dir)]
        cmd += ["--workdir", str(work), "--prompts", str(prompts)]
        cmd += ["--samples-per-prompt", str(samples), "--max-tokens", str(max_tokens)]
        # Streams to the terminal: the client's progress bar shows the requests.
        proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"rollouts failed with exit code {proc.returncode}")
    print(f"      payload root {work / 'payload'} ({time.perf_counter() - t0:.1f} s)")

    t0 = _stage(
        3, f"trainer: torchrun {RANKS} ranks ({RANKS // CP} DP x {CP} CP, gloo), {STEPS} steps"
    )
    tenv = dict(env, OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        tenv.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={RANKS}", "-m", "rollfeed.demo.trainer"]
    cmd += ["--model-dir", str(model_dir), "--workdir", str(work), "--cp", str(CP)]
    cmd += ["--steps", str(STEPS), "--checkpoint-every", "1", *loss]
    shutil.rmtree(work / "checkpoints", ignore_errors=True)  # a rerun's are its own
    _run(cmd, tenv, "the trainer ranks")
    print(f"      checkpoints {work / 'checkpoints'}")
    print(f"      ({time.perf_counter() - t0:.1f} s)")

    _stage(4, "report")
    rollouts = json.loads((work / "rollouts.json").read_text())
    report = summarize(rollouts, json.loads((work / "trainer.json").read_text()))
    print(format_report(rollouts, report))
    plot = write_plot(report, work / "demo.png")
    print(f"plot       {plot}")
    print(f"inspect    python -m rollfeed inspect {work / 'payload'}")
    return 0

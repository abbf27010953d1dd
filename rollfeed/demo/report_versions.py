"""The demo report's policy versions: how stale the trained tokens were, the mismatch by version
lag, and a partial rollout (one the capture server continued across a weight update).

From ``trainer.json`` (:mod:`rollfeed.demo.trainer`), per step: ``tokens_by_lag`` (the loader's
loss tokens by lag, ``lag0``, ``lag1``, ...), ``stale_dropped`` (samples the staleness bound left
out) and ``partial`` (samples whose tokens span two versions, with their per-token versions as
the micro batch's ``versions`` tensor held them); in ``objective`` the objectives' metrics by lag
bucket (:mod:`rollfeed.objectives.version_lag`: ``lag0_tokens``, ``lag0_kl``, ``lag0_k3``,
``lag0_chi2``, ``lag1_...``). Lag 0: sampled by the weights being trained (on-policy); lag 1: by
the weights one step before (the sampler one step ahead).

Example (a run of 4 steps, the producer one step ahead)::

    by_lag(trainer["train"])[1] -> LagMismatch(lag=1, tokens=2210, kl=3.1e-04, k3=2.9e-04, ...)
    runs([-1, -1, 2, 2, 2, 3, -1]) -> [(-1, 2), (2, 3), (3, 1), (-1, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass

LAGS = (0, 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class LagMismatch:
    """The objectives' mismatch over the loss tokens of one lag (``None``: not computed, no
    token of that lag), the means weighted by each step's tokens."""

    lag: int
    tokens: int
    kl: float | None
    k3: float | None
    chi2: float | None


def lag_mismatch(records: list[dict], lag: int) -> LagMismatch:
    """``lag``'s mismatch over the steps ``records`` (token-weighted means of the steps')."""
    name = f"lag{lag}"
    tokens, sums = 0, {"kl": 0.0, "k3": 0.0, "chi2": 0.0}
    weights = {"kl": 0, "k3": 0, "chi2": 0}
    for record in records:
        m = record.get("objective", {})
        n = int(m.get(f"{name}_tokens", 0))
        tokens += n
        for key in sums:
            value = m.get(f"{name}_{key}")
            if value is not None and n:
                sums[key] += value * n
                weights[key] += n
    means = {k: (sums[k] / weights[k] if weights[k] else None) for k in sums}
    return LagMismatch(lag=lag, tokens=tokens, **means)


def by_lag(records: list[dict]) -> dict[int, LagMismatch]:
    """Lag 0 and lag 1 over every step."""
    return {lag: lag_mismatch(records, lag) for lag in LAGS}


def runs(versions: list[int]) -> list[tuple[int, int]]:
    """``(version, count)`` of each run of equal versions, in order."""
    out: list[tuple[int, int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def first_partial(records: list[dict]) -> tuple[int, dict] | None:
    """``(step, partial rollout)`` of the first step that trained one, or None."""
    for record in records:
        for partial in record.get("partial", []):
            return int(record["step"]), partial
    return None


def _num(value: float | None) -> str:
    return f"{'n/a':>10}" if value is None else f"{value:10.2e}"


def format_versions(trainer: dict) -> list[str]:
    """The report's lines on policy versions (see the module doc)."""
    records = trainer["train"]
    tokens: dict[str, int] = {}
    for record in records:
        for key, n in record.get("tokens_by_lag", {}).items():
            tokens[key] = tokens.get(key, 0) + n
    dropped = sum(int(r.get("stale_dropped", 0)) for r in records)
    partials = sum(len(r.get("partial", [])) for r in records)
    lags = ", ".join(f"{k.replace('lag', 'lag ')} {n}" for k, n in tokens.items() if n)
    lines = [
        f"versions   loss tokens by lag (trained step - sampling version): {lags or 'none'}; "
        f"max_staleness {trainer.get('max_staleness')} (on_stale {trainer.get('on_stale')!r}): "
        f"{dropped} samples dropped; {partials} partial rollouts (two versions in one sample)",
        "mismatch by version lag, every step (rollfeed.objectives, before each update)",
        f"  {'lag':>4} {'tokens':>7} {'KL(q‖p)':>10} {'k3':>10} {'χ²(p‖q)':>10}",
    ]
    for lag, m in by_lag(records).items():
        what = "sampled by the weights trained" if lag == 0 else "sampled one version earlier"
        lines.append(f"  {lag:>4} {m.tokens:>7} {_num(m.kl)} {_num(m.k3)} {_num(m.chi2)}  {what}")
    lines.append(f"  {'step':>4} " + " ".join(f"{'lag' + str(g) + ' k3':>10}" for g in LAGS))
    for record in records:
        m = record.get("objective", {})
        cells = " ".join(_num(m.get(f"lag{g}_k3")) for g in LAGS)
        lines.append(f"  {record['step']:>4} {cells}")
    found = first_partial(records)
    if found is None:
        lines.append(
            "partial rollout: none this run (every step's sampling ended before the weights "
            "changed)"
        )
    else:
        step, partial = found
        spans = ", ".join(
            f"{'none' if v < 0 else 'v' + str(v)} x{n}" for v, n in runs(partial["versions"])
        )
        lines.append(
            f"partial rollout: step {step}, sample {partial['sample']}: per-token versions in "
            f"the micro batch [{spans}]"
        )
    return lines


def plot_versions(trainer: dict, axes) -> None:
    """Two panels: k3 by lag per step; the partial rollout's per-token versions."""
    records = trainer["train"]
    steps = [r["step"] for r in records]
    width = 0.38
    for i, g in enumerate(LAGS):
        ys = [r.get("objective", {}).get(f"lag{g}_k3") for r in records]
        xs = [s + (i - 0.5) * width for s, y in zip(steps, ys, strict=True) if y is not None]
        axes[0].bar(xs, [y for y in ys if y is not None], width, label=f"lag {g}")
    # log scale: on-policy tokens sit at the numerics (1e-12), a lag of 1 near the drift
    axes[0].set(xlabel="optimizer step", ylabel="KL (k3), trainer vs sampler", yscale="log")
    axes[0].set_title("Mismatch by version lag")
    axes[0].set_xticks(steps)
    axes[0].legend()
    found = first_partial(records)
    if found is None:
        axes[1].set_title("No partial rollout this run")
        return
    step, partial = found
    axes[1].step(range(len(partial["versions"])), partial["versions"], where="post")
    axes[1].set(xlabel="token (label position)", ylabel="policy version (-1: none)")
    axes[1].set_title(f"A partial rollout of step {step}: versions per token")

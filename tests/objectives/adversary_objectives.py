"""Attack family ``objectives`` of the adversary harness (:mod:`tests.payload.adversary`): the
loss objectives over a grid of weights, the clip, centering, sequence weights and dtypes, on
rows whose log-ratio runs from ``-1e4`` to ``1e4``, with sampler logprobs at ``-9999``, ``-inf``
and NaN, rows without mask logprobs or kept sets, all-masked and no-loss batches.

Each case is one ``support_distribution`` + ``policy_loss`` + ``finish_metrics`` call and a
backward. The oracle (:mod:`tests.objectives.objectives_oracle`) predicts from the rows alone which
tokens are dropped, weigh 0 or overflow; a case is ``wrong`` when a term or a gradient is not
finite, a zero-weight or dropped token adds a non-zero term or gradient, the batch with those
tokens out of the loss mask gives other policy terms or gradients, a metric is NaN or a
divergence negative, a not-computed mean is present (or a present one named not computed), or a
refusal is not the one predicted (type and position); expected refusals count as ``refused``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from rollfeed.objectives import (
    MaskedIS,
    NoSamplerLogprobError,
    ObjectiveInputError,
    ObjectiveMissingInputError,
    ObjectiveOverflowError,
    PPOClip,
    ScoreCentering,
    SequenceWeight,
    TruncatedIS,
    TrustRegion,
    Unweighted,
    finish_metrics,
    policy_loss,
)
from tests.objectives.objectives_oracle import ess_computed, predict
from tests.objectives.rows import Row, batch, kept_of
from tests.payload.adversary_tally import Tally, Wrong

WEIGHTS = {
    "one": Unweighted(),
    "tis": TruncatedIS(cap=2.0),
    "tis_inf": TruncatedIS(cap=math.inf),
    "mis": MaskedIS(low=0.5, high=2.0),
    "mis_open": MaskedIS(),
    "trust": TrustRegion(eps=0.2, cap=2.0),
    "trust_open": TrustRegion(eps=0.3),
}
SEQUENCES = {
    "none": None,
    "cap": SequenceWeight(cap=2.0),
    "band_veto": SequenceWeight(statistic="mean", band=(0.5, 2.0), veto=1e-3),
}
LOG_RATIOS = (-1e4, -500, -100, -30, -3, -0.7, -0.05, 0.0, 0.05, 0.3, 3, 30, 100, 500, 9990)
DTYPES = {"float32": torch.float32, "float64": torch.float64}
NAN = float("nan")
# Rows every batch carries: no sampler logprob (dropped), q from inference_logprobs, a NaN off
# the loss, a singleton, a row without mask logprobs, one without a kept set, A = 0.
SPECIAL = (
    Row(lp=0.0, lq=-0.5, lq_label=-9999.0, inference=-9999.0, adv=-1.0),
    Row(lp=-0.1, lq=-0.5, mask=False, inference=-math.inf),
    Row(lp=-0.2, lq=-0.5, lq_label=-1e5, inference=-1e4 - 1),
    Row(lp=-0.4, lq=-0.5, lq_label=-1e5, inference=-0.45),
    Row(lp=-1e4, lq=-0.1, loss=False, inference=NAN),
    Row(lp=0.0, lq=0.0, width=1),
    Row(lp=-0.6, lq=-0.5, mask=False),
    Row(lp=-0.7, lq=-0.6, width=0),
    Row(lp=-0.3, lq=-0.2, adv=0.0),
)


def _grid_row(log_r: float, adv: float) -> Row:
    """A row whose label has ``log r ≈ log_r`` with both logprobs numbers (``> -9999``)."""
    if log_r < 0:
        return Row(lp=log_r - 0.2, lq=-0.2, adv=adv, width=4)
    u = 0.3 if log_r + 0.3 < 9990 else 0.0
    return Row(lp=-u, lq=-u - log_r, adv=adv)


def _leaves(b):  # type: ignore[no-untyped-def]
    return (b.z, b.extra)


def _grads(b, value: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    got = torch.autograd.grad(value, _leaves(b), retain_graph=True, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, _leaves(b), strict=True)]


def _run(rows, dtype, options, loss_mask=None, kept_options=None):  # type: ignore[no-untyped-def]
    b = batch(list(rows), dtype)
    _, kept, lp = kept_of(b, loss_mask, **(kept_options or {}))
    terms = policy_loss(
        kept,
        lp,
        b.advantages,
        positions=torch.arange(len(rows)),
        cu_seqlens=torch.arange(len(rows) + 1),
        **options,
    )
    return b, terms


def _check_metrics(m: dict, absent: set[str], ess: bool | None) -> None:
    if ess is not None:
        absent = absent - {"ess"} if ess else absent | {"ess"}
    elif "ess" in m["not_computed"]:
        absent = absent | {"ess"}
    if set(m["not_computed"]) != absent or absent & m.keys():
        raise Wrong(f"not computed {m['not_computed']}, expected {sorted(absent)}")
    for key, value in m.items():
        if key != "not_computed" and bool(torch.isnan(value)):
            raise Wrong(f"metric {key} is NaN")
    for key in ("kl", "chi2", "seq_chi2", "k3", "ess"):
        if key in m and not float(m[key]) >= 0:
            raise Wrong(f"metric {key} = {float(m[key])} < 0")
    if "ess" in m and float(m["ess"]) > 1 + 1e-9:
        raise Wrong(f"ess {float(m['ess'])} > 1")


def _attack(rows, dtype, options, absent: set[str]):  # type: ignore[no-untyped-def]
    """The grid case's attack: terms, gradients, zero and dropped tokens, removal, metrics."""
    weight, clip = options.get("weight"), options.get("clip")
    pred = predict(rows, dtype, weight, clip, options.get("sequence"))
    b, terms = _run(rows, dtype, options)
    for name in ("loss", "policy", "centering", "weight", "sequence_weight"):
        if not bool(torch.isfinite(getattr(terms, name)).all()):
            raise Wrong(f"terms.{name} not finite: {getattr(terms, name).tolist()}")
    coef = torch.linspace(0.5, 1.5, len(rows), dtype=dtype)
    if not all(bool(torch.isfinite(g).all()) for g in _grads(b, (coef * terms.loss).sum())):
        raise Wrong("a gradient is not finite")
    tiny = math.log(torch.finfo(dtype).tiny)
    zero = terms.weight == 0
    for j, p in enumerate(pred):
        if p["dropped"] or (p["zero"] and not p["amb"] and rows[j].loss):
            if not bool(zero[j]) or terms.policy[j] != 0:
                raise Wrong(f"token {j} (log r {p['log_r']:.4g}) weighs 0, term {terms.policy[j]}")
        elif rows[j].loss and not p["amb"] and p["log_f"] > tiny and bool(zero[j]):
            raise Wrong(f"token {j} (log r {p['log_r']:.4g}) weighs 0, predicted e^{p['log_f']}")
    out = torch.tensor([p["dropped"] for p in pred]) | (zero & b.loss_mask)
    dropped = torch.tensor([p["dropped"] for p in pred])
    silent = (terms.policy * out).sum() + (terms.centering * dropped).sum()
    if any(bool((g != 0).any()) for g in _grads(b, silent)):
        raise Wrong("a zero-weight or dropped token has a gradient")
    if int(terms.metrics["no_sampler_logprob"]) != int(dropped.sum()):
        raise Wrong(f"no_sampler_logprob {int(terms.metrics['no_sampler_logprob'])}")
    # The same batch with those tokens out of the loss mask: the same policy terms and gradients.
    b2, terms2 = _run(rows, dtype, options, loss_mask=b.loss_mask & ~out)
    if not torch.equal(terms2.policy, terms.policy):
        raise Wrong(f"removal changes the policy terms: {terms.policy} vs {terms2.policy}")
    for g, g2 in zip(
        _grads(b, (coef * terms.policy).sum()),
        _grads(b2, (coef * terms2.policy).sum()),
        strict=True,
    ):
        if not torch.equal(g, g2):
            raise Wrong("removal changes the policy gradient")
    _check_metrics(finish_metrics(terms.metrics), absent, ess_computed(pred, dtype))


def _refused(rows, dtype, options, error, pos, tensor=None, kept_options=None):  # type: ignore[no-untyped-def]
    """The case's attack when a refusal is predicted: exactly ``error`` at ``pos``."""

    def attack() -> None:
        try:
            _run(rows, dtype, options, kept_options=kept_options)
        except error as err:
            if err.pos != pos or (tensor is not None and err.tensor != tensor):
                raise Wrong(f"{type(err).__name__} at {err.tensor}[{err.pos}], not {pos}") from err
            raise
        raise Wrong(f"no {error.__name__} for token {pos}")

    return attack


def _configs():  # type: ignore[no-untyped-def]
    for wname, weight in WEIGHTS.items():
        for clip in (None, PPOClip(eps_low=0.2)):
            for sname, sequence in SEQUENCES.items():
                for center in (False, True):
                    options = dict(weight=weight, clip=clip, sequence=sequence)
                    if center:
                        options["centering"] = ScoreCentering(weight=weight, missing="skip")
                    desc = f"{wname} clip={clip is not None} seq={sname} centering={center}"
                    yield desc, options


def family_objectives(tally: Tally, workdir: Path, rng: np.random.Generator) -> None:
    """See the module doc."""
    # Tensors of a few dozen rows: one thread, or a loaded 2-core machine spends 5x the time
    # handing them between threads (this family runs in a child process of its own).
    torch.set_num_threads(1)
    scale = lambda: float(rng.uniform(0.25, 2.0))  # noqa: E731
    grid = [_grid_row(x, sign * scale()) for x in LOG_RATIOS for sign in (1, -1)]
    for desc, options in _configs():
        for dname, dtype in DTYPES.items():
            rows = [*grid, *SPECIAL]
            pred = predict(rows, dtype, options["weight"], options["clip"], options["sequence"])
            safe = [r for r, p in zip(rows, pred, strict=True) if not p["overflow"]]
            tally.case(
                f"{desc} {dname}", lambda r=safe, d=dtype, o=options: _attack(r, d, o, set())
            )
            for row, p in zip(rows, pred, strict=True):
                if p["overflow"] and not p["amb"]:
                    case = [*SPECIAL[:2], row]
                    tally.case(
                        f"{desc} {dname} overflow log r {p['log_r']:.4g} A {row.adv:.3g}",
                        _refused(case, dtype, options, ObjectiveOverflowError, 2),
                    )
    _special_cases(tally)


def _special_cases(tally: Tally) -> None:
    """All-masked, no-loss and no-mask batches; NaN logprobs, the error policies, bad inputs."""
    mis, clip = MaskedIS(low=0.5, high=2.0), PPOClip()
    per_token = {"k1", "k3", "log_ratio_mean", "log_ratio_std", "ess"} | {
        f"{f}_frac" for f in ("truncated", "masked", "seq_truncated", "seq_masked", "seq_vetoed")
    }
    kept_set = {"kl", "chi2", "log_mass", "seq_chi2"}
    outside = [_grid_row(x, a) for x in (-3, 3, 30, 9990) for a in (1.0, -1.0)]
    for dname, dtype in DTYPES.items():
        for c in (None, clip):
            for name, rows, weight, absent in (
                ("all masked", outside, mis, {"ess"}),
                ("no loss", [Row(loss=False, lp=-1e4, lq=-0.1)] * 4, mis, per_token | kept_set),
                ("only dropped", list(SPECIAL[:2]), Unweighted(), per_token | kept_set),
                ("no mask logprobs", [Row(mask=False)] * 3, TruncatedIS(cap=2.0), kept_set),
            ):
                options = dict(weight=weight, clip=c)
                tally.case(
                    f"{name} clip={c is not None} {dname}",
                    lambda r=rows, d=dtype, o=options, a=absent: _attack(r, d, o, a),
                )
            base = [Row(lp=-0.5, lq=-0.6), Row(lp=-1.0, lq=-0.8, adv=-1.0)]
            options = dict(weight=mis, clip=c)
            for row, error, tensor, kept_options, extra in (
                (Row(lq_label=NAN, inference=NAN), ObjectiveInputError, "mask_logprobs", None, {}),
                (Row(lq_label=-math.inf, inference=NAN), ObjectiveInputError, None, None, {}),
                (Row(lq_label=math.inf), ObjectiveInputError, "mask_logprobs", None, {}),
                (SPECIAL[0], NoSamplerLogprobError, None, dict(no_sampler_logprob="error"), {}),
                (SPECIAL[1], NoSamplerLogprobError, None, dict(no_sampler_logprob="error"), {}),
                (Row(mask=False), ObjectiveMissingInputError, "mask_logprobs", None, "center"),
                (Row(width=0), ObjectiveMissingInputError, "support", None, "center"),
            ):
                o = options | (dict(centering=ScoreCentering(weight=mis)) if extra else {})
                tally.case(
                    f"refuse {error.__name__} {row} clip={c is not None} {dname}",
                    _refused([*base, row], dtype, o, error, 2, tensor, kept_options),
                )

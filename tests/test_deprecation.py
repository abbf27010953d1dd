"""The kept set's public names became ``support`` names: every old name still works for one
release, and each use of it raises a ``DeprecationWarning`` naming the new one (docs/changes.md).

Old names are not public: neither in ``__all__`` nor in the package namespace
(tests/test_public_api.py holds the new names).
"""

from __future__ import annotations

import importlib
import pickle

import numpy as np
import pytest
import torch

from rollfeed.collate import PlanConfig, RaggedRows, prepare_batch, to_tensor_micro_batch
from rollfeed.models import PolicyScorer, SupportScores, fused_support_logprobs, support_logprobs
from rollfeed.objectives import ScoreCentering, finish_metrics, policy_loss
from tests.dist.policy_cases import make_samples
from tests.models.tiny import tiny_qwen3
from tests.objectives.rows import Row, batch, kept_of

RENAMED_NAMES = [
    ("rollfeed.objectives", "KeptDistribution", "SupportDistribution"),
    ("rollfeed.objectives", "kept_distribution", "support_distribution"),
    ("rollfeed.collate", "KeptSetError", "SupportSetError"),
]


def _warns(new: str):  # type: ignore[no-untyped-def]
    """Expect a DeprecationWarning that names ``new``."""
    return pytest.warns(DeprecationWarning, match=rf"deprecated: use .*{new}")


@pytest.mark.parametrize(("package", "old", "new"), RENAMED_NAMES)
def test_an_old_name_imports_as_the_new_one_with_a_warning(package, old, new):
    module = importlib.import_module(package)
    with _warns(f"{package}.{new}"):
        got = getattr(module, old)
    assert got is getattr(module, new)
    with _warns(new):
        exec(f"from {package} import {old} as imported", ns := {})
    assert ns["imported"] is got
    assert old not in module.__all__ and old not in vars(module)
    with pytest.raises(AttributeError, match="no attribute 'KeptNothing'"):
        module.KeptNothing  # noqa: B018


def test_the_old_error_name_still_catches_the_error():
    from rollfeed.collate import SupportSetError

    with _warns("SupportSetError"):
        from rollfeed.collate import KeptSetError
    with pytest.raises(KeptSetError):
        raise SupportSetError("the kept set does not hold its token")


def _support_case():
    logits = torch.randn(4, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([3, 7, 1, 0])
    support = RaggedRows.from_lengths(torch.tensor([3, 1, 2, 0]), torch.tensor([3, 4, 5, 7, 1, 2]))
    return logits, labels, support


def test_the_scorers_take_the_old_keyword_and_scores_read_the_old_attribute():
    logits, labels, support = _support_case()
    new = support_logprobs(logits, labels, support, return_support_logprobs=True)
    with _warns("return_support_logprobs"):
        old = support_logprobs(logits, labels, support, return_kept_logprobs=True)
    assert torch.equal(old.support_logprobs.values, new.support_logprobs.values)
    with _warns("SupportScores.support_logprobs"):
        assert old.kept_logprobs is old.support_logprobs
    hidden, weight = torch.randn(4, 5, dtype=torch.float64), torch.randn(11, 5, dtype=torch.float64)
    with _warns("return_support_logprobs"):
        fused = fused_support_logprobs(hidden, weight, labels, support, return_kept_logprobs=True)
    assert fused.support_logprobs is not None and fused.support_logprobs.nnz == support.nnz
    with pytest.raises(TypeError, match="give only return_support_logprobs="):
        support_logprobs(
            logits, labels, support, return_kept_logprobs=True, return_support_logprobs=True
        )
    assert "kept_logprobs" not in {f.name for f in SupportScores.__dataclass_fields__.values()}


def test_the_policy_scorer_takes_the_old_keyword():
    torch.manual_seed(0)
    plan = prepare_batch(make_samples(0, [9, 6]), PlanConfig(seq_len=16), dp_size=1)
    mb = to_tensor_micro_batch(plan[0][0], cp_rank=0)
    scorer = PolicyScorer(tiny_qwen3())
    new = scorer.score(mb, return_support_logprobs=True).support_logprobs
    with _warns("PolicyScorer.score\\(return_support_logprobs"):
        old = scorer.score(mb, return_kept_logprobs=True).support_logprobs
    assert torch.equal(old.values, new.values) and old.nnz > 0


def test_the_objectives_take_the_old_keywords_attribute_and_counter():
    b = batch([Row(lp=-0.5, lq=-0.6), Row(lp=-0.3, lq=-0.2, adv=-1.0), Row(width=0)])
    support_lp, distribution, lp = kept_of(b)
    kw = dict(labels=b.labels, loss_mask=b.loss_mask, inference_logprobs=b.inference)
    from rollfeed.objectives import support_distribution

    with _warns(r"support_distribution\(support_logprobs"):
        old = support_distribution(b.support, kept_logprobs=support_lp, mask_logprobs=b.mask, **kw)
    assert torch.equal(old.log_q, distribution.log_q)
    with _warns("SupportDistribution.no_support"):
        assert torch.equal(old.no_kept_set, distribution.no_support)
    with _warns(r"policy_loss\(distribution"):
        terms = policy_loss(kept=distribution, logprobs=lp, advantages=b.advantages)
    new = policy_loss(distribution, lp, b.advantages, centering=ScoreCentering(missing="skip"))
    assert torch.equal(terms.loss, policy_loss(distribution, lp, b.advantages).loss)
    for metrics in (distribution.counts, new.metrics, finish_metrics(new.metrics)):
        assert int(metrics["rows_no_support"]) == 1  # the row without a kept set
        assert "rows_no_kept_set" not in metrics and "rows_no_kept_set" not in list(metrics)
        with _warns(r"metrics\['rows_no_support'\]"):
            assert metrics["rows_no_kept_set"] is metrics["rows_no_support"]
        with _warns("rows_no_support"):
            assert metrics.get("rows_no_kept_set") is metrics["rows_no_support"]
        assert metrics.get("kept_nothing", 7) == 7
        with pytest.raises(KeyError):
            metrics["kept_nothing"]


def test_a_renamed_metric_key_reads_after_pickling_and_copying():
    from rollfeed.capture import support_from_logprob_rows
    from rollfeed.capture.kept_set import LogprobRows

    rows = LogprobRows(
        offsets=np.array([0, 2, 3]),
        token_ids=np.array([5, 9, 4]),
        logprobs=np.array([-0.1, -2.4, 0.0]),
    )
    capture = support_from_logprob_rows(rows, np.array([5, 4]), requested=3)
    for metrics in (capture.metrics, pickle.loads(pickle.dumps(capture.metrics))):
        assert metrics["support_ids"] == 3
        with _warns(r"metrics\['support_ids'\]"):
            assert metrics["kept_ids"] == 3
    copied = capture.metrics.copy()
    with _warns("support_ids"):
        assert copied["kept_ids"] == 3

"""Kept sets from processed-logprob rows and native masks, and the replay policies."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from rollfeed.capture import (
    CaptureError,
    LogprobRows,
    SupportBoundError,
    SupportMembershipError,
    support_from_logprob_rows,
    support_from_native_mask,
)

INF = math.inf


def rows_of(*dicts):
    return LogprobRows.from_dicts(list(dicts))


def reference(dicts, sampled, requested):
    """Per-row loop, written from the rule: kept = finite entries, plus the sampled id in repair."""
    out = []
    for row, y in zip(dicts, sampled, strict=True):
        kept = {t: lp for t, lp in row.items() if math.isfinite(lp)}
        member = y in kept
        bound = len(kept) >= requested
        if not member:
            kept[y] = row.get(y, -INF)
        y_lp = row.get(y, -INF)
        out.append(
            (
                sorted(kept),
                [kept[t] for t in sorted(kept)],
                y_lp if math.isfinite(y_lp) else 0.0,
                member and not bound,
            )
        )
    return out


def test_docstring_example():
    rows = rows_of({7: -0.4, 3: -1.1, 9: -INF}, {5: -0.2, 7: -1.9, 2: -2.5})
    with pytest.raises(SupportBoundError) as err:
        support_from_logprob_rows(rows, [7, 5], requested=3)
    assert err.value.token == 1 and "top_k" in str(err.value)
    got = support_from_logprob_rows(rows, [7, 5], requested=3, policy="repair")
    assert got.counts.tolist() == [2, 3]
    assert got.ids.tolist() == [3, 7, 2, 5, 7]
    np.testing.assert_allclose(got.logprobs, [-1.1, -0.4, -2.5, -0.2, -1.9], rtol=1e-6)
    np.testing.assert_allclose(got.sampled_logprobs, [-0.4, -0.2], rtol=1e-6)
    assert got.trainable.tolist() == [True, False]
    assert got.ids.dtype == np.int32 and got.logprobs.dtype == np.float32
    assert got.metrics == {
        "rows": 2,
        "support_ids": 5,
        "singleton_rows": 0,
        "rows_not_member": 0,
        "rows_bound": 1,
        "rows_repaired": 1,
    }


def test_singleton_and_empty_completion():
    got = support_from_logprob_rows(rows_of({4: 0.0, 1: -INF, 2: -INF}), [4], requested=3)
    assert got.counts.tolist() == [1] and got.ids.tolist() == [4]
    assert got.metrics["singleton_rows"] == 1 and got.trainable.all()
    empty = support_from_logprob_rows(rows_of(), [], requested=3)
    assert empty.counts.shape == (0,) and empty.ids.shape == (0,) and empty.metrics["rows"] == 0


def test_sampled_outside_kept_set_error_and_repair():
    # vLLM appends the sampled token when it is outside the top k; here it came back -inf.
    rows = rows_of({3: -0.1, 8: -2.3, 5: -INF}, {1: -0.7, 2: -0.7, 6: -INF, 9: -INF})
    with pytest.raises(SupportMembershipError) as err:
        support_from_logprob_rows(rows, [3, 9], requested=3)
    assert err.value.token == 1 and "9" in str(err.value) and "[1, 2]" in str(err.value)
    got = support_from_logprob_rows(rows, [3, 9], requested=3, policy="repair")
    assert got.counts.tolist() == [2, 3]
    assert got.ids.tolist() == [3, 8, 1, 2, 9]  # 9 added so the trainer's label is in S
    assert got.logprobs[-1] == -np.inf
    assert got.trainable.tolist() == [True, False]
    assert got.sampled_logprobs.tolist()[1] == 0.0
    assert got.metrics["rows_not_member"] == 1 and got.metrics["rows_repaired"] == 1


def test_sampled_id_absent_from_the_row():
    got = support_from_logprob_rows(rows_of({3: -0.1, 8: -2.3}), [11], requested=3, policy="repair")
    assert got.ids.tolist() == [3, 8, 11] and not got.trainable[0]


def test_repeated_ids_count_once():
    flat = LogprobRows(
        offsets=np.array([0, 4]),
        token_ids=np.array([6, 6, 2, 4]),
        logprobs=np.array([-0.3, -0.3, -1.35, -INF]),
    )
    got = support_from_logprob_rows(flat, [6], requested=3)
    assert got.ids.tolist() == [2, 6] and got.counts.tolist() == [2] and got.trainable.all()


@pytest.mark.parametrize("seed", range(6))
def test_random_rows_match_the_per_row_reference(seed):
    rng = np.random.default_rng(seed)
    top_k = int(rng.integers(2, 6))
    requested = top_k + 1
    dicts, sampled = [], []
    for _ in range(int(rng.integers(1, 40))):
        vocab = rng.permutation(50)[: requested + 1]
        n_kept = int(rng.integers(1, requested + 1))  # == requested: a tie-like bound row
        lps = np.full(requested, -INF)
        lps[:n_kept] = np.log(rng.dirichlet(np.ones(n_kept)))
        row = dict(zip(vocab[:requested].tolist(), lps.tolist(), strict=True))
        y = int(rng.choice(vocab[:n_kept]))
        if rng.random() < 0.15:  # a sampled token the kept set does not hold
            y = int(vocab[requested])
            row[y] = -INF
        dicts.append(row)
        sampled.append(y)
    want = reference(dicts, sampled, requested)
    got = support_from_logprob_rows(rows_of(*dicts), sampled, requested=requested, policy="repair")
    assert got.counts.tolist() == [len(w[0]) for w in want]
    assert got.ids.tolist() == [t for w in want for t in w[0]]
    np.testing.assert_allclose(got.logprobs, [v for w in want for v in w[1]], rtol=1e-6)
    np.testing.assert_allclose(got.sampled_logprobs, [w[2] for w in want], rtol=1e-6)
    assert got.trainable.tolist() == [w[3] for w in want]
    assert 0 < got.metrics["rows_repaired"] < len(dicts) or len(dicts) < 5
    if all(w[3] for w in want):
        assert support_from_logprob_rows(rows_of(*dicts), sampled, requested=requested).metrics
    else:
        with pytest.raises((SupportMembershipError, SupportBoundError)):
            support_from_logprob_rows(rows_of(*dicts), sampled, requested=requested)


def test_logprob_objects_and_bad_rows():
    lp = SimpleNamespace
    rows = LogprobRows.from_dicts([{5: lp(logprob=-0.5, rank=1), 7: lp(logprob=-0.9, rank=2)}])
    assert rows.token_ids.tolist() == [5, 7] and rows.logprobs.tolist() == [-0.5, -0.9]
    with pytest.raises(CaptureError, match="sampled tokens"):
        support_from_logprob_rows(rows, [5, 7], requested=3)
    with pytest.raises(CaptureError, match="offsets"):
        LogprobRows(offsets=np.array([0, 2, 1]), token_ids=np.zeros(1), logprobs=np.zeros(1))
    with pytest.raises(CaptureError, match="ids and logprobs"):
        LogprobRows(offsets=np.array([0, 2]), token_ids=np.zeros(1), logprobs=np.zeros(2))
    with pytest.raises(CaptureError, match="policy"):
        support_from_logprob_rows(rows, [5], requested=3, policy="ignore")
    with pytest.raises(CaptureError, match=">= 2"):
        support_from_logprob_rows(rows, [5], requested=1)


def test_native_mask():
    rows = rows_of({9: -0.1, 4: -2.4, 1: -INF}, {3: -0.2, 8: -INF})
    got = support_from_native_mask([[4, 9], [3, 5]], [9, 3], rows=rows)
    assert got.ids.tolist() == [4, 9, 3, 5] and got.counts.tolist() == [2, 2]
    np.testing.assert_allclose(got.logprobs[:3], [-2.4, -0.1, -0.2], rtol=1e-6)
    assert got.logprobs[3] == -np.inf and got.metrics["mask_logprobs_missing"] == 1
    np.testing.assert_allclose(got.sampled_logprobs, [-0.1, -0.2], rtol=1e-6)
    assert got.metrics["rows_bound"] == 0 and got.trainable.all()
    with pytest.raises(SupportMembershipError) as err:
        support_from_native_mask([[4, 9], [3, 5]], [9, 8], rows=rows)
    assert err.value.token == 1
    repaired = support_from_native_mask([[4, 9], [3, 5]], [9, 8], rows=rows, policy="repair")
    assert repaired.ids.tolist() == [4, 9, 3, 5, 8] and repaired.trainable.tolist() == [True, False]
    with pytest.raises(CaptureError, match="logprob rows"):
        support_from_native_mask([[4]], [4], rows=rows)

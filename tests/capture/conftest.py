"""Capture tests share the session's capture server (tests/conftest.py: the suite's one vLLM
engine); the tiny model's directory also loads its HF twin for checks against an HF forward."""

import pytest

from rollfeed.capture import CaptureConfig

TOP_K = 5


@pytest.fixture(scope="session")
def model_dir(tiny_model):
    return tiny_model[0]


@pytest.fixture(scope="session")
def capture_config():
    return CaptureConfig(top_k=TOP_K, num_experts=8)

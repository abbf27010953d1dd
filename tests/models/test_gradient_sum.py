"""sum_gradients refuses, with a typed error, a module whose gradient reduction it does not know
(the FSDP2 and DDP cases run on real ranks: tests/dist/run_loss_norm.py)."""

from __future__ import annotations

import pytest
import torch

from rollfeed.models import GradientReductionError, ModelError, sum_gradients


@pytest.mark.parametrize("module", [torch.nn.Linear(2, 2), torch.nn.Sequential()])
def test_a_module_neither_fsdp2_nor_ddp_is_refused(module):
    with pytest.raises(GradientReductionError, match="fully_shard") as err:
        sum_gradients(module)
    assert isinstance(err.value, ModelError) and type(module).__name__ in str(err.value)

"""sum_gradients: data-parallel gradients summed over ranks, not averaged.

A loss normalised over the whole step (:func:`rollfeed.objectives.aggregate`) gives each rank its
own tokens' part of one global loss; its gradient is the SUM of the ranks' gradients. FSDP2 and
DDP average them by default (they divide by the ranks a gradient is reduced over), which would
scale the step's gradient by ``1 / world``, or, where the ranks' shares are uneven, weigh them
wrongly. The ``cp`` peers of a row hold parts of every token's gradient (attention mixes a rank's
shard with its peers'): summed too, on the same FSDP mesh (``dp × cp`` flattened, as torchtitan
shards its data and cp axes alike).

- FSDP2 (``fully_shard``): every ``FSDPModule`` under the root gets a gradient divide factor of 1
  and plain SUM collectives (``set_force_sum_reduction_for_comms``: otherwise FSDP may fold the
  factor into NCCL's ``PREMUL_SUM``, which gloo lacks).
- DDP (``DistributedDataParallel``): a comm hook that all-reduces each bucket with SUM and
  divides by nothing (DDP's default, like ``default_hooks.allreduce_hook``, divides by the
  group's size first). A DDP module takes one comm hook, before its first backward.

Example (4 ranks, each with its part of the step's loss)::

    fully_shard(layer, mesh=fsdp_mesh) for each layer; fully_shard(model, mesh=fsdp_mesh)
    sum_gradients(model)
    aggregate(terms.loss, mb).backward()      # grads: d(step loss)/dθ, summed over the 4 ranks
"""

# No ``from __future__ import annotations`` here: DDP checks a comm hook's annotations as objects
# (``dist.GradBucket``, ``Future[Tensor]``), and would refuse them as strings.
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from rollfeed.models.errors import GradientReductionError


def sum_gradients(module: nn.Module) -> None:
    """Make ``module``'s data-parallel gradient reduction a sum over its ranks (see the module
    doc); ``module``: the root an FSDP2 model was ``fully_shard``-ed at, or a
    ``DistributedDataParallel``. Anything else raises :class:`GradientReductionError`."""
    if isinstance(module, DistributedDataParallel):
        module.register_comm_hook(module.process_group, _all_reduce_sum)
        return
    if not isinstance(module, FSDPModule):
        raise GradientReductionError(
            f"sum_gradients takes the root module of an FSDP2 model (the one fully_shard was "
            f"called on last) or a DistributedDataParallel; got {type(module).__name__}, which "
            "is neither: shard it first, or pass the wrapper"
        )
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)


def _all_reduce_sum(
    group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the bucket's gradients all-reduced with SUM, not divided."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    assert work is not None  # async_op=True returns the work
    return work.get_future().then(lambda fut: fut.value()[0])

"""How the sharded-scoring tests shard a tiny Qwen3 / Qwen3-MoE with DTensor TP (FSDP2: the demo's
``shard_model``).

The TP plans follow the models' own ``base_model_tp_plan`` (transformers' qwen3 / qwen3_moe
configs): q/k/v ``colwise``, o ``rowwise``; the dense MLP's gate/up ``colwise``, down ``rowwise``;
``q_norm`` / ``k_norm`` ``replicated_with_grad_allreduce`` (they normalise each head, and under TP a
rank holds only its heads, so each rank's weight gradient covers its heads only and the replicas'
gradients must be summed over TP). The LM head is ``ColwiseParallel``: its weight is sharded on
the vocabulary (``Shard(0)``), the vocabulary-parallel head the scorer reads its TP group and
``vocab_start`` from; or (``head="replicated"``) the head is left whole on every rank as a
``Replicate()`` DTensor, which the scorer scores as unsharded. Everything else (embedding, layer
norms, the MoE router and experts) is replicated: each TP rank computes it on the same
replicated input, so its gradient is already the full one on every rank.

``q_norm`` / ``k_norm`` follow torchtitan's qwen3 plan: ``SequenceParallel(sequence_dim=2)``
declares the head dimension of their ``[B, S, heads, d]`` input sharded, which makes the weight a
``Replicate()`` DTensor whose gradient DTensor sums over TP (the all-reduce the HF plan names),
and hands the local heads back to HF's code (``use_local_output=True``).

With sequence-parallel norms (torchtitan's layout) the residual stream between blocks is sharded
on the sequence (``Shard(1)``): the embedding is vocabulary-parallel with a reduce-scatter out,
the layer norms and the final norm are ``SequenceParallel``, attention and MLP inputs are
all-gathered by ``PrepareModuleInput`` (HF passes attention its input as the keyword
``hidden_states``), o/down reduce-scatter back to ``Shard(1)``, and the hidden states enter the
LM head ``Shard(1)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

LAYERS = "model.layers.*"


def tp_plan(*, moe: bool, sequence_parallel: bool, head: str = "vocab") -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of a ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.

    MoE experts (and their router) are replicated over TP, not sharded on the intermediate
    dimension: every TP rank runs every expert on the whole (replicated) input.
    """
    out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        f"{LAYERS}.self_attn.q_proj": ColwiseParallel(),
        f"{LAYERS}.self_attn.k_proj": ColwiseParallel(),
        f"{LAYERS}.self_attn.v_proj": ColwiseParallel(),
        f"{LAYERS}.self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        f"{LAYERS}.self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        f"{LAYERS}.self_attn.o_proj": RowwiseParallel(output_layouts=out),
    }
    if head == "vocab":
        plan["lm_head"] = ColwiseParallel(input_layouts=out)
    if not moe:
        plan[f"{LAYERS}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{LAYERS}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{LAYERS}.mlp.down_proj"] = RowwiseParallel(output_layouts=out)
    if sequence_parallel:
        assert not moe, "the replicated MoE block would need its input gathered and output split"
        plan.update(
            {
                "model.embed_tokens": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(1)
                ),
                "model.norm": SequenceParallel(),
                f"{LAYERS}.input_layernorm": SequenceParallel(),
                f"{LAYERS}.post_attention_layernorm": SequenceParallel(),
                f"{LAYERS}.self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                f"{LAYERS}.mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        )
    return plan


def apply_tp(
    model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False, head: str = "vocab"
) -> None:
    """Shard ``model`` in place over the 1-D TP ``mesh``; ``head``: ``"vocab"`` (vocabulary-
    parallel, ``Shard(0)``) or ``"replicated"`` (``Replicate()``)."""
    moe = hasattr(model.config, "num_experts")
    plan = tp_plan(moe=moe, sequence_parallel=sequence_parallel, head=head)
    parallelize_module(model, mesh, plan)
    if head == "replicated":
        distribute_module(model.lm_head, mesh, input_fn=_replicated_input)


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    # What the head computes with: a plain hidden tensor is the same on every TP rank.
    return tuple(
        x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()]) for x in inputs
    )


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one full plain tensor (DTensors gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

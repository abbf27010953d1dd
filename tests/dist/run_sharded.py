"""Sharded scoring and training on 4 gloo ranks equals one unsharded float64 process.

Every configuration trains a tiny Qwen3 (or Qwen3-MoE, routing replayed) the way a torchtitan-style
trainer shards it, from one ``DeviceMesh`` (plans: :mod:`tests.dist.sharding_plans`):

    fsdp2      fully_shard over 2 ranks (each decoder layer and the root)
    tp2        DTensor TP 2, body and vocabulary-parallel LM head
    tp2_sp     TP 2 with sequence-parallel norms (hidden entering the head Shard(1))
    tp2_head_replicated   TP 2 body, the LM head a Replicate() DTensor (scored as unsharded)
    dp2_tp2    FSDP2 over dp 2 x TP 2 (dense and MoE)
    dp2_cp2    FSDP2 over the flattened dp 2 x cp 2, Ulysses over cp, zigzag rows (dense and MoE)
    cp2_tp2    FSDP2 over cp 2 x TP 2, Ulysses over cp, contiguous rows
    fsdp2_<hybrid>  fully_shard over 2 ranks of Qwen3-Next, Qwen3.5-MoE and Llama-4 (routing
               replayed; rollfeed's layers, their zero-centred norms in float64: the reference
               runs each sample alone through the same layers, :mod:`tests.models.hybrid_cases`;
               Llama-4 after its first update to FLOAT32_AFTER_UPDATE)

The 2-rank configurations run on each half of a ``(half, axis)`` mesh (both halves the same case).
Micro batches come from the planner (``prepare_batch`` for the mesh's dp size and cp layout, then
``to_tensor_micro_batch`` for this rank's cp rank, both read from ``Topology.from_mesh``), the
scorer from ``PolicyScorer.from_mesh``. Per configuration, against
:func:`tests.dist.sharded_reference.train_reference` on the union of the DP ranks' samples: the
logprobs, entropies and valid mask of both steps within 1e-10; the gradient of every parameter,
gathered to a full tensor, within 1e-10 at step 0 (the loss is ``Σ ℓ / global count``, so a
gradient twice too large fails); every parameter after 2 AdamW steps within 1e-10; replicas of
every TP-replicated parameter bitwise equal across TP after each step; and no ``[S, V]``-like
tensor in any scoring forward and backward (:class:`tests.dist.shape_record.ShapeRecord`, first
shown to catch the logits of a plain HF forward). The reference gives every parameter a gradient
far above the tolerance, so a gradient off by a factor (e.g. averaged instead of summed over the
data ranks) fails, as does a TP plan without the ``q_norm`` / ``k_norm`` gradient all-reduce
(their replicas drift apart after one step): both checked by hand.

Also here: an LM head placed ``Shard(1)`` is refused with ``LMHeadError`` naming the placement;
``Topology.from_mesh`` on torchtitan-style meshes selects the same data as the flat
``Topology.from_rank``, and unknown or ambiguous axes raise ``MeshAxisError``.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.demo.train import shard_model
from rollfeed.loaders import Topology
from rollfeed.models import LMHeadError, PolicyScorer
from tests.dist.policy_cases import make_samples, own_routing
from tests.dist.shape_record import ShapeRecord
from tests.dist.sharded_reference import (
    ADAMW,
    STEPS,
    Reference,
    loss_sum,
    loss_tokens,
    train_reference,
    whole_row,
)
from tests.dist.sharding_plans import apply_tp, full
from tests.dist.topology_meshes import check_topology_from_mesh
from tests.models.hybrid_cases import alone_forward, float64_norms, hybrid_model, rollfeed_model
from tests.models.tiny import tiny_qwen3, tiny_qwen3_moe

TOL = 1e-10
# Llama-4's router takes the sigmoid in float32 (and its rope rotates in float32), also in a float64
# model: after the first update the sharded and unsharded parameters differ by float64 rounding
# (gradients summed in another order), which can move a float32 rounding (measured: 5e-9 on the
# step-1 scores). Before any update it agrees to TOL; after, to the suite's float32 tolerance.
FLOAT32_AFTER_UPDATE = 1e-7
# Above the samples' ids (< 128) and odd: TP shards of 81 and 80 rows; no other width of the model.
VOCAB = 161
LENGTHS = [11, 6, 14, 9, 5, 13, 8, 10]
SEQ_LEN = 32  # < the hidden size 64, so no row length equals a parameter's width
SEED = 21


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """``dims``: the configuration's mesh axes, each of size 2 (one axis: a 2-rank sub-mesh of
    ``(half, axis)``); ``fsdp``: the axes ``fully_shard`` runs over (flattened when two)."""

    name: str
    dims: tuple[str, ...]
    moe: bool = False
    hybrid: str | None = None
    fsdp: tuple[str, ...] = ()
    sequence_parallel: bool = False
    head: str = "vocab"
    layout: str = "contiguous"


CASES = (
    Case(name="fsdp2", dims=("dp_shard",), fsdp=("dp_shard",)),
    Case(name="tp2", dims=("tp",)),
    Case(name="tp2_sp", dims=("tp",), sequence_parallel=True),
    Case(name="tp2_head_replicated", dims=("tp",), head="replicated"),
    Case(name="dp2_tp2", dims=("dp_shard", "tp"), fsdp=("dp_shard",)),
    Case(name="dp2_tp2_moe", dims=("dp_shard", "tp"), fsdp=("dp_shard",), moe=True),
    Case(name="dp2_cp2", dims=("dp_shard", "cp"), fsdp=("dp_shard", "cp"), layout="zigzag"),
    Case(
        name="dp2_cp2_moe",
        dims=("dp_shard", "cp"),
        fsdp=("dp_shard", "cp"),
        moe=True,
        layout="zigzag",
    ),
    Case(name="cp2_tp2", dims=("cp", "tp"), fsdp=("cp",)),
    *(
        Case(name=f"fsdp2_{family}", dims=("dp_shard",), fsdp=("dp_shard",), hybrid=family)
        for family in ("qwen3_next", "qwen3_5_moe", "llama4")
    ),
)


class Meshes:
    """One root mesh per axis tuple, built once by every rank in the same order; ``release``
    drops their references to the process groups before teardown."""

    def __init__(self) -> None:
        self.roots: dict[tuple[str, ...], DeviceMesh] = {}

    def get(self, dims: tuple[str, ...]) -> DeviceMesh:
        names = ("half", *dims) if len(dims) == 1 else dims
        if names not in self.roots:
            self.roots[names] = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        root = self.roots[names]
        return root[dims[0]] if len(dims) == 1 else root

    def release(self) -> None:
        for root in self.roots.values():
            root._pg_registry.clear()
        self.roots.clear()


def build(moe: bool | str) -> torch.nn.Module:
    """A tiny Qwen3 (``False``), Qwen3-MoE (``True``) or hybrid family (its name)."""
    if isinstance(moe, str):
        return float64_norms(hybrid_model(moe, SEED, vocab_size=VOCAB))
    return (tiny_qwen3_moe if moe else tiny_qwen3)(seed=SEED, vocab_size=VOCAB)


def samples_and_reference(moe: bool | str) -> tuple[list, Reference]:
    samples = make_samples(5, LENGTHS)
    if isinstance(moe, str):
        routing = own_routing(
            hybrid_model(moe, SEED, vocab_size=VOCAB), [s.token_ids for s in samples]
        )
        samples = make_samples(5, LENGTHS, own_routing=routing)
        ours = float64_norms(rollfeed_model(moe, SEED, vocab_size=VOCAB))
        return samples, train_reference(ours, samples, forward=alone_forward)
    sdpa = build(moe)
    sdpa.set_attn_implementation("sdpa")
    if moe:
        routing = own_routing(sdpa, [s.token_ids for s in samples])
        samples = make_samples(5, LENGTHS, own_routing=routing)
    return samples, train_reference(sdpa, samples)


def check_shape_record_sees_logits() -> None:
    """The recorder finds the ``[1, S, V]`` logits of a plain HF forward (so it can fail)."""
    model = build(moe=False)
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), ShapeRecord() as rec:
        model(input_ids=torch.arange(12)[None])
    found = rec.matching(vocab={VOCAB}, rows={12})
    assert (1, 12, VOCAB) in found, found


def check_refused_head(meshes: Meshes, samples: list) -> None:
    """An LM head sharded on the hidden dimension (``RowwiseParallel``: ``Shard(1)``) is refused
    with ``LMHeadError`` naming the placement, not scored."""
    mesh = meshes.get(("tp",))
    model = build(moe=False)
    parallelize_module(model, mesh, {"lm_head": RowwiseParallel()})
    (mb,) = prepare_batch(samples[:2], PlanConfig(seq_len=SEQ_LEN), dp_size=1)[0]
    with pytest.raises(LMHeadError, match=re.escape(f"placed {Shard(1)}")):
        PolicyScorer.from_mesh(model, mesh).score(to_tensor_micro_batch(mb, cp_rank=0))


def shard(case: Case, model: torch.nn.Module, mesh: DeviceMesh) -> None:
    if "tp" in case.dims:
        apply_tp(model, mesh["tp"], sequence_parallel=case.sequence_parallel, head=case.head)
    if len(case.fsdp) == 1:
        shard_model(model, mesh if mesh.ndim == 1 else mesh[case.fsdp[0]])
    elif case.fsdp:
        shard_model(model, mesh[case.fsdp]._flatten("_".join(case.fsdp)))


def compare_scores(case: Case, step: int, mb, out, ref: Reference) -> float:
    """Worst difference of this micro batch's scores to the reference's (sample coordinates)."""
    worst = 0.0
    scored = torch.zeros(mb.length, dtype=torch.bool)
    for sample, start in zip(mb.samples, mb.starts, strict=True):
        rows = slice(start, start + len(sample.token_ids) - 1)
        scored[rows] = True
        logp, ent, valid = ref.scores[step][sample.uid]
        where = f"{case.name} step {step} sample {sample.uid}"
        assert torch.equal(out.valid_mask[rows], valid), where
        for got, want in ((out.logprobs[rows], logp), (out.entropy[rows], ent)):
            diff = (got.detach() - want)[valid].abs()
            worst = max(worst, diff.max().item() if diff.numel() else 0.0)
    assert not out.valid_mask[~scored].any(), f"{case.name}: a padding row is scored"
    return worst


def check_replicas(case: Case, model: torch.nn.Module, mesh: DeviceMesh, step: int) -> None:
    """Every parameter replicated over TP holds bitwise the same values on every TP rank."""
    if "tp" not in case.dims:
        return
    group = mesh.get_group("tp")
    for name, p in model.named_parameters():
        local = p
        if isinstance(p, DTensor):
            # Under FSDP2 alone a TP-replicated parameter is a DTensor on the data axes only.
            names = p.device_mesh.mesh_dim_names
            if "tp" in names and not isinstance(p.placements[names.index("tp")], Replicate):
                continue
            local = p.to_local()
        parts = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(parts, local.detach().contiguous(), group=group)
        assert torch.equal(parts[0], parts[1]), f"{case.name} step {step}: {name} drifted"


def tolerance(case: Case, updates: int) -> float:
    """The tolerance of ``case`` after ``updates`` AdamW steps (see FLOAT32_AFTER_UPDATE)."""
    return FLOAT32_AFTER_UPDATE if case.hybrid == "llama4" and updates > 0 else TOL


def run_case(case: Case, meshes: Meshes, data: dict[bool | str, tuple[list, Reference]]) -> str:
    began = time.perf_counter()
    kind = case.hybrid or case.moe
    samples, ref = data[kind]
    mesh = meshes.get(case.dims)
    model = build(kind)
    shard(case, model, mesh)
    topo = Topology.from_mesh(mesh)
    scorer = PolicyScorer.from_mesh(
        model, mesh, compute_entropy=True, entropy_requires_grad=True, chunk_size=8
    )
    config = PlanConfig(
        seq_len=SEQ_LEN, cp_size=topo.cp_size, cp_layout=case.layout, pad_to_multiple_of=4
    )
    mine = prepare_batch(samples, config, dp_size=topo.dp_size)[topo.dp_rank]
    count = torch.tensor(sum(loss_tokens(mb) for mb in mine))
    if topo.dp_size > 1:
        dist.all_reduce(count, group=mesh.get_group(case.fsdp[0]))
    assert int(count) == ref.count, (case.name, int(count), ref.count)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    worst_scores = worst_grad = 0.0
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for mb in mine:
            whole = whole_row(mb)
            tmb = to_tensor_micro_batch(mb, cp_rank=topo.cp_rank)
            with ShapeRecord() as rec:
                out = scorer.score(tmb)
                loss = loss_sum(
                    out.logprobs, out.entropy, out.valid_mask, whole.loss_mask, whole.advantages
                )
                (loss / ref.count).backward()
            rows = {mb.length, mb.length // topo.cp_size, mb.length // 2}
            big = rec.matching(vocab={VOCAB, VOCAB // 2, -(-VOCAB // 2)}, rows=rows)
            assert not big, f"{case.name}: [S, V]-like tensors {big} (S in {rows})"
            if (case.moe or case.hybrid) and not mb.is_dummy:
                assert int(out.metrics["rows_replayed"]) > 0, case.name
            worst_scores = max(worst_scores, compare_scores(case, step, mb, out, ref))
        assert worst_scores < tolerance(case, step), (case.name, step, "scores", worst_scores)
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None, f"{case.name}: {name} got no gradient"
                worst_grad = max(worst_grad, (full(p.grad) - ref.grads[name]).abs().max().item())
            assert worst_grad < TOL, (case.name, "gradients", worst_grad)
        optimizer.step()
        check_replicas(case, model, mesh, step)
    worst_param = max(
        (full(p.detach()) - ref.params[n]).abs().max().item() for n, p in model.named_parameters()
    )
    assert worst_param < tolerance(case, STEPS), (case.name, "parameters", worst_param)
    return (
        f"case {case.name} rank {dist.get_rank()} ok: scores {worst_scores:.1e} gradients "
        f"{worst_grad:.1e} parameters {worst_param:.1e} ({time.perf_counter() - began:.1f} s)"
    )


def main() -> None:
    only = set(sys.argv[1:])
    began = time.perf_counter()
    check_shape_record_sees_logits()
    wanted = [c for c in CASES if not only or c.name in only]
    kinds = dict.fromkeys([False, True, *(c.hybrid for c in wanted if c.hybrid)])
    data = {kind: samples_and_reference(kind) for kind in kinds}
    print(f"reference rank {dist.get_rank()} {time.perf_counter() - began:.1f} s", flush=True)
    meshes = Meshes()
    try:
        for case in wanted:
            print(run_case(case, meshes, data), flush=True)
        check_refused_head(meshes, data[False][0])
        print(f"refused head rank {dist.get_rank()} ok", flush=True)
        began = time.perf_counter()
        check_topology_from_mesh(meshes)
        print(
            f"topology rank {dist.get_rank()} ok ({time.perf_counter() - began:.1f} s)", flush=True
        )
    finally:
        meshes.release()


def run_rank_and_exit() -> None:
    """``tests.dist.launch.run_rank`` without its final check that no gloo thread is left.

    After a functional collective (every DTensor redistribution, e.g. one ``full_tensor()``) the
    default process group keeps references that no Python container holds (measured with torch
    2.13: 12 instead of 2 after ``destroy_process_group``), so its gloo workers outlive the
    teardown and the interpreter's finalisation could abort on them (see
    ``tests/dist/launch.py``). After every group is destroyed and the output flushed, the rank
    ends without that finalisation; a failing rank still raises and exits non-zero.
    """
    dist.init_process_group("gloo")
    try:
        main()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_rank_and_exit()

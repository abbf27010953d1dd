"""The tiny Qwen3-VL-MoE scored packed over a cp group of 2 (contiguous and zigzag), and under
FSDP2 over 2 data-parallel ranks one of which holds no image.

cp: a planned row of samples with images (one image shared by three samples, a sample with two
images, a text-only sample) and recorded routing, split for cp 2. Every rank's gathered logprobs
and entropies equal the samples scored one at a time by the stock model (sdpa, its own mRoPE
index and image features, the recorded routes replayed) within 1e-5, and the parameter gradients
summed over the cp group -- language model and vision tower -- equal the reference's within 1e-4
relative. The vision tower's work is divided: each rank encodes its share of the row's distinct
images, every one encoded once in the group. A text-only row scores as the stock text forward.

FSDP2: the model sharded over both ranks (tower blocks, decoder layers, root); rank 0 scores a
micro batch with images, rank 1 a text-only one, so rank 1 joins the tower's collectives with a
dummy pass; the averaged gradients equal the mean of the two references' gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rollfeed.collate import PlanConfig, prepare_batch, to_tensor_micro_batch
from rollfeed.models import CPGroup, PolicyScorer
from tests.dist.launch import run_rank
from tests.dist.policy_cases import loss_weights
from tests.dist.run_train_resume import release_meshes
from tests.models.tiny_vlm import processor_spec, tiny_qwen3_vl_moe
from tests.models.vlm_cases import own_routing, vlm_reference, vlm_samples

LAYOUTS = [[3, "shared", 5], [2, "own", 3, "shared", 6], [7], [4, "shared", 2, "own", 4], [9]]
SPEC = processor_spec()
SCORE_TOL, GRAD_TOL = 1e-5, 1e-4


def _reference(mb, seed: int, weights: torch.Tensor):
    """The per-sample stock scores of ``mb`` and the gradients of the weighted loss."""
    model = tiny_qwen3_vl_moe(seed=seed)
    model.set_attn_implementation("sdpa")
    lp, ent, valid = vlm_reference(model, mb, SPEC)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), valid, grads


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def check_cp(cp: CPGroup, layout: str) -> None:
    stock = tiny_qwen3_vl_moe(seed=5)
    stock.set_attn_implementation("sdpa")
    routing = own_routing(stock, vlm_samples(1, LAYOUTS, SPEC), SPEC)
    samples = vlm_samples(1, LAYOUTS, SPEC, routing=routing)
    plan = prepare_batch(samples, PlanConfig(seq_len=128, cp_size=2, cp_layout=layout), dp_size=1)
    (mb,) = plan[0]
    w = loss_weights(mb.length, seed=2)
    lp, ent, valid, grads = _reference(mb, 5, w)
    scorer = PolicyScorer(
        tiny_qwen3_vl_moe(seed=5), cp=cp, compute_entropy=True, entropy_requires_grad=True
    )
    tmb = to_tensor_micro_batch(mb, cp_rank=cp.rank, image_processor=SPEC)
    out = scorer.score(tmb)
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
    assert torch.equal(out.valid_mask, valid) and int(valid.sum()) > 20, layout
    worst_lp = float((out.logprobs.detach() - lp).abs().max())
    worst_ent = float((out.entropy.detach() - ent).abs().max())
    assert worst_lp <= SCORE_TOL and worst_ent <= SCORE_TOL, (layout, worst_lp, worst_ent)
    assert int(out.metrics["rows_replayed"]) > 0, layout
    worst, seen = 0.0, set()
    for name, p in scorer.model.named_parameters():
        assert (p.grad is None) == (name not in grads), (layout, name)
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, group=cp.group)
        worst = max(worst, _relative(p.grad, grads[name]))
        seen.add(name.split(".")[1])
    assert worst <= GRAD_TOL, (layout, worst)
    assert {"visual", "language_model"} <= seen, seen
    images = torch.stack([out.metrics["images_encoded"], out.metrics["vision_patches"]])
    each = [torch.zeros_like(images) for _ in range(2)]
    dist.all_gather(each, images, group=cp.group)
    distinct = len(tmb.media.image_grid_thw)
    assert sum(int(e[0]) for e in each) == distinct == 3, each  # each image once in the group
    assert all(int(e[0]) > 0 for e in each), each  # both ranks encode a share
    if cp.rank == 0:
        print(f"cp2 {layout}: |dlogp| {worst_lp:.1e} |dH| {worst_ent:.1e} grad rel {worst:.1e}")


def check_text_row(cp: CPGroup) -> None:
    samples = vlm_samples(3, [[6], [11], [5]], SPEC)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=32, cp_size=2), dp_size=1)[0]
    tmb = to_tensor_micro_batch(mb, cp_rank=cp.rank)
    assert tmb.media is None
    out = PolicyScorer(tiny_qwen3_vl_moe(seed=4), cp=cp, compute_entropy=True).score(tmb)
    lp, _ent, valid, _ = _reference(mb, 4, loss_weights(mb.length))
    assert torch.equal(out.valid_mask, valid)
    assert float((out.logprobs.detach() - lp).abs().max()) <= SCORE_TOL
    assert int(out.metrics["images_encoded"]) == 0


def check_fsdp_dummy_pass() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    rank = dist.get_rank()
    layouts = [[3, "shared", 5], [2, "own", 6]] if rank == 0 else [[8], [6]]
    samples = vlm_samples(7 + rank, layouts, SPEC)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=64), dp_size=1)[0]
    w = loss_weights(mb.length, seed=rank)
    _, _, _, mine = _reference(mb, 6, w)
    model = tiny_qwen3_vl_moe(seed=6)
    for block in model.model.visual.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.model.visual, mesh=mesh)
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    scorer = PolicyScorer(model, compute_entropy=True, entropy_requires_grad=True)
    tmb = to_tensor_micro_batch(mb, cp_rank=0, image_processor=SPEC)
    assert (tmb.media is None) == (rank == 1)
    out = scorer.score(tmb)
    ((out.logprobs * w[0]).sum() + (out.entropy * w[1]).sum()).backward()
    assert int(out.metrics["images_encoded"]) == (2 if rank == 0 else 0)
    worst, checked = 0.0, 0
    for name, p in model.named_parameters():
        want = mine.get(name, torch.zeros(p.shape, dtype=p.dtype))
        dist.all_reduce(want)  # summed over the ranks; FSDP2 averages
        shards = (want / 2).chunk(2, dim=0)  # this rank's Shard(0) rows (no full_tensor: it
        want = shards[rank] if rank < len(shards) else want[:0]  # leaves gloo threads behind)
        got = p.grad.to_local()
        assert got.shape == want.shape, name
        if want.norm() > 0:
            worst, checked = max(worst, _relative(got, want)), checked + 1
    assert worst <= GRAD_TOL and checked > 20, (worst, checked)
    if rank == 0:
        print(f"fsdp2 image/text ranks: grad rel {worst:.1e}")


def main() -> None:
    cp = CPGroup(group=dist.group.WORLD, rank=dist.get_rank(), size=2)
    for layout in ("contiguous", "zigzag"):
        check_cp(cp, layout)
    check_text_row(cp)
    check_fsdp_dummy_pass()
    release_meshes()  # before run_rank destroys the groups (see the function)


if __name__ == "__main__":
    run_rank(main)

"""Vision-language models under packed scoring: images embedded by the model's own forward, the
vision tower's work spread over the ``cp`` group.

A VLM (Qwen3-VL, Qwen3-VL-MoE: an inner model with a ``visual`` tower and ``get_image_features``)
runs its normal forward; for the call the scorer swaps the inner model's ``get_image_features``
(:func:`image_features`, as :mod:`rollfeed.models.support_head` swaps the head's forward), so the
model embeds the rank's tokens, scatters image rows into its placeholder tokens and adds the
deepstack features where its own code does, while the rows come from:

1. this rank's share of the row's distinct images (``MediaBatch.image_owner == cp.rank``),
   encoded by the tower in one call;
2. :func:`~rollfeed.models.vision_exchange.exchange`: each merged-patch row (main and deepstack
   features side by side) sent to the rank that holds its placeholder token.

Collectives stay aligned whatever a rank holds: with ``cp`` every rank joins the exchange (an
empty share is an empty tensor that still carries a gradient, so the backward's all-to-all runs
everywhere), and a tower sharded with FSDP2 (:func:`tower_sharded`) runs on every micro batch:
a rank that encodes nothing (a text-only micro batch, or no image dealt to it) encodes one tiny
blank image instead and keeps none of its rows, so its all-gathers and reduce-scatters match its
peers' (a *dummy pass*; its parameters get zero gradient from it).

Example (a row of two samples sharing one image, cp 2, rank 0 encodes it)::

    rank 0: tower(pixel_values [16, D]) -> 4 rows; keeps 1, sends 3 to rank 1
    rank 1: no tower call (or a dummy pass under FSDP2); receives 3 rows
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rollfeed.models.cp_group import CPGroup
from rollfeed.models.errors import PackingError
from rollfeed.models.vision_exchange import exchange, exchange_plan

if TYPE_CHECKING:
    from rollfeed.collate import MediaBatch, TensorMicroBatch


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class VisionSite:
    """Where a VLM embeds images: the ``inner`` model (holding ``get_image_features``), its
    ``tower``, the merge size, hidden width of a merged row, deepstack levels, the image
    placeholder token and the width of a pixel row."""

    inner: nn.Module
    tower: nn.Module
    merge: int
    hidden: int
    deepstack: int
    image_token_id: int
    patch_dim: int


def find_vision(model: nn.Module) -> VisionSite | None:
    """The model's :class:`VisionSite`, or None for a text-only model."""
    for module in model.modules():
        tower = getattr(module, "visual", None)
        if isinstance(tower, nn.Module) and callable(getattr(module, "get_image_features", None)):
            config = tower.config
            return VisionSite(
                inner=module,
                tower=tower,
                merge=int(config.spatial_merge_size),
                hidden=int(config.out_hidden_size),
                deepstack=len(getattr(config, "deepstack_visual_indexes", None) or ()),
                image_token_id=int(model.config.image_token_id),
                patch_dim=int(config.in_channels)
                * int(getattr(config, "temporal_patch_size", 1))
                * int(config.patch_size) ** 2,
            )
    return None


def tower_sharded(site: VisionSite) -> bool:
    """Whether the tower holds FSDP2 modules (its forward then runs collectives)."""
    return any(isinstance(m, FSDPModule) for m in site.tower.modules())


def check_placeholders(site: VisionSite, tmb: TensorMicroBatch) -> None:
    """The image placeholder tokens of ``tmb`` are exactly its images' runs (one host sync);
    else the model would scatter image rows into other tokens."""
    media = tmb.media
    assert media is not None
    differ = (tmb.input_ids == site.image_token_id) != media.image_mask
    if bool(differ.any()):
        at = int(differ.nonzero()[0, 0])
        raise PackingError(
            f"token at row position {int(tmb.positions[at])} is "
            f"{'an' if bool(media.image_mask[at]) else 'not an'} image record's placeholder but "
            f"token id {int(tmb.input_ids[at])} (the model's image token is "
            f"{site.image_token_id}); give each image's run of placeholder tokens in token_ids",
            tensor="input_ids",
            pos=int(tmb.positions[at]),
        )


def _encode(
    site: VisionSite, media: MediaBatch | None, cp: CPGroup, dummy: bool
) -> tuple[torch.Tensor, int, int]:
    """``([M, F] features of this rank's images, images, patches)``; F holds the main rows and
    each deepstack level's side by side. A dummy pass keeps no row (see the module doc)."""
    dtype = next(site.tower.parameters()).dtype
    device = next(site.tower.parameters()).device
    width = site.hidden * (1 + site.deepstack)
    grids = (
        []
        if media is None
        else [
            g
            for g, o in zip(media.image_grid_thw.tolist(), media.image_owner.tolist(), strict=True)
            if o == cp.rank
        ]
    )
    if grids:
        pixels = media.pixel_values.to(dtype)  # type: ignore[union-attr]
        grid = torch.tensor(grids, dtype=torch.int64, device=device)
        keep = None
    elif dummy:
        m = site.merge
        pixels = torch.zeros(m * m, site.patch_dim, dtype=dtype, device=device)
        grid = torch.tensor([[1, m, m]], dtype=torch.int64, device=device)
        keep = 0
    else:  # nothing to encode: an empty share that still carries a gradient
        empty = torch.zeros(0, width, dtype=dtype, device=device, requires_grad=True)
        return empty, 0, 0
    out = site.tower(pixels, grid_thw=grid)
    deep = list(getattr(out, "deepstack_features", None) or [])
    features = torch.cat([out.pooler_output, *deep], dim=-1)
    if keep is not None:
        return features[:keep], 0, 0
    return features, len(grids), sum(math.prod(g) for g in grids)


@dataclass(kw_only=True, slots=True, eq=False)
class VisionCall:
    """What one forward of a VLM takes besides its tokens (``kwargs``: the pixels that make the
    forward embed images, the mRoPE positions and token types), and what its vision pass did
    (``counts``: ``images_encoded`` and ``vision_patches`` of this rank, once it ran)."""

    kwargs: dict[str, Any]
    counts: dict[str, int]


@contextmanager
def image_features(
    site: VisionSite,
    media: MediaBatch | None,
    cp: CPGroup,
    *,
    order: torch.Tensor,
    dummy: bool,
) -> Iterator[VisionCall]:
    """For the call: ``site.inner.get_image_features`` gives this rank's placeholder rows (see
    the module doc). ``order [S]``: the row position of every token of the ``cp`` group in rank
    order (the packed layout's); ``dummy``: run the tower even when it has nothing to encode."""
    counts: dict[str, int] = {}

    def ours(pixel_values: torch.Tensor, image_grid_thw: Any = None, **_: Any) -> Any:
        features, images, patches = _encode(site, media, cp, dummy)
        counts.update(images_encoded=images, vision_patches=patches)
        if media is None:
            rows = features[:0]
        else:
            plan = exchange_plan(
                spans=media.image_spans.cpu().numpy(),
                grids=media.image_grid_thw.cpu().numpy(),
                owner=media.image_owner.cpu().numpy(),
                merge=site.merge,
                order=order.cpu().numpy(),
                cp_rank=cp.rank,
                cp_size=cp.size,
                device=features.device,
            )
            rows = exchange(features, plan, cp)
        main, *deep = rows.split(site.hidden, dim=-1)
        out = SimpleNamespace(pooler_output=(main,))
        if site.deepstack:
            out.deepstack_features = [(d,) for d in deep]
        return out

    inner = site.inner
    before = inner.__dict__.get("get_image_features")
    inner.get_image_features = ours
    try:
        if media is None:
            kwargs: dict[str, Any] = {
                "pixel_values": torch.zeros(0, site.patch_dim, device=order.device)
            }
        else:
            kwargs = {
                "pixel_values": media.pixel_values,
                "position_ids": media.mrope_position_ids.reshape(3, 1, -1),
                "mm_token_type_ids": media.mm_token_type_ids.reshape(1, -1),
            }
        yield VisionCall(kwargs=kwargs, counts=counts)
    finally:
        if before is None:
            del inner.get_image_features  # the class's own method again
        else:
            inner.get_image_features = before

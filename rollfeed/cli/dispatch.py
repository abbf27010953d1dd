"""``python -m rollfeed COMMAND``: the arguments parsed, the command run, its exit status.

Only the chosen command's modules are imported (``serve --help`` and every ``--help`` stay free
of torch and vLLM). Exit statuses: 0 clean, 1 findings, 2 usage error; argparse's own errors
(unknown flag, missing argument) and a :class:`~rollfeed.cli.errors.UsageError` print one line
on stderr and give 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from rollfeed.cli.errors import UsageError
from rollfeed.cli.parser import build_convert_parser, build_parser
from rollfeed.cli.report import USAGE


def main(argv: list[str]) -> int:
    """Run ``python -m rollfeed`` with ``argv`` (the arguments after it); the exit status."""
    try:
        if argv[:1] == ["serve"]:
            from rollfeed.cli.serve_help import serve

            return serve(argv[1:])
        if argv[:2] == ["steps", "convert"]:
            from rollfeed.cli.step_convert import run_convert

            return run_convert(build_convert_parser().parse_args(argv[2:]))
        args = build_parser().parse_args(argv)
        return _run(args)
    except SystemExit as done:  # --help printed (0), or argparse's usage error printed (2)
        return done.code if isinstance(done.code, int) else USAGE if done.code else 0
    except UsageError as err:
        print(f"python -m rollfeed {argv[0]}: {err}", file=sys.stderr)
        return USAGE


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo" and args.multimodal:
        from rollfeed.demo.multimodal import run_multimodal_demo

        return run_multimodal_demo(
            args.workdir,
            prompts=args.prompts or 4,
            samples=args.samples,
            max_tokens=args.max_tokens or 8,
        )
    if args.command == "demo":
        from rollfeed.demo.run import run_demo

        return run_demo(
            args.workdir,
            prompts=args.prompts or 16,
            samples=args.samples,
            max_tokens=args.max_tokens or 48,
            server=args.server,
            loss=(
                *("--clip-eps", str(args.clip_eps)),
                *("--correction", args.correction),
                "--centering" if args.centering else "--no-centering",
            ),
        )
    if args.command == "retrain":
        from rollfeed.cli.retrain import run_retrain

        return run_retrain(args)
    if args.command == "inspect":
        from rollfeed.cli.inspect_root import run_inspect

        return run_inspect(args)
    if args.command == "verify" and args.steps is None:
        if args.checksums:
            raise UsageError(
                "--checksums goes with --steps (verify ROOT checks every block of every file)"
            )
        from rollfeed.cli.verify_root import run_verify_root

        return run_verify_root(args)
    if args.command == "verify":
        from rollfeed.cli.verify_steps import run_verify_steps

        return run_verify_steps(args)
    from rollfeed.cli.step_summary import run_steps

    assert args.command == "steps", args.command
    return run_steps(args)

"""The argument parser of ``python -m rollfeed``: every command but ``serve``'s flags
(:mod:`rollfeed.cli.serve_help`), built from the standard library alone so that ``--help`` and
a usage error answer at once."""

from __future__ import annotations

import argparse

EXIT_CODES = "exit status: 0 clean, 1 findings (listed), 2 usage error (a wrong argument)"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _report_flags(p: argparse.ArgumentParser, module: str) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON object instead of the text (its keys: python -m pydoc {module})",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="counts on stderr while it runs (default: when stderr is a terminal)",
    )


def _group_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="PATTERN",
        help="only the groups (directories under the root, e.g. step_000042) matching this "
        "shell-style glob, e.g. 'step_0000*'; repeat for several; one matching no group is "
        "an error",
    )


def build_parser() -> argparse.ArgumentParser:
    """``python -m rollfeed``'s parser; ``args.command`` names the command."""
    ap = argparse.ArgumentParser(prog="python -m rollfeed", epilog=EXIT_CODES)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "serve",
        help="vLLM's OpenAI server plus the capture route: --payload-root R --model M "
        "(python -m rollfeed serve --help)",
    )
    d = sub.add_parser(
        "demo", help="rollouts from a capture server by handle, scored by torchrun ranks (vLLM)"
    )
    d.add_argument(
        "--workdir",
        default=None,
        help="locked while the demo runs (default: a fresh directory under ~/.cache/rollfeed/demo)",
    )
    d.add_argument("--prompts", type=int, default=None, help="16 (--multimodal: 4)")
    d.add_argument("--samples", type=int, default=4, help="completions per prompt")
    d.add_argument("--max-tokens", type=int, default=None, help="48 (--multimodal: 8)")
    d.add_argument(
        "--multimodal",
        action="store_true",
        help="rollouts with images by a tiny vision-language MoE, captured by handle and trained "
        "on in one process (rollfeed.demo.multimodal)",
    )
    d.add_argument(
        "--server",
        default=None,
        help="a running capture server (http://host:port) with --payload-root WORKDIR/payload "
        "and the demo's model (default: the demo starts its own)",
    )
    d.add_argument("--clip-eps", type=float, default=0.2, help="the PPO clip's ε (0: no clip)")
    d.add_argument(
        "--correction",
        choices=("none", "tis", "icepop", "trust"),
        default="tis",
        help="the token-level importance weight (rollfeed.demo.objective)",
    )
    d.add_argument(
        "--centering", action=argparse.BooleanOptionalAction, default=True, help="score centering"
    )
    i = sub.add_parser(
        "inspect",
        help="summarise a payload root: fields, files, groups, bytes per row",
        description="What a payload root holds, per field and per group (headers and indexes "
        "only; verify checks every byte).",
        epilog=EXIT_CODES,
    )
    i.add_argument("root", help="the payload root directory")
    _group_flag(i)
    _report_flags(i, "rollfeed.cli.inspect_root")
    v = sub.add_parser(
        "verify",
        help="check a payload root's files, or (--steps) a step directory's records against it",
        description="Check every payload file under ROOT: headers, region chain, sizes, CSR "
        "indexes and the checksum of every block. With --steps DIR, check instead every record "
        "of every step file in DIR against ROOT: each sample read as the loader reads it, each "
        "segment record read back from ROOT.",
        epilog=EXIT_CODES,
    )
    v.add_argument("root", help="the payload root directory")
    _group_flag(v)
    v.add_argument(
        "--steps",
        metavar="DIR",
        help="check the records of the step files (step_NNNNNN.rfs) in DIR against ROOT",
    )
    v.add_argument(
        "--checksums",
        action="store_true",
        help="with --steps: also check the checksum of every block a record's read reads",
    )
    _report_flags(v, "rollfeed.cli.verify_root; with --steps: rollfeed.cli.verify_steps")
    s = sub.add_parser(
        "steps",
        help="per step of a step directory: samples, tokens, loss tokens, truncation, kept sets "
        "(steps convert DIR: JSON-lines step files as step record files)",
        description="Per step file in DIR: samples, tokens (min/median/max length), loss "
        "tokens; with --seq-len, what truncation would cut; with --root, kept-set widths. "
        "'steps convert DIR' converts JSON-lines step files (python -m rollfeed steps convert "
        "--help).",
        epilog=EXIT_CODES,
    )
    s.add_argument("dir", metavar="DIR", help="the step directory (step_NNNNNN.rfs files)")
    s.add_argument(
        "--seq-len",
        type=_positive,
        metavar="N",
        help="count the samples truncation at N tokens would cut and the tokens it would drop",
    )
    s.add_argument(
        "--root",
        metavar="ROOT",
        help="the payload root the records point into: adds kept-set widths (mean/p99/max)",
    )
    _report_flags(s, "rollfeed.cli.step_summary")
    r = sub.add_parser(
        "retrain",
        help="train again over recorded steps K..M with no inference: their records verified "
        "against the root first, then the demo's trainer from checkpoint K (torchrun)",
        description="Train steps K..M again from a run's log: every record of those step files "
        "is checked against ROOT (as verify --steps does), then the demo's trainer starts from "
        "checkpoint step_K (K=0: the weights of --model) and trains each step once, writing "
        "each step's loss, samples and weights digest to --out. The trainer's settings default "
        "to the ones checkpoint K recorded. It writes no checkpoint.",
        epilog="exit status: 0 trained, 1 findings (nothing trained) or the trainer failed, "
        "2 usage error",
    )
    r.add_argument("--steps", required=True, metavar="DIR", help="the step directory")
    r.add_argument("--root", required=True, metavar="ROOT", help="the payload root")
    r.add_argument("--checkpoints", required=True, metavar="DIR", help="the run's checkpoints")
    r.add_argument("--model", required=True, metavar="DIR", help="the weights of step 0")
    r.add_argument("--from", dest="start", type=int, required=True, metavar="K")
    r.add_argument("--to", dest="end", type=int, required=True, metavar="M", help="inclusive")
    r.add_argument("--out", default="retrain.json", help="the record (default retrain.json)")
    r.add_argument("--nproc", type=_positive, default=2, help="trainer ranks (the run's world)")
    r.add_argument("--checksums", action="store_true", help="also check every block's checksum")
    r.add_argument("--cp", type=_positive, help="default: as recorded")
    r.add_argument("--lr", type=float, help="default: as recorded")
    r.add_argument("--clip-eps", dest="clip_eps", type=float, help="default: as recorded")
    r.add_argument("--correction", choices=("none", "tis", "icepop", "trust"))
    r.add_argument("--centering", action=argparse.BooleanOptionalAction, default=None)
    r.add_argument("--seq-len", dest="seq_len", type=_positive, help="default: as recorded")
    r.add_argument("--dtype", choices=("float32", "float64"), help="default: as recorded")
    r.add_argument(
        "--max-staleness", dest="max_staleness", type=int, help="the loader's bound, as recorded"
    )
    r.add_argument("--on-stale", dest="on_stale", choices=("drop", "mask", "error"))
    return ap


def build_convert_parser() -> argparse.ArgumentParser:
    """``python -m rollfeed steps convert``'s parser."""
    ap = argparse.ArgumentParser(
        prog="python -m rollfeed steps convert",
        description="Write each JSON-lines step file of DIR (step_NNNNNN.jsonl) as the step "
        "record file the loader reads (step_NNNNNN.rfs); a step converted already is left as "
        "it is.",
        epilog=EXIT_CODES,
    )
    ap.add_argument("dir", metavar="DIR", help="the step directory")
    ap.add_argument(
        "--remove",
        action="store_true",
        help="delete each JSON-lines step file and its index once its step is converted",
    )
    return ap

"""The command line, ``python -m rollfeed COMMAND``:

- ``serve``: vLLM's OpenAI server plus the capture route (:mod:`rollfeed.cli.serve_help`;
  ``serve --help`` answers without importing vLLM, ``serve --help-vllm`` lists vLLM's flags);
- ``demo``: rollouts from a capture server, scored by torchrun ranks (:mod:`rollfeed.demo`);
- ``inspect ROOT``: what a payload root holds (:mod:`rollfeed.cli.inspect_root`);
- ``verify ROOT``: every payload file checked (:mod:`rollfeed.cli.verify_root`);
  ``verify ROOT --steps DIR``: every record of a step directory checked against the root
  (:mod:`rollfeed.cli.verify_steps`);
- ``steps DIR``: per step, samples, tokens, loss tokens, truncation and kept-set widths
  (:mod:`rollfeed.cli.step_summary`); ``steps convert DIR``: JSON-lines step files written as
  the step record files the loader reads (:mod:`rollfeed.cli.step_convert`).

``inspect``, ``verify`` and ``steps`` take ``--json`` (one JSON object on stdout, its keys in
each command's module doc), ``--progress`` / ``--no-progress`` (counts on stderr; by default
when stderr is a terminal) and ``inspect`` and ``verify`` ``--group PATTERN``
(:mod:`rollfeed.cli.groups`). Exit status: 0 clean, 1 findings (each listed), 2 usage error (a
wrong argument: a path that is not there or holds nothing the command reads, a group filter that
matches nothing), with one line on stderr saying what to give instead.

Example::

    $ python -m rollfeed verify /data/payload --group 'step_0001*' --json > report.json
    $ python -m rollfeed steps /data/steps --seq-len 32768 --root /data/payload
"""

from __future__ import annotations

from rollfeed.cli.dispatch import main


def inspect(root: str) -> int:
    """``python -m rollfeed inspect ROOT``: the text report, the exit status."""
    return main(["inspect", root])


def verify(root: str) -> int:
    """``python -m rollfeed verify ROOT``: the text report, the exit status."""
    return main(["verify", root])


__all__ = ["inspect", "main", "verify"]

"""Benchmarks: ``python -m rollfeed.bench NAME``.

Each benchmark is a module ``rollfeed.bench.NAME`` with ``main(argv) -> None``. Benchmarks print
ratios against a baseline measured in the same run (the machines are noisy; absolute times mean
little). They are not timed tests.
"""

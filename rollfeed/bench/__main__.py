"""Dispatch ``python -m rollfeed.bench NAME [ARGS...]`` to ``rollfeed.bench.NAME.main``."""

import importlib
import pkgutil
import sys

import rollfeed.bench


def _names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(rollfeed.bench.__path__) if m.name[0] != "_")


def main(argv: list[str]) -> int:
    names = _names()
    if not argv or argv[0] not in [*names, "all"]:
        sys.stderr.write(
            f"usage: python -m rollfeed.bench {{{'|'.join([*names, 'all'])}}} [ARGS...]\n"
        )
        return 2
    for name in names if argv[0] == "all" else [argv[0]]:
        importlib.import_module(f"rollfeed.bench.{name}").main(argv[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

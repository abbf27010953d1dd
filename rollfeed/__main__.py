"""``python -m rollfeed {demo,serve,inspect,verify}``."""

import sys

from rollfeed.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

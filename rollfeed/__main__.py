"""``python -m rollfeed {serve,demo,inspect,verify,steps}`` (:mod:`rollfeed.cli`)."""

import sys

from rollfeed.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""A benchmark child for tests/bench/test_process_memory.py: holds ``argv[1]`` MiB at once after
its base and prints the peak it measures above that base (JSON, as a bench child does)."""

import json
import sys

import numpy as np

from rollfeed.bench._process import peak_bytes, reset_peak, resident_bytes

if __name__ == "__main__":
    base = resident_bytes()
    reset_peak()
    held = np.ones(int(sys.argv[1]) << 20, np.uint8)  # written: every page resident
    del held
    print(json.dumps({"extra_bytes": peak_bytes() - base}))

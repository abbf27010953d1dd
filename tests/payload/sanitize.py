"""The compiled window read (``rollfeed/payload/read/_window.c``) under AddressSanitizer and
UndefinedBehaviorSanitizer: ``make sanitize``, or ``python -m tests.payload.sanitize [PYTEST
ARGS]``.

The repository's files (tracked and untracked, not ignored) are copied into a temporary
directory, the kernel is built there with ``-fsanitize=address,undefined`` (every finding fatal),
and the tests that drive it run there with the ASan runtime preloaded into the (uninstrumented)
interpreter: the parity tests against the planned reader, the fuzzed and mutated records and
files, and the output bound, whose refused and failed allocations are the paths a heap bug would
hide in. Allocations above ``max_allocation_size_mb`` fail as a ``malloc`` returning ``NULL``
would (``allocator_may_return_null``), which is how the out-of-memory case runs here (an
address-space limit cannot: ASan reserves terabytes of shadow memory). Leak detection is off: the
interpreter keeps its objects at exit. The working tree is not touched.

Exit status: pytest's (non-zero on any sanitizer report, which aborts the process).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/payload/test_compiled_read.py",
    "tests/payload/test_fuzz.py",
    "tests/payload/test_read_fields.py",
    "tests/payload/test_reliability.py",
    "tests/payload/test_output_bound.py",
]
FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
ASAN = {
    "detect_leaks": "0",
    "allocator_may_return_null": "1",
    "max_allocation_size_mb": "8192",
    "alloc_dealloc_mismatch": "0",  # torch's own allocators pair new/free differently
    "abort_on_error": "1",
}


def _runtime(name: str) -> str:
    """The compiler's shared sanitizer runtime (``libasan.so``)."""
    cc = os.environ.get("CC", "gcc")
    path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True)
    found = path.stdout.strip()
    if path.returncode != 0 or not os.path.isabs(found):
        sys.exit(f"{cc} has no {name}: install the compiler's sanitizer runtime")
    return found


def _copy_tree(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (p.decode() for p in listed)):
        src = REPO / rel
        if src.is_file() and not rel.endswith(".so"):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="rollfeed-sanitize-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        env = dict(os.environ, CFLAGS=FLAGS, LDFLAGS=FLAGS)
        built = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            sys.exit(f"building the sanitized kernel failed:\n{built.stderr}")
        run = dict(
            os.environ,
            PYTHONPATH=str(tree),
            LD_PRELOAD=_runtime("libasan.so"),
            ASAN_OPTIONS=":".join(f"{k}={v}" for k, v in ASAN.items()),
            UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        )
        check = (  # the kernel is the sanitized build, and the runtime is loaded
            "from rollfeed.payload.read import _window, compiled_read as c; assert c.COMPILED; "
            "assert b'__asan_report' in open(_window.__file__, 'rb').read(); "
            "assert 'libasan' in open('/proc/self/maps').read()"
        )
        subprocess.run([sys.executable, "-c", check], cwd=tree, env=run, check=True)
        tests = argv or TESTS
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
        return subprocess.run(cmd, cwd=tree, env=run).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``verify`` and ``inspect`` never hang, never leave the root, never allocate what a header
claims, and name every problem: FIFOs, symlinks, flipped header bits, cut or vanished files, empty
roots."""

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from rollfeed.cli import main
from rollfeed.payload import PayloadWriter
from tests.payload.common import GROUP

REPO = Path(__file__).resolve().parents[2]


def write_file(root, name="w0"):
    """One payload file, one region per write; returns (path, sizes after each write, segments)."""
    sizes, segments = [], []
    counts = np.array([3, 1, 2, 4, 2, 3, 2, 2, 3, 2])  # 14 ids besides the sampled tokens
    firsts = np.cumsum(counts) - counts
    with PayloadWriter(root, group=GROUP, name=name) as w:
        for arrays, sampled in (
            ({"routed_experts": np.arange(12, dtype=np.int64).reshape(3, 2, 2) % 5}, None),
            ({"sampling_mask": (counts, np.arange(24))}, firsts),
            ({"sampling_mask": (np.zeros(0, np.int64), np.zeros(0, np.int64))}, firsts[:0]),
        ):
            segments += w.write(arrays, pos=0, sampled=sampled)
            sizes.append(os.path.getsize(os.path.join(root, w.file)))
    return Path(root) / GROUP / f"{name}.rfp", sizes, segments


@contextmanager
def deadline(seconds):
    """Fail (instead of blocking the suite) when the body takes longer than ``seconds``."""

    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run(command, root, capsys):
    with deadline(5):
        rc = main([command, str(root)])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_verify_refuses_a_fifo_at_once(tmp_path, capsys, command):
    write_file(tmp_path)
    os.mkfifo(tmp_path / GROUP / "pipe.rfp")  # open() of a FIFO blocks until a writer appears
    rc, out = run(command, tmp_path, capsys)
    assert rc == 1
    line = next(x for x in out.splitlines() if "pipe.rfp" in x)
    assert f"{GROUP}/pipe.rfp" in line and "FIFO" in line


def test_verify_never_follows_a_symlink_out_of_the_root(tmp_path, capsys):
    outside, root = tmp_path / "outside", tmp_path / "root"
    real, _, _ = write_file(outside)
    write_file(root)
    (root / GROUP / "evil.rfp").symlink_to(real)  # a sound payload file, outside the root
    (root / "linked_group").symlink_to(outside / GROUP, target_is_directory=True)
    (root / GROUP / "gone.rfp").symlink_to(tmp_path / "nowhere.rfp")  # dangling
    rc, out = run("verify", root, capsys)
    assert rc == 1
    bad = [x for x in out.splitlines() if x.startswith("BAD ")]
    for name in (f"{GROUP}/evil.rfp", "linked_group", f"{GROUP}/gone.rfp"):
        assert any(x.startswith(f"BAD {name}:") and "symlink" in x for x in bad), (name, out)
    assert len(bad) == 3 and "1 of 4 payload files are sound" in out
    rc, out = run("inspect", root, capsys)
    assert rc == 1 and "1 files" in out  # nothing behind a symlink is counted


def region_header_start(raw, segment):
    """Byte offset of the region header in front of ``segment``'s body (the header ends with the
    field name, and its magic starts with b"RGN")."""
    name_at = segment.offset - len(segment.field.encode())
    assert raw[name_at : segment.offset] == segment.field.encode()
    return raw.rindex(b"RGN", 0, name_at)


def test_verify_survives_a_flipped_block_rows_bit_without_allocating(tmp_path):
    path, _, segments = write_file(tmp_path)
    mask = segments[1]
    assert mask.ragged.block_rows == 128 and mask.ragged.rows == 10
    raw = bytearray(path.read_bytes())
    start = region_header_start(raw, mask)
    at = raw.index((128).to_bytes(4, "little"), start, mask.offset)  # the header's block_rows
    raw[at + 3] ^= 0x80  # block_rows 128 -> 2**31 + 128: a 2 GiB index table if taken at its word
    path.write_bytes(bytes(raw))
    code = (
        "import resource, sys, tracemalloc\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from rollfeed.cli import main\n"
        "import rollfeed.cli.verify_root\n"  # the command imports it on first use: not traced
        "tracemalloc.start()\n"
        "rc = main(['verify', sys.argv[1]])\n"
        "print('PEAK', tracemalloc.get_traced_memory()[1])\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr
    bad = next(x for x in proc.stdout.splitlines() if x.startswith("BAD "))
    assert f"{GROUP}/w0.rfp" in bad and "region 1" in bad and "block_rows" in bad
    assert "sampling_mask" in bad and f"offset={start}" in bad
    peak = int(next(x for x in proc.stdout.splitlines() if x.startswith("PEAK")).split()[1])
    assert peak < 16 << 20


def test_verify_survives_every_header_bit_flip_under_a_memory_limit(tmp_path):
    """Each bit of the file header and of every region header flipped in turn: verify either
    calls the file sound or names it, never raises, and stays under 1 GiB of address space."""
    path, _, segments = write_file(tmp_path)
    raw = path.read_bytes()
    headers = [(0, raw.index(b"RGN"))]
    headers += [(region_header_start(raw, s), s.offset) for s in segments]
    bits = [(byte, bit) for lo, hi in headers for byte in range(lo, hi) for bit in range(8)]
    code = (
        "import contextlib, io, json, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from rollfeed.cli import verify\n"
        "path, root = sys.argv[1], sys.argv[2]\n"
        "raw = open(path, 'rb').read()\n"
        "results = []\n"
        "for byte, bit in json.loads(sys.argv[3]):\n"
        "    flipped = bytearray(raw)\n"
        "    flipped[byte] ^= 1 << bit\n"
        "    open(path, 'wb').write(flipped)\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):\n"
        "        rc = verify(root)\n"
        "    results.append((byte, bit, rc, out.getvalue()))\n"
        "print(json.dumps(results))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), str(tmp_path), json.dumps(bits)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == len(bits) > 300
    named = 0
    for byte, bit, rc, out in results:
        if rc == 0:
            assert "1 of 1 payload files are sound" in out, (byte, bit, out)
        else:
            assert rc == 1 and f"BAD {GROUP}/w0.rfp:" in out, (byte, bit, out)
            named += 1
    assert named > len(bits) // 2  # most header bits are claims that verify checks


def test_verify_and_inspect_name_every_cut_point(tmp_path, capsys):
    path, sizes, _ = write_file(tmp_path)
    raw = path.read_bytes()
    first_region = raw.index(b"RGN")  # a file holding only its file header is sound, and empty
    sound = {first_region, *sizes}
    assert sizes[-1] == len(raw) > 200
    path.write_bytes(raw)
    assert run("verify", tmp_path, capsys) == (0, "1 of 1 payload files are sound\n")
    for cut in range(len(raw)):
        path.write_bytes(raw[:cut])
        rc, out = run("verify", tmp_path, capsys)
        if cut in sound:
            assert rc == 0 and "1 of 1 payload files are sound" in out, (cut, out)
        else:
            assert rc == 1 and f"BAD {GROUP}/w0.rfp:" in out, (cut, out)
        rc, out = run("inspect", tmp_path, capsys)
        if cut in sound:
            assert rc == 0 and "CORRUPTED" not in out, (cut, out)
        else:
            assert rc == 1 and "CORRUPTED" in out and f"{GROUP}/w0.rfp:" in out, (cut, out)


def test_inspect_of_a_corrupted_root_exits_non_zero(tmp_path, capsys):
    write_file(tmp_path, "w0")
    path, _, segments = write_file(tmp_path, "w1")
    raw = bytearray(path.read_bytes())
    body = segments[1].offset
    raw[body : body + 8] = (7).to_bytes(8, "little")  # the CSR index's first block offset
    path.write_bytes(bytes(raw))
    rc, out = run("inspect", tmp_path, capsys)
    assert rc == 1
    assert "CORRUPTED" in out and f"{GROUP}/w1.rfp:" in out and "not monotonic" in out
    assert f"{GROUP}/w0.rfp:" not in out


def test_verify_of_an_empty_directory_fails(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a payload file")
    for command in ("verify", "inspect"):
        rc, out = run(command, tmp_path, capsys)
        assert rc != 0 and f"no payload files found under {tmp_path}" in out, out
        assert "0 of 0" not in out


def test_verify_of_a_missing_path_or_a_plain_file_fails_naming_it(tmp_path, capsys):
    missing, plain = tmp_path / "missing", tmp_path / "plain"
    plain.write_text("x")
    for command in ("verify", "inspect"):
        rc, out = run(command, missing, capsys)
        assert rc != 0 and f"{missing} does not exist" in out
        rc, out = run(command, plain, capsys)
        assert rc != 0 and f"{plain} is not a directory" in out


def test_verify_names_a_file_that_vanishes_mid_scan(tmp_path, capsys, monkeypatch):
    write_file(tmp_path, "w0")
    victim, _, _ = write_file(tmp_path, "w1")
    real_scandir = os.scandir

    class Listed:  # what scandir saw, handed out after the file is gone
        def __init__(self, entries):
            self._it = iter(entries)

        def __iter__(self):
            return self

        def __next__(self):
            return next(self._it)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def close(self):
            pass

    def scandir_then_prune(path="."):
        with real_scandir(path) as it:
            entries = list(it)
        if victim.exists() and Path(path) == victim.parent:
            victim.unlink()
        return Listed(entries)

    monkeypatch.setattr(os, "scandir", scandir_then_prune)
    for command in ("verify", "inspect"):
        if not victim.exists():
            write_file(tmp_path, "w1")
        rc, out = run(command, tmp_path, capsys)
        assert rc == 1
        line = next(x for x in out.splitlines() if "w1.rfp" in x)
        assert f"{GROUP}/w1.rfp" in line and "vanished" in line

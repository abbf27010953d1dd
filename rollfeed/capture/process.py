"""A capture server as a child process: started, waited for, stopped with its engine.

:func:`server_process` runs ``python -m rollfeed serve`` on 127.0.0.1 at a free port, in a
process group of its own (vLLM starts engine processes of its own), logging to a file, and
yields a :class:`ServerProcess` once ``/health`` answers; leaving the block stops it
(:meth:`ServerProcess.stop`). For tests, benchmarks and the demo: a real
deployment runs ``serve`` under its own supervisor.

Example::

    with server_process("/shared/payload", model_dir, log=Path("server.log"),
                        serve_args=["--max-num-seqs", "16"]) as server:
        CaptureClient(server.url).generate(...)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollfeed.capture.errors import CaptureServerError


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerProcess:
    """A running capture server: its ``url`` (``http://127.0.0.1:PORT``), process and log."""

    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL the server and its engine processes at once (a crashed inference node)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server, which stops its engine (SIGTERM to the server alone: the engine hears
        it from the server); SIGKILL to the whole group when it does not end in time."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):  # an engine process left behind, if any
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def server_process(
    payload_root: str | os.PathLike[str],
    model: str | os.PathLike[str],
    *,
    log: Path,
    serve_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 900.0,
    port: int | None = None,
) -> Iterator[ServerProcess]:
    """Run a capture server for the ``with`` block (see module doc).

    ``serve_args``: more ``serve`` flags (vLLM's or ours). ``env``: the child's environment
    (default: this one's with ``HF_HUB_OFFLINE=1``). ``port``: the port to serve on (default: a
    free one; a server started again on its predecessor's port keeps its clients' URL). Raises
    :class:`CaptureServerError` with the log's tail when it exits or does not answer within
    ``start_timeout_s``.
    """
    port = free_port() if port is None else port
    cmd = [sys.executable, "-m", "rollfeed", "serve", "--payload-root", str(payload_root)]
    cmd += ["--model", str(model), "--host", "127.0.0.1", "--port", str(port), *serve_args]
    env = dict(os.environ if env is None else env)
    env.setdefault("HF_HUB_OFFLINE", "1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = ServerProcess(url=f"http://127.0.0.1:{port}", proc=proc, log=Path(log))
    t0 = time.monotonic()
    try:
        while not _healthy(server.url):
            if proc.poll() is not None or time.monotonic() - t0 > start_timeout_s:
                raise CaptureServerError(
                    f"the capture server did not start (exit code {proc.poll()}); the end of "
                    f"{log}:\n{server.log_tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        server.stop()

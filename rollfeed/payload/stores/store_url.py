"""Object-store locations: ``s3://bucket/prefix`` and the credentials to reach it.

A :class:`StoreURL` is the object-store counterpart of a root directory: a bucket and a key
prefix. Handles (the ``file`` of a record, a group, a step file name) are confined to the prefix
by the very rule that confines paths to a local root
(:func:`~rollfeed.payload.stores.safe_open.handle_parts`: no absolute key, ``..``, ``.``, empty
component, backslash or NUL), so no handle names another prefix or another bucket.

:class:`StoreAccess` holds the endpoint, region and credentials given as arguments; what is not
given comes from the standard environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``) when a
process first builds its client, so a worker on another host uses its own environment. Secrets
never appear in ``repr`` (nor, through it, in errors or logs).

Worked example::

    url = StoreURL.parse("s3://rollouts/run7/payload")
    url.bucket, url.prefix          -> ("rollouts", "run7/payload")
    url.key("step_1/w0-000001.rfp") -> "run7/payload/step_1/w0-000001.rfp"
    url.key("../other")             -> PayloadPathError
    str(url)                        -> "s3://rollouts/run7/payload"
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from rollfeed.payload.errors import PayloadInputError
from rollfeed.payload.stores.safe_open import handle_parts

SCHEME = "s3://"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def is_store_url(location: object) -> bool:
    """True for an ``s3://`` string (a local path is anything else)."""
    return isinstance(location, str) and location.startswith(SCHEME)


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreURL:
    """A bucket and a key prefix (no leading or trailing ``/``; ``""`` for the whole bucket)."""

    bucket: str
    prefix: str

    @staticmethod
    def parse(url: str) -> StoreURL:
        """``s3://bucket[/prefix]``; :class:`PayloadInputError` for anything else."""
        if not is_store_url(url):
            raise PayloadInputError(f"an object-store root is 's3://bucket/prefix', got {url!r}")
        bucket, _, prefix = url[len(SCHEME) :].partition("/")
        prefix = prefix.strip("/")
        if not _BUCKET.match(bucket):
            raise PayloadInputError(
                f"bucket {bucket!r} of {url!r} is not an S3 bucket name (3-63 characters: "
                "lowercase letters, digits, '.', '-')"
            )
        if prefix:
            handle_parts(url, prefix)  # the prefix itself holds no '..' or empty component
        return StoreURL(bucket=bucket, prefix=prefix)

    def key(self, rel: str) -> str:
        """The key of handle ``rel`` under the prefix; :class:`PayloadPathError` when ``rel``
        could name a key outside it."""
        handle_parts(str(self), rel)
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def rel(self, key: str) -> str:
        """The handle of ``key`` (a key listed under the prefix)."""
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def join(self, rel: str) -> StoreURL:
        """The prefix ``rel`` beneath this one (confined like :meth:`key`)."""
        return StoreURL(bucket=self.bucket, prefix=self.key(rel))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


DEFAULT_REGION = "us-east-1"  # when neither an argument nor AWS_REGION names one


@dataclass(frozen=True, kw_only=True, slots=True)
class Credentials:
    """What signs one S3 request (:mod:`rollfeed.payload.stores.object_sign`); keys never in
    repr."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    region: str
    session_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreAccess:
    """How to reach the store: each ``None`` is read from the environment in the process that
    builds the client. ``timeout_s``: one request's bound, as a whole (connect, headers, body);
    ``request_retries``: retries of a request that timed out, was throttled or got a 5xx, with
    exponential backoff, every attempt ending within ``retry_timeout_s`` of the first."""

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    timeout_s: float = 10.0
    connect_timeout_s: float = 2.0
    request_retries: int = 3
    retry_timeout_s: float = 30.0

    def resolved(self) -> dict[str, str | None]:
        """Endpoint, region and credentials: the arguments, else the ``AWS_*`` variables."""
        env = os.environ
        return {
            "endpoint": self.endpoint
            or env.get("AWS_ENDPOINT_URL_S3")
            or env.get("AWS_ENDPOINT_URL"),
            "region": self.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
            "access_key_id": self.access_key_id or env.get("AWS_ACCESS_KEY_ID"),
            "secret_access_key": self.secret_access_key or env.get("AWS_SECRET_ACCESS_KEY"),
            "session_token": self.session_token or env.get("AWS_SESSION_TOKEN"),
        }

    def bucket_url(self, bucket: str) -> str:
        """``<endpoint>/<bucket>`` (path style); AWS's endpoint of the region when none is set."""
        cfg = self.resolved()
        region = cfg["region"] or DEFAULT_REGION
        endpoint = cfg["endpoint"] or f"https://s3.{region}.amazonaws.com"
        return f"{endpoint.rstrip('/')}/{bucket}"

    def credentials(self) -> Credentials:
        """The resolved keys and region a request is signed with."""
        cfg = self.resolved()
        return Credentials(
            access_key_id=cfg["access_key_id"] or "",
            secret_access_key=cfg["secret_access_key"] or "",
            region=cfg["region"] or DEFAULT_REGION,
            session_token=cfg["session_token"],
        )

    def store(self, url: StoreURL):  # -> obstore.store.S3Store
        """A new obstore client for ``url``'s bucket (obstore imported here: an optional extra)."""
        from datetime import timedelta

        try:
            from obstore.store import S3Store
        except ImportError:
            raise PayloadInputError(
                f"the object-store root {url} needs obstore: pip install 'rollfeed[object-store]'"
            ) from None
        cfg = self.resolved()
        config = {k: v for k, v in cfg.items() if v is not None and k != "endpoint"}
        options: dict = {
            "timeout": f"{int(self.timeout_s * 1000)}ms",
            "connect_timeout": f"{int(self.connect_timeout_s * 1000)}ms",
        }
        if cfg["endpoint"]:
            config["endpoint"] = cfg["endpoint"]
            options["allow_http"] = cfg["endpoint"].startswith("http://")
        retry = {
            "max_retries": self.request_retries,
            "retry_timeout": timedelta(seconds=self.retry_timeout_s),
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(seconds=2),
                "base": 2,
            },
        }
        return S3Store(
            url.bucket,
            **config,
            client_options=options,
            retry_config=retry,
            virtual_hosted_style_request=False,
        )

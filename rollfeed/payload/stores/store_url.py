"""Object-store locations: ``s3://bucket/prefix`` and the credentials to reach it.

A :class:`StoreURL` is the object-store counterpart of a root directory: a bucket and a key
prefix. Handles (the ``file`` of a record, a group, a step file name) are confined to the prefix
by the very rule that confines paths to a local root
(:func:`~rollfeed.payload.stores.safe_open.handle_parts`: no absolute key, ``..``, ``.``, empty
component, backslash or NUL), so no handle names another prefix or another bucket.

:class:`StoreAccess` holds how to reach the store and where its credentials come from, given
once: a root, a step store and every process they travel to build their clients from it. What
is not given is found where the AWS libraries look, in the process that builds a client (so a
worker on another host uses its own environment): the credentials given as arguments, else the
profile named (``profile`` or ``AWS_PROFILE``, from the shared AWS files, through obstore's boto3
credential provider), else obstore's chain: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, web identity (``AWS_WEB_IDENTITY_TOKEN_FILE``, ``AWS_ROLE_ARN``, and
``AWS_ENDPOINT_URL_STS`` for another STS), container credentials
(``AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`` / ``_FULL_URI``), instance metadata (IMDSv2 at
``metadata_endpoint`` / ``AWS_METADATA_ENDPOINT``, by default ``http://169.254.169.254``).
Secrets never appear in ``repr`` (nor, through it, in errors or logs).

Worked example::

    url = StoreURL.parse("s3://rollouts/run7/payload")
    url.bucket, url.prefix          -> ("rollouts", "run7/payload")
    url.key("step_1/w0-000001.rfp") -> "run7/payload/step_1/w0-000001.rfp"
    url.key("../other")             -> PayloadPathError
    str(url)                        -> "s3://rollouts/run7/payload"
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, field
from datetime import timedelta

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
BACKOFF_S = timedelta(milliseconds=50)  # the first retry's wait, doubling after each
MAX_BACKOFF_S = timedelta(seconds=2)


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreAccess:
    """How to reach the store (see the module doc), and the one retry policy of its requests.

    ``endpoint`` (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), ``region`` (``AWS_REGION`` /
    ``AWS_DEFAULT_REGION``, else us-east-1); ``access_key_id``, ``secret_access_key``,
    ``session_token``: credentials given; ``profile``: a profile of the shared AWS files;
    ``metadata_endpoint``: the instance metadata service.
    ``timeout_s``: one attempt's bound, as a whole (connect within ``connect_timeout_s``,
    request, headers and body, however slowly a store sends them); ``request_retries``: retries
    of an attempt that timed out, was cut, was throttled or got a 5xx, with backoff
    (:meth:`backoff_s`), every attempt ending within ``retry_timeout_s`` of the first.
    """

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    profile: str | None = None
    metadata_endpoint: str | None = None
    timeout_s: float = 10.0
    connect_timeout_s: float = 2.0
    request_retries: int = 3
    retry_timeout_s: float = 30.0

    def resolved(self) -> dict[str, str]:
        """Endpoint and region: the arguments, else the ``AWS_*`` variables, else AWS's
        endpoint of the region (``https://s3.<region>.amazonaws.com``) in us-east-1."""
        env = os.environ
        region = self.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        region = region or DEFAULT_REGION
        endpoint = self.endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        return {"endpoint": endpoint or f"https://s3.{region}.amazonaws.com", "region": region}

    def bucket_url(self, bucket: str) -> str:
        """``<endpoint>/<bucket>`` (path style)."""
        return f"{self.resolved()['endpoint'].rstrip('/')}/{bucket}"

    def backoff_s(self, last: float | None) -> float:
        """The wait before a retry after waiting ``last`` seconds before the previous one
        (``None``: the first retry), as obstore waits: 50 ms first, then a random draw between
        50 ms and twice the last wait (decorrelated jitter), at most 2 s."""
        low, high = BACKOFF_S.total_seconds(), MAX_BACKOFF_S.total_seconds()
        return low if last is None else min(high, random.uniform(low, max(low, 2 * last)))

    def keys_given(self) -> bool:
        return bool(self.access_key_id and self.secret_access_key)

    def profile_name(self) -> str | None:
        """The profile credentials come from: ``profile``, else ``AWS_PROFILE``, unless keys
        were given."""
        return None if self.keys_given() else self.profile or os.environ.get("AWS_PROFILE")

    def store(self, url: StoreURL, *, credential_provider: object = None):  # -> obstore S3Store
        """A new obstore client for ``url``'s bucket (obstore imported here: an optional
        extra); ``credential_provider``: obstore's boto3 provider of :meth:`profile_name`."""
        try:
            from obstore.store import S3Store
        except ImportError:
            raise PayloadInputError(
                f"the object-store root {url} needs obstore: pip install 'rollfeed[object-store]'"
            ) from None
        cfg = self.resolved()
        config = {"endpoint": cfg["endpoint"], "region": cfg["region"]}
        given = {
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "session_token": self.session_token,
            "metadata_endpoint": self.metadata_endpoint,
        }
        config.update({k: v for k, v in given.items() if v})
        options = {
            "timeout": timedelta(seconds=self.timeout_s),
            "connect_timeout": timedelta(seconds=self.connect_timeout_s),
            "allow_http": cfg["endpoint"].startswith("http://"),
        }
        retry = {
            "max_retries": self.request_retries,
            "retry_timeout": timedelta(seconds=self.retry_timeout_s),
            "backoff": {"init_backoff": BACKOFF_S, "max_backoff": MAX_BACKOFF_S, "base": 2},
        }
        return S3Store(
            url.bucket,
            config=config,  # type: ignore[arg-type]
            client_options=options,  # type: ignore[arg-type]
            retry_config=retry,  # type: ignore[arg-type]
            credential_provider=credential_provider,  # type: ignore[arg-type]
            virtual_hosted_style_request=False,
        )

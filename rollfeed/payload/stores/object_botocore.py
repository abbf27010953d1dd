"""What botocore does for an object store (the ``object-store`` extra): a profile's credentials
for obstore, and the requests obstore does not offer or would not bound, signed by it: the two
multipart requests obstore lacks (``ListMultipartUploads``, ``AbortMultipartUpload``), and a step
store's listing (``ListObjectsV2``), whose answer obstore reads whole, however long (measured
here: a listing claiming 2 GiB, streamed as fast as taken, was read 1.6 GiB deep, 1.9 GiB
resident, before its 10 s timeout; here it is refused from its headers).

A profile of the shared AWS files (``~/.aws/credentials``, ``~/.aws/config``: keys, SSO, a role
to assume, a credential process) is read by botocore and handed to obstore through its boto3
credential provider (:func:`profile_provider`), refreshed as botocore refreshes it.

A writer killed mid-upload leaves an incomplete multipart upload that only those two requests
find and remove (:mod:`~rollfeed.payload.stores.object_prune`). botocore signs them
(``S3SigV4Auth``) with credentials from its own chain, given the same inputs as obstore's: the
keys given as arguments, else the profile named (the one session obstore's boto3 credential
provider also reads), else the ``AWS_*`` variables, web identity (``AWS_WEB_IDENTITY_TOKEN_FILE``,
``AWS_ROLE_ARN``, ``AWS_ENDPOINT_URL_STS``), container and instance metadata (at
``metadata_endpoint`` when given). No credential anywhere is :class:`PayloadStoreAuthError`.

They are sent like every other request, under the one policy of
:class:`~rollfeed.payload.stores.store_url.StoreAccess`: each attempt ends by its deadline as a
whole, however the server paces its answer (:mod:`~rollfeed.payload.stores.object_deadline`),
a timed out, cut, throttled (429/503) or failed (5xx) attempt is retried with obstore's backoff
(:meth:`~rollfeed.payload.stores.store_url.StoreAccess.backoff_s`) within ``retry_timeout_s``,
then :class:`PayloadStoreTimeoutError`; an answer is read up to its bound
(:mod:`~rollfeed.payload.stores.object_answer`) and a status maps to its typed error.

Example::

    signed = SignedRequests(access, StoreURL.parse("s3://rollouts/run7"), botocore_session(access))
    signed.request("GET", "", query={"uploads": "", "prefix": "run7/step_1/"},
                   what="listing uploads", where="s3://rollouts/run7")  -> b"<?xml ..."
"""

from __future__ import annotations

import http.client
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any

from rollfeed.payload.errors import (
    PayloadInputError,
    PayloadIOError,
    PayloadStoreAuthError,
    PayloadStoreTimeoutError,
)
from rollfeed.payload.stores.object_answer import answer_body
from rollfeed.payload.stores.object_deadline import (
    DeadlineHTTPConnection,
    DeadlineHTTPSConnection,
)
from rollfeed.payload.stores.object_errors import status_error
from rollfeed.payload.stores.store_url import StoreAccess, StoreURL

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


def botocore_session(access: StoreAccess) -> Any:  # -> botocore.session.Session
    """A botocore session resolving ``access``'s credentials (see the module doc): the one a
    process's client reads a profile through, and signs the multipart requests with."""
    try:
        import botocore.session
    except ImportError:
        raise PayloadInputError(
            "an object store's signed requests (a step store's listing, the incomplete uploads "
            "a prune aborts) and AWS profiles need botocore: pip install 'rollfeed[object-store]'"
        ) from None
    session = botocore.session.Session(profile=access.profile_name())
    if access.keys_given():
        session.set_credentials(
            access.access_key_id, access.secret_access_key, access.session_token
        )
    if access.metadata_endpoint:
        session.set_config_variable("ec2_metadata_service_endpoint", access.metadata_endpoint)
    session.set_config_variable("metadata_service_timeout", access.timeout_s)
    return session


def profile_provider(session: Any, url: StoreURL) -> Any:
    """obstore's credential provider over ``session`` (a profile's); a profile without a
    credential is :class:`PayloadStoreAuthError`."""
    try:
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise PayloadInputError(
            f"credentials of an AWS profile for {url} need boto3: pip install "
            "'rollfeed[object-store]'"
        ) from None
    try:
        return Boto3CredentialProvider(session)
    except Exception as err:  # no such profile, or one without a credential
        raise PayloadStoreAuthError(
            f"no credential for {url} from AWS profile {session.profile!r}: "
            f"{type(err).__name__}: {str(err)[:300]}"
        ) from None


class SignedRequests:
    """Signed requests for one bucket in this process (never pickled)."""

    def __init__(self, access: StoreAccess, url: StoreURL, session: Any) -> None:
        self.access, self.url = access, url
        self.base = access.bucket_url(url.bucket)
        self.region = access.resolved()["region"]
        self.credentials = session.get_credentials()  # refreshed by botocore as needed
        if self.credentials is None:
            raise PayloadStoreAuthError(
                f"no credential for {url}: none given as arguments, no profile, no AWS_* "
                "variables, no web identity, container or instance metadata credential"
            )

    def _frozen(self) -> Any:
        """The credential to sign with now (a refresh may fetch one: a token exchanged at
        STS, the instance metadata)."""
        try:
            return self.credentials.get_frozen_credentials()
        except Exception as err:  # a refused token, no role, the service out of reach
            raise PayloadStoreAuthError(
                f"no credential for {self.url}: getting one failed ({type(err).__name__}: "
                f"{str(err)[:300]})"
            ) from None

    def request(
        self,
        method: str,
        key: str,
        *,
        what: str,
        where: str,
        query: Mapping[str, str] | None = None,
    ) -> bytes:
        """One signed request for ``key`` (``""``: the bucket itself), with retries; its answer
        or the typed error its status maps to."""
        a, frozen = self.access, self._frozen()
        last = time.monotonic() + a.retry_timeout_s  # no attempt runs past it
        tries, pause = 0, None
        while True:
            try:
                deadline = min(time.monotonic() + a.timeout_s, last)
                return self._once(deadline, frozen, method, key, query or {}, what, where)
            except (OSError, http.client.HTTPException, _Retry) as err:
                pause = a.backoff_s(pause)
                if tries >= a.request_retries or time.monotonic() + pause >= last:
                    raise PayloadStoreTimeoutError(
                        f"the store did not answer {what} of {where} after {tries} retries: "
                        f"out of reach or too slow ({type(err).__name__}: {err}); each attempt "
                        f"is bounded by timeout_s={a.timeout_s}, all of them by "
                        f"retry_timeout_s={a.retry_timeout_s}: check the endpoint, or raise "
                        "timeout_s / request_retries / retry_timeout_s",
                        file=key,
                    ) from None
                time.sleep(pause)
                tries += 1

    def _once(
        self,
        deadline: float,
        frozen: Any,
        method: str,
        key: str,
        query: Mapping[str, str],
        what: str,
        where: str,
    ) -> bytes:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        url = f"{self.base}/{urllib.parse.quote(key)}" if key else self.base
        if query:
            url += "?" + urllib.parse.urlencode(sorted(query.items()), quote_via=urllib.parse.quote)
        request = AWSRequest(method=method, url=url, data=b"")
        S3SigV4Auth(frozen, "s3", self.region).add_auth(request)
        prepared = request.prepare()
        parts = urllib.parse.urlsplit(prepared.url)
        target = f"{parts.path}?{parts.query}" if parts.query else parts.path
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no time left for this attempt")
        kind = DeadlineHTTPSConnection if parts.scheme == "https" else DeadlineHTTPConnection
        conn = kind(parts.netloc, timeout=left)  # connecting within what is left
        try:
            conn.connect()
            conn.sock.deadline = deadline  # every send and receive of this exchange
            headers = dict(prepared.headers.items())
            headers["content-length"] = "0"
            conn.request(method, target, headers=headers)
            resp = conn.getresponse()
            text = answer_body(resp, what=what, where=where, rel=key)
        finally:
            conn.close()
        if resp.status in _RETRY_STATUS:
            raise _Retry(f"HTTP {resp.status}")
        if resp.status >= 300:
            detail = f"HTTP {resp.status} {text[:200]!r}"
            raise status_error(resp.status, where=where, rel=key, what=what, detail=detail)
        return text

    def xml(self, method: str, key: str, *, what: str, where: str, query: Mapping[str, str]):
        """:meth:`request`'s answer as an XML document (anything else is a typed error)."""
        text = self.request(method, key, what=what, where=where, query=query)
        try:
            return ET.fromstring(text)
        except ET.ParseError as err:
            raise PayloadIOError(
                f"{what} of {where}: the answer is not XML ({err})", file=key
            ) from None


class _Retry(PayloadIOError):
    """A throttled or failed (5xx) answer: retried like a timeout."""

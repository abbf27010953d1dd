"""Loopback stand-ins for the services a cloud machine gets its object-store credentials from,
each issuing the session's S3 server keys (:mod:`tests.object_store_server`) as temporary
credentials:

- :class:`FakeSTS`: ``AssumeRoleWithWebIdentity`` (what IRSA and other web identity setups call
  with the token file's contents), over HTTP or HTTPS (a certificate of its own, for
  ``127.0.0.1``, written to :attr:`FakeSTS.ca_file`);
- :class:`FakeMetadata`: the instance metadata service, IMDSv2 (a session token from
  ``PUT /latest/api/token``, then the role's name and its credentials under
  ``/latest/meta-data/iam/security-credentials/``).

Each records the requests it answered (:attr:`seen`: method, path, and for STS the form) and
refuses, with the real service's status, a request that lacks what the real one needs (a web
identity token equal to :attr:`FakeSTS.token`; a session token header). ``refuse=True`` makes
it refuse every request (an expired token, a machine without a role).

Example::

    with FakeSTS(token="jwt-1") as sts:
        env = {"AWS_WEB_IDENTITY_TOKEN_FILE": path, "AWS_ROLE_ARN": ROLE_ARN}
        ...  # a client pointed at sts.endpoint gets ACCESS_KEY / SECRET_KEY
"""

from __future__ import annotations

import datetime
import http.server
import json
import ssl
import subprocess
import tempfile
import threading
import urllib.parse
from pathlib import Path

from tests.object_store_server import ACCESS_KEY, SECRET_KEY

ROLE_ARN = "arn:aws:iam::123456789012:role/rollfeed-reader"
ROLE_NAME = "rollfeed-reader"
SESSION_TOKEN = ""  # SeaweedFS refuses a session token it did not issue itself


def _expiry() -> str:
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    return later.strftime("%Y-%m-%dT%H:%M:%SZ")


class _Server:
    """A threading HTTP(S) server on 127.0.0.1 answering with :meth:`answer`."""

    def __init__(self, *, tls: bool = False) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.refuse = False
        self._lock = threading.Lock()
        self._tmp = tempfile.TemporaryDirectory(prefix="rollfeed-creds-")
        self.ca_file: str | None = None
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                path, _, query = self.path.partition("?")
                form = dict(urllib.parse.parse_qsl(query or body.decode("latin-1")))
                with owner._lock:
                    owner.seen.append((self.command, path, form))
                status, kind, data = owner.answer(self.command, path, form, self.headers)
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = _any

            def log_message(self, *args: object) -> None:  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if tls:
            self.ca_file = self._certificate()
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tmp = Path(self._tmp.name)
            context.load_cert_chain(str(tmp / "server.pem"), str(tmp / "key.pem"))
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def _certificate(self) -> str:
        """An authority of its own and a server certificate for 127.0.0.1 that it signed (TLS
        clients refuse an authority's certificate as a server's): the authority's file, to
        trust, and the server's chain in ``server.pem`` / ``key.pem``."""
        d = Path(self._tmp.name)

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

        openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-subj",
            "/CN=rollfeed test authority",
        )
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "key.pem",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        )
        (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
        openssl(
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            "server.pem",
            "-extfile",
            "san.ext",
        )
        return str(d / "ca.pem")  # fmt: skip

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.ca_file else "http"
        host, port = self._server.server_address[:2]
        return f"{scheme}://{host}:{port}"

    def answer(self, method, path, form, headers) -> tuple[int, str, bytes]:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        self._tmp.cleanup()


class FakeSTS(_Server):
    """``AssumeRoleWithWebIdentity`` for :data:`ROLE_ARN` with web identity token ``token``."""

    def __init__(self, *, token: str, tls: bool = False) -> None:
        self.token = token
        super().__init__(tls=tls)

    def answer(self, method, path, form, headers):
        if form.get("Action") != "AssumeRoleWithWebIdentity":
            return 400, "text/xml", b"<ErrorResponse><Error><Code>InvalidAction</Code></Error>"
        if self.refuse or form.get("WebIdentityToken") != self.token:
            return (
                400,
                "text/xml",
                (
                    b"<ErrorResponse><Error><Type>Sender</Type><Code>InvalidIdentityToken</Code>"
                    b"<Message>the token is not valid</Message></Error></ErrorResponse>"
                ),
            )
        if form.get("RoleArn") != ROLE_ARN:
            return 403, "text/xml", b"<ErrorResponse><Error><Code>AccessDenied</Code></Error>"
        xml = (
            '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<AssumeRoleWithWebIdentityResult><Credentials>"
            f"<AccessKeyId>{ACCESS_KEY}</AccessKeyId><SecretAccessKey>{SECRET_KEY}"
            f"</SecretAccessKey><SessionToken>{SESSION_TOKEN}</SessionToken>"
            f"<Expiration>{_expiry()}</Expiration></Credentials>"
            f"<SubjectFromWebIdentityToken>rollfeed</SubjectFromWebIdentityToken>"
            f"<AssumedRoleUser><Arn>{ROLE_ARN}/s</Arn><AssumedRoleId>AROA:s</AssumedRoleId>"
            "</AssumedRoleUser></AssumeRoleWithWebIdentityResult>"
            "<ResponseMetadata><RequestId>r-1</RequestId></ResponseMetadata>"
            "</AssumeRoleWithWebIdentityResponse>"
        )
        return 200, "text/xml", xml.encode()


class FakeMetadata(_Server):
    """The instance metadata service of a machine whose role is :data:`ROLE_NAME` (IMDSv2)."""

    API_TOKEN = "rollfeed-imds-token"
    _CREDENTIALS = "/latest/meta-data/iam/security-credentials/"

    def answer(self, method, path, form, headers):
        if method == "PUT" and path == "/latest/api/token":
            return 200, "text/plain", self.API_TOKEN.encode()
        if headers.get("x-aws-ec2-metadata-token") != self.API_TOKEN:
            return 401, "text/plain", b"no session token"
        if path.rstrip("/") + "/" == self._CREDENTIALS:
            return (
                (404, "text/plain", b"") if self.refuse else (200, "text/plain", b"rollfeed-reader")
            )
        if path == self._CREDENTIALS + ROLE_NAME and not self.refuse:
            doc = {
                "Code": "Success",
                "LastUpdated": _expiry(),
                "Type": "AWS-HMAC",
                "AccessKeyId": ACCESS_KEY,
                "SecretAccessKey": SECRET_KEY,
                "Token": SESSION_TOKEN,
                "Expiration": _expiry(),
            }
            return 200, "application/json", json.dumps(doc).encode()
        return 404, "text/plain", b""

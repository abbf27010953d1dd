"""A loopback HTTP proxy in front of the test session's S3 server that misbehaves on demand: a
store that drips its answers, stalls, claims more bytes than it sends, ignores ``Range`` or pages
its listings small. Client-agnostic: a root (or step store) pointed at :attr:`StoreProxy.endpoint`
sees only what a real misbehaving store would send, whatever its HTTP client.

Each request is forwarded whole to the upstream server and its whole answer read back; the proxy
then answers with ``Connection: close`` (so every request opens a connection of its own) in the
way :attr:`StoreProxy.mode` says:

- ``"pass"``: as the store answered;
- ``"drip"``: every byte of the answer (status line and headers too) ``delay_s`` apart;
- ``"drip_body"``: status and headers at once, then the body ``delay_s`` a byte;
- ``"stall"``: nothing at all; ``"stall_body"``: the headers and half the body, then nothing
  (until the client gives up);
- ``"inflate"``: a 200/206 answer claims ``claim`` bytes (``Content-Length``, and a 206's
  ``Content-Range`` end), then streams its body and zeros up to ``stream`` bytes, as fast as the
  client takes them;
- ``"lie_length"``: ``Content-Length`` one byte more than the body, which ends, connection closed;
- ``"lie_range"``: a 206's ``Content-Range`` names bytes one later than those sent;
- ``"short"``: the body cut at half, connection closed;
- ``"ignore_range"``: a ranged GET answered with 200 and the whole object (fetched from the
  store with the session's credentials: the client's request, ``Range`` included, is signed);
- ``"garbage"``: a status line and headers no HTTP client can read;
- ``"page_uploads"``: a multipart-upload listing is answered in pages of ``page`` uploads (as S3
  pages at 1,000): the store's whole listing, taken when a listing starts, cut after ``page``
  uploads with the markers of the next page, which the client's next request names (each
  request is still forwarded as signed, so the store checks its signature).

:meth:`StoreProxy.misbehave` sets the mode (``after_first``: the next request still passes);
:attr:`sent` counts the bytes of answers handed to the client's socket, :attr:`requests` the
requests seen and :attr:`agents` their ``User-Agent`` (``""`` when none: which client sent
them). Every handler ends when its client closes its end.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import socketserver
import threading
import urllib.parse

from tests.object_store_server import ACCESS_KEY, REGION, SECRET_KEY

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class StoreProxy:
    """The proxy (see the module doc); a context manager that stops it and cuts every
    connection it holds (a dripping answer ends)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urllib.parse.urlsplit(upstream).netloc
        self.mode, self.delay_s, self.page = "pass", 0.2, 2
        self.claim, self.stream = 2 << 30, 128 << 20
        self.sent = 0
        self.requests: list[tuple[str, str]] = []
        self.agents: list[str] = []
        self._skip = 0  # requests still to pass before the mode applies
        self._uploads: list[bytes] = []  # the listing being paged (its <Upload> elements)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(60)  # a client that never closes: end anyway
                with proxy._lock:
                    proxy._open.add(self.request)
                try:
                    proxy._serve(self.request)
                except OSError:  # the client went away: nothing to answer
                    pass
                finally:
                    with proxy._lock:
                        proxy._open.discard(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> StoreProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def misbehave(self, mode: str, *, after_first: bool = False) -> None:
        """Answer in ``mode`` from now on (``after_first``: from the second request on)."""
        with self._lock:
            self.mode, self._skip = mode, int(after_first)

    @contextlib.contextmanager
    def passing(self):
        """Pass every answer inside the block, then misbehave as before."""
        with self._lock:
            mode, skip = self.mode, self._skip
            self.mode = "pass"
        try:
            yield
        finally:
            with self._lock:
                self.mode, self._skip = mode, skip

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ one request

    def _serve(self, sock: socket.socket) -> None:
        got = _read_request(sock)
        if got is None:
            return
        method, target, headers, body = got
        with self._lock:
            self.requests.append((method, target))
            self.agents.append(next((v for k, v in headers if k.lower() == "user-agent"), ""))
            mode = self.mode if not self._skip else "pass"
            self._skip = max(0, self._skip - 1)
        if mode == "stall":
            _until_closed(sock)
            return
        if mode == "garbage":
            self._send(sock, b"HTTP/1.1 2x0 Fine\r\nContent-Length: lots\r\n\r\nxyz")
            return
        status, reason, answer, data = self._forward(method, target, headers, body)
        if mode == "page_uploads" and method == "GET" and status == 200:
            data = self._paged(target, data)
            answer = [(k, v) for k, v in answer if k.lower() != "content-length"]
        if mode == "ignore_range" and status == 206:
            status, reason, data = 200, "OK", self._whole(target)
            answer = [
                (k, v) for k, v in answer if k.lower() not in ("content-range", "content-length")
            ]
        if mode in ("inflate", "lie_range", "lie_length") and status in (200, 206):
            answer = self._lying(mode, status, answer, len(data))
        head = _head(status, reason, answer, len(data))
        if mode == "inflate" and status in (200, 206):
            self._send(sock, head + data)
            self._zeros(sock, self.stream - len(data))
        elif mode == "drip":
            self._drip(sock, head + data)
        elif mode == "drip_body":
            self._send(sock, head)
            self._drip(sock, data)
        elif mode in ("stall_body", "short"):
            self._send(sock, head + data[: len(data) // 2])
            if mode == "stall_body":
                _until_closed(sock)
        elif mode == "lie_length":
            self._send(sock, head + data)
        else:
            self._send(sock, head + data)

    def _forward(self, method, target, headers, body):
        conn = http.client.HTTPConnection(self.upstream, timeout=30)
        try:
            sent = {k: v for k, v in headers if k.lower() not in _HOP}
            conn.request(method, target, body=body or None, headers=sent)
            resp = conn.getresponse()
            data = resp.read()
            answer = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
            return resp.status, resp.reason, answer, data
        finally:
            conn.close()

    def _lying(self, mode, status, answer, n):
        out = []
        for k, v in answer:
            low = k.lower()
            if low == "content-length":
                v = str(self.claim if mode == "inflate" else n + 1)
            elif low == "content-range" and status == 206 and mode != "lie_length":
                first = int(v.split(" ")[1].split("-")[0])
                if mode == "inflate":
                    v = f"bytes {first}-{first + self.claim - 1}/{first + self.claim}"
                else:
                    total = v.rsplit("/", 1)[1]
                    v = f"bytes {first + 1}-{first + n}/{total}"
            out.append((k, v))
        return out

    def _whole(self, target: str) -> bytes:
        """The whole object a GET of ``target`` (``/bucket/key``) names."""
        import obstore
        from obstore.store import S3Store

        bucket, _, key = urllib.parse.unquote(target.partition("?")[0]).lstrip("/").partition("/")
        store = S3Store(
            bucket,
            endpoint=f"http://{self.upstream}",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region=REGION,
            client_options={"allow_http": True},
        )
        return bytes(obstore.get(store, key).bytes())

    def _paged(self, target: str, data: bytes) -> bytes:
        """The page of the upload listing that ``target`` asks for (see the module doc)."""
        query = dict(urllib.parse.parse_qsl(target.partition("?")[2], keep_blank_values=True))
        if "uploads" not in query:
            return data
        marker = query.get("upload-id-marker")
        with self._lock:
            if marker is None:  # a listing starts: the store's whole answer is the one paged
                self._uploads = re.findall(rb"<Upload>.*?</Upload>", data, re.S)
            uploads = self._uploads
        ids = [re.search(rb"<UploadId>(.*?)</UploadId>", u).group(1) for u in uploads]
        at = 0 if marker is None else ids.index(marker.encode()) + 1
        page = uploads[at : at + self.page]
        more = at + self.page < len(uploads)
        tail = b"<IsTruncated>false</IsTruncated>"
        if more:
            key = re.search(rb"<Key>(.*?)</Key>", page[-1]).group(1)
            tail = (
                b"<IsTruncated>true</IsTruncated><NextKeyMarker>" + key + b"</NextKeyMarker>"
                b"<NextUploadIdMarker>" + ids[at + self.page - 1] + b"</NextUploadIdMarker>"
            )
        return (
            b'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult '
            b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">' + b"".join(page) + tail
            + b"</ListMultipartUploadsResult>"
        )  # fmt: skip

    # ------------------------------------------------------------------ sending

    def _send(self, sock: socket.socket, data: bytes) -> None:
        sock.sendall(data)
        with self._lock:
            self.sent += len(data)

    def _drip(self, sock: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            if self._stop.wait(self.delay_s):
                return
            self._send(sock, data[i : i + 1])

    def _zeros(self, sock: socket.socket, n: int) -> None:
        chunk = bytes(1 << 16)
        while n > 0 and not self._stop.is_set():
            self._send(sock, chunk[: min(n, len(chunk))])
            n -= len(chunk)


def _until_closed(sock: socket.socket) -> None:
    """Send nothing more until the client closes its end (a handler holds no thread past its
    client's own timeout)."""
    while sock.recv(65536):
        pass


def _read_request(sock: socket.socket):
    """``(method, target, [(name, value)], body)`` of one request, or ``None`` at EOF."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        part = sock.recv(65536)
        if not part:
            return None
        buf += part
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = [tuple(x.strip() for x in line.split(":", 1)) for line in lines[1:] if ":" in line]
    length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
    while len(rest) < length:
        part = sock.recv(65536)
        if not part:
            return None
        rest += part
    return method, target, headers, rest[:length]


def _head(status: int, reason: str, headers, n: int) -> bytes:
    names = {k.lower() for k, _ in headers}
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers)]
    if "content-length" not in names:
        lines.append(f"Content-Length: {n}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def create_upload(endpoint: str, bucket: str, key: str) -> str:
    """Start a multipart upload of ``key`` (left incomplete, as a killed writer leaves one);
    its upload id (botocore's own client: obstore starts no upload it does not finish)."""
    import botocore.session

    client = botocore.session.Session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    return client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

"""A deadline for a whole request, whatever the server sends: connections whose every send and
receive waits at most until the exchange's deadline.

A socket timeout bounds each receive, not a request: a server that sends one byte a second
answers every receive in time and keeps a read going for as long as it likes (a 206 body dripped
byte by byte, headers dripped line by line). The sockets here re-arm their timeout to what is
left of ``deadline`` before every call and raise ``TimeoutError`` once nothing is left, so an
exchange (request, headers, body) ends by its deadline however the answer is paced, with no
thread and no signal. ``http.client`` reads and writes only through ``recv_into`` / ``sendall``
of its connection's socket (a TLS socket's too: ``SSLContext.sslsocket_class``), and a response
keeps reading from that same socket object after the connection let go of it
(``Connection: close``), so setting ``sock.deadline`` before an exchange bounds all of it;
connecting is bounded by the socket's own timeout, which the caller sets to what is left.

Example::

    conn = DeadlineHTTPConnection("127.0.0.1:8333", timeout=2.0)   # connect within 2 s
    conn.connect()
    conn.sock.deadline = time.monotonic() + 10.0
    conn.request("GET", target, headers=headers)
    body = conn.getresponse().read()     # TimeoutError if the answer is not all there by then
"""

from __future__ import annotations

import http.client
import math
import socket
import ssl
import time
from typing import Any


class _Deadline:
    """What a deadline socket adds: each send and receive waits at most until ``deadline``
    (``time.monotonic()`` seconds)."""

    deadline = math.inf

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request ran past its deadline")
        self.settimeout(left)  # type: ignore[attr-defined]

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().recv_into(*args, **kwargs)  # type: ignore[misc]

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        self._arm()
        return super().recv(*args, **kwargs)  # type: ignore[misc]

    def send(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().send(*args, **kwargs)  # type: ignore[misc]

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._arm()  # one sendall with a timeout is bounded as a whole
        return super().sendall(*args, **kwargs)  # type: ignore[misc]


class DeadlineSocket(_Deadline, socket.socket):
    """A TCP socket under a deadline."""


class DeadlineSSLSocket(_Deadline, ssl.SSLSocket):
    """A TLS socket under a deadline (one ``read`` of a TLS socket with a timeout is bounded as
    a whole, so re-arming before each one bounds a dripped record too)."""


class DeadlineHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket is a :class:`DeadlineSocket`."""

    def connect(self) -> None:
        super().connect()  # within self.timeout
        raw = self.sock
        self.sock = DeadlineSocket(fileno=raw.detach())
        self.sock.settimeout(self.timeout)


class DeadlineHTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection whose socket is a :class:`DeadlineSSLSocket` (the default context,
    certificates checked)."""

    def __init__(self, host: str, **kwargs: Any) -> None:
        context = ssl.create_default_context()
        context.sslsocket_class = DeadlineSSLSocket
        super().__init__(host, context=context, **kwargs)

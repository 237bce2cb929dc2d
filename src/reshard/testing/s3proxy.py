"""A fault-injecting HTTP proxy on loopback, in front of an S3 endpoint.

Faults a real server does not produce on demand (503 SlowDown on a fraction
of requests, a 500 on one part, a connection reset in the middle of a GET
body, a failing LIST, a slow response) are injected here, so the client
under test makes real requests over real sockets. It also counts requests
and response-body bytes per method, so a test can check how many bytes a
load really fetched.

Usage::

    proxy = FaultProxy(server.url)            # starts on 127.0.0.1:<free port>
    proxy.add(Fault(method="PUT", query="partNumber=2", status=500))
    ...  # point AWS_ENDPOINT_URL at proxy.url
    proxy.stats.get_bytes, proxy.stats.injected
    proxy.close()

Rules are checked in order; the first matching rule with hits left fires.
The proxy runs in the process that created it (one thread per connection).
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "upgrade", "expect"}


@dataclass(kw_only=True)
class Fault:
    """One injection rule.

    Attributes:
        method: HTTP method to match ("GET", "PUT", ...), or None for any.
        path: regex searched in the URL path (``/bucket/key``), or None.
        query: regex searched in the query string (``list-type=2`` is a LIST,
            ``partNumber=`` an upload part, ``uploads`` a create), or None.
        status: answer with this HTTP status and an S3 error body ``code``
            instead of forwarding (when ``action == "status"``).
        action: "status", "reset" (close the connection without an answer),
            "reset_mid" (forward, send half the body, then reset), "delay"
            (forward after ``delay_s`` seconds), "truncate_body" (forward
            only the first half of the request body upstream, its
            ``Content-Length`` rewritten: a body cut short in transit),
            "reset_after" (forward, then reset instead of answering: the
            store did it, the client never hears).
        times: how many requests it fires on (None: unlimited).
        probability: chance of firing on a matching request (own generator).
    """

    method: str | None = None
    path: str | None = None
    query: str | None = None
    status: int = 503
    code: str = "SlowDown"
    action: str = "status"
    delay_s: float = 0.0
    times: int | None = None
    probability: float = 1.0
    fired: int = 0

    def matches(self, method: str, path: str, query: str) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        if self.method is not None and method != self.method:
            return False
        if self.path is not None and not re.search(self.path, path):
            return False
        return self.query is None or re.search(self.query, query) is not None


@dataclass
class Stats:
    """Counters since the last :meth:`FaultProxy.reset_stats` (bytes are
    response-body bytes; ``get_bytes`` counts GETs of objects only).
    ``log`` holds ``(method, path, query, body)`` of every request in arrival
    order (bodies of POST requests only, e.g. multi-object deletes)."""

    requests: dict[str, int] = field(default_factory=dict)
    log: list[tuple[str, str, str, bytes]] = field(default_factory=list)
    get_bytes: int = 0
    put_bytes: int = 0
    injected: int = 0


class FaultProxy:
    """HTTP proxy on ``127.0.0.1:<free port>`` forwarding to ``upstream``."""

    def __init__(self, upstream: str, *, seed: int = 0):
        u = urlsplit(upstream)
        self._host, self._port = u.hostname or "127.0.0.1", u.port or 80
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.stats = Stats()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="reshard-s3proxy")
        self._thread.start()

    # -- control
    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = Stats()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- serving
    def _pick(self, method: str, path: str, query: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.matches(method, path, query) and (f.probability >= 1.0
                                                       or self._rng.random() < f.probability):
                    f.fired += 1
                    self.stats.injected += 1
                    return f
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        method = h.command
        u = urlsplit(h.path)
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else b""
        with self._lock:
            self.stats.requests[method] = self.stats.requests.get(method, 0) + 1
            self.stats.log.append((method, u.path, u.query, body if method == "POST" else b""))
            self.stats.put_bytes += len(body)
        fault = self._pick(method, u.path, u.query)
        if fault is not None and fault.action == "status":
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                   f"<Message>injected by reshard.testing.s3proxy</Message></Error>").encode()
            h.send_response(fault.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(xml)))
            h.end_headers()
            if method != "HEAD":
                h.wfile.write(xml)
            return
        if fault is not None and fault.action == "reset":
            _reset(h)
            return
        if fault is not None and fault.action == "delay":
            time.sleep(fault.delay_s)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        if fault is not None and fault.action == "truncate_body":
            body = body[: len(body) // 2]
            headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(self._host, self._port, timeout=120)
        try:
            conn.request(method, h.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
        except OSError:
            _reset(h)
            return
        finally:
            conn.close()
        if fault is not None and fault.action == "reset_after":
            _reset(h)
            return
        if method == "GET" and "list-type" not in u.query and "uploads" not in u.query:
            with self._lock:
                self.stats.get_bytes += len(data)
        h.send_response(r.status, r.reason)
        for k, v in r.getheaders():
            if k.lower() not in _HOP and (k.lower() != "content-length" or method == "HEAD"):
                h.send_header(k, v)
        if method != "HEAD":
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if method == "HEAD":
            return
        if fault is not None and fault.action == "reset_mid":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            _reset(h)
            return
        h.wfile.write(data)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a reset we injected, or a client that went away


def _reset(h: BaseHTTPRequestHandler) -> None:
    """Close the client's connection with a TCP reset (SO_LINGER 0)."""
    try:
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        h.connection.close()
    except OSError:
        pass
    h.close_connection = True

"""An HTTP proxy on loopback that answers some requests with a fault instead of
forwarding them (503 SlowDown, 500), or cuts a GET's answer off mid-body, to test
retries against a real server."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    """Forwards to ``upstream``; every ``every``-th request (from the ``start``-th on) gets
    ``status`` with an S3 error body instead, or with ``cut``, every such GET gets its
    real status and headers but only the first half of its body before the connection
    closes (a network drop mid-transfer). ``injected`` counts them."""

    def __init__(self, upstream: str, *, every: int = 3, status: int = 503, start: int = 1, cut: bool = False) -> None:
        self.upstream = urlparse(upstream)
        self.every, self.status, self.start, self.cut = every, status, start, cut
        self.requests = self.injected = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                return

            def _handle(self) -> None:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    body = self._read_chunked()
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(length) if length else None
                with proxy._lock:
                    proxy.requests += 1
                    n = proxy.requests
                    fault = n >= proxy.start and (n - proxy.start) % proxy.every == 0
                    if proxy.cut and self.command != "GET":
                        fault = False
                    proxy.injected += fault
                if fault and not proxy.cut:
                    payload = SLOW_DOWN if proxy.status == 503 else b"<Error><Code>InternalError</Code></Error>"
                    self.send_response(proxy.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=120)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("connection", "transfer-encoding", "content-length")
                }
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD answer has no body but tells the object's length.
                self.send_header(
                    "Content-Length",
                    resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data)),
                )
                self.end_headers()
                if fault and len(data) > 1:  # cut: half the body, then the connection closes
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                elif self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _read_chunked(self) -> bytes:
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

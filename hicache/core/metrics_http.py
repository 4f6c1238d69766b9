"""The ``/metrics`` HTTP endpoint: a threaded WSGI server on a daemon thread.

Contract: ``MetricsHttp(render, port, addr)`` binds ``addr:port`` (port 0: any free port;
``port`` then holds the bound one) and answers every GET with ``render()``, the Prometheus text
format (0.0.4) as bytes, gzipped when the scraper accepts it (Prometheus does), until
``close()``, which returns within about ``POLL_S`` (prometheus-client's own server polls for its
stop every 0.5 s: 0.2-0.5 s of every daemon stop). OPTIONS gives the methods; any other method
is 405, a query string 400 (nothing here reads one: prometheus-client's ``name[]`` filter is not
offered), each with one line saying why. Requests are not logged.
"""
from __future__ import annotations

import gzip
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

POLL_S = 0.02
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


def _app(render: Callable[[], bytes]) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        headers = [("Allow", "OPTIONS,GET")]
        if method == "OPTIONS":
            status, body = "200 OK", b""
        elif method != "GET":
            status, body = "405 Method Not Allowed", f"# {method}: use GET\n".encode()
        elif environ.get("QUERY_STRING"):
            status, body = "400 Bad Request", b"# /metrics takes no query parameters\n"
        else:
            status, body = "200 OK", render()
            headers = [("Content-Type", TEXT_FORMAT)]
            if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
                body = gzip.compress(body, compresslevel=1)  # zlib lets go of the GIL
                headers.append(("Content-Encoding", "gzip"))
        start_response(status, headers)
        return [body]
    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


class MetricsHttp:
    def __init__(self, render: Callable[[], bytes], port: int, addr: str = "127.0.0.1") -> None:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]

        class Server(ThreadingMixIn, WSGIServer):
            address_family = family
            daemon_threads = True

        self._httpd = make_server(addr, port, _app(render), Server,
                                  handler_class=_QuietHandler)
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(POLL_S,),
                                        name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()

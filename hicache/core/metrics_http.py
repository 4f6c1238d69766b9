"""The ``/metrics`` HTTP endpoint: a threaded WSGI server on a daemon thread.

Contract: ``MetricsHttp(registry, port, addr)`` binds ``addr:port`` (port 0: any free port;
``port`` then holds the bound one) and serves Prometheus's WSGI app for ``registry`` until
``close()``, which returns within about ``POLL_S`` (prometheus-client's own server polls for its
stop every 0.5 s: 0.2-0.5 s of every daemon stop). Requests are not logged.
"""
from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

POLL_S = 0.02


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


class MetricsHttp:
    def __init__(self, registry: Any, port: int, addr: str = "127.0.0.1") -> None:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]

        class Server(ThreadingMixIn, WSGIServer):
            address_family = family
            daemon_threads = True

        self._httpd = make_server(addr, port, make_wsgi_app(registry), Server,
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

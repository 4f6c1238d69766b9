"""The ``/metrics`` HTTP endpoint: a small HTTP/1.1 responder on a daemon thread.

Contract: ``MetricsHttp(render, port, addr)`` binds ``addr:port`` (port 0: any free port;
``port`` then holds the bound one) and answers a GET of any path with ``render()``, the
Prometheus text format (0.0.4) as bytes, gzipped when the scraper accepts it (Prometheus
does), until ``close()``, which returns at once (the listening socket is shut down under the
accepting thread; nothing polls). OPTIONS gives the methods; any other method is 405, a query
string 400 (nothing here reads one: prometheus-client's ``name[]`` filter is not offered), a
request whose head is over ``MAX_HEAD`` bytes 431, each with one line saying why. One
connection, one response (``Connection: close``). Requests are not logged.

Why not the standard library's WSGI server: its request parsing and environ cost ~0.4 ms of
Python per scrape, during which the daemon's loop waits for the interpreter
(docs/metrics.md, "What a scrape costs"); this reads the request line and the one header it
uses. Each connection gets its own short-lived thread, so a client that connects and sends
nothing (it is dropped after ``READ_TIMEOUT_S``) holds up no scrape; at most
``MAX_CONNECTIONS`` at once, and a connection past them is closed unanswered.
"""
from __future__ import annotations

import gzip
import logging
import socket
import threading
import time
from typing import Callable

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"
MAX_HEAD = 16 << 10  # bytes of request line and headers read before 431
READ_TIMEOUT_S = 10.0  # a connection that sends no whole request head in this long is dropped
MAX_CONNECTIONS = 16  # served at once; one more is closed unanswered (no thread per flood)
_REASONS = {200: "OK", 400: "Bad Request", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}
log = logging.getLogger("hicache.metrics")


def _read_head(conn: socket.socket) -> bytes | None:
    """The request line and headers (without the blank line), or None when the peer closed
    first; raises ``ValueError`` when they pass ``MAX_HEAD``."""
    data = b""
    while True:
        end = data.find(b"\r\n\r\n")
        if end > MAX_HEAD or (end < 0 and len(data) > MAX_HEAD):
            raise ValueError("request head too large")
        if end >= 0:
            return data[:end]
        chunk = conn.recv(8192)
        if not chunk:
            return None
        data += chunk


def respond(head: bytes, render: Callable[[], bytes]) -> tuple[int, list[tuple[str, str]], bytes]:
    """(status, headers, body) for one request head."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    allow = [("Allow", "OPTIONS,GET")]
    if len(parts) != 3:
        return 400, allow, b"# a request line is METHOD TARGET VERSION\n"
    method, target = parts[0].decode("latin-1"), parts[1]
    if method == "OPTIONS":
        return 200, allow, b""
    if method != "GET":
        return 405, allow, f"# {method[:32]}: use GET\n".encode("latin-1", "replace")
    if b"?" in target:
        return 400, allow, b"# /metrics takes no query parameters\n"
    gz = any(line.split(b":", 1)[0].strip().lower() == b"accept-encoding"
             and b"gzip" in line.split(b":", 1)[1].lower() for line in lines[1:] if b":" in line)
    try:
        body = render()
    except Exception as e:  # noqa: BLE001 - one scrape fails, the endpoint stays
        log.exception("metrics: rendering /metrics failed")
        return 500, [], f"# rendering the metrics failed: {type(e).__name__}\n".encode()
    headers = [("Content-Type", TEXT_FORMAT)]
    if gz:
        body = gzip.compress(body, compresslevel=1)  # zlib lets go of the GIL
        headers.append(("Content-Encoding", "gzip"))
    return 200, headers, body


class MetricsHttp:
    """See the module docstring."""

    def __init__(self, render: Callable[[], bytes], port: int, addr: str = "127.0.0.1") -> None:
        family, _, _, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        self._render = render
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(where)
            self._sock.listen(64)
        except BaseException:
            self._sock.close()
            raise
        self.port = int(self._sock.getsockname()[1])
        self._closing = False
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self._accept, name="metrics-http", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # shut down by close(); else (out of descriptors?) not a hot loop
                if not self._closing:
                    time.sleep(0.05)
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="metrics-http-conn",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had: this scrape is dropped, not the endpoint
                self._slots.release()
                conn.close()
                time.sleep(0.05)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._answer(conn)
            finally:
                self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(READ_TIMEOUT_S)
            try:
                head = _read_head(conn)
            except ValueError:
                status, headers, body = 431, [], b"# request head over 16 KiB\n"
            else:
                if head is None:
                    return
                status, headers, body = respond(head, self._render)
            top = [f"HTTP/1.1 {status} {_REASONS[status]}", *(f"{k}: {v}" for k, v in headers),
                   f"Content-Length: {len(body)}", "Connection: close", "", ""]
            conn.sendall("\r\n".join(top).encode("latin-1") + body)
        except OSError:  # the scraper went away, or sent nothing in time: nothing to do
            pass

    def close(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        if self._closing:
            return
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._thread.join(5.0)
        self._sock.close()

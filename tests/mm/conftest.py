"""Fixtures for the media core tests: a scriptable HTTP server and a CONNECT proxy, both real
sockets on 127.0.0.1."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

Route = Callable[[BaseHTTPRequestHandler], None]


@dataclass
class MediaHttpServer:
    """Answers GET requests from a table of routes that tests fill in."""

    port: int
    routes: dict[str, Route] = field(default_factory=dict)
    hits: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def add_bytes(self, path: str, body: bytes, content_length: int | None = -1) -> str:
        """Serves `body`; `content_length` None omits the header, -1 sends the true length."""

        def route(h: BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            if content_length is not None:
                size = len(body) if content_length == -1 else content_length
                h.send_header("Content-Length", str(size))
            else:
                h.close_connection = True
            h.end_headers()
            h.wfile.write(body)

        self.routes[path] = route
        return self.url(path)

    def add_redirect(self, path: str, location: str, status: int = 302) -> str:
        def route(h: BaseHTTPRequestHandler) -> None:
            h.send_response(status)
            h.send_header("Location", location)
            h.send_header("Content-Length", "0")
            h.end_headers()

        self.routes[path] = route
        return self.url(path)

    def add_slow(self, path: str, interval_s: float) -> str:
        """Headers at once, then one body byte every `interval_s`, never finishing."""

        def route(h: BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Content-Length", "100000")
            h.end_headers()
            try:
                for _ in range(100000):
                    h.wfile.write(b"x")
                    h.wfile.flush()
                    time.sleep(interval_s)
            except OSError:
                pass

        self.routes[path] = route
        return self.url(path)


def _handler_for(server: MediaHttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            server.hits.append(self.path)
            route = server.routes.get(self.path)
            if route is None:
                self.send_error(404)
                return
            route(self)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def http_server() -> Iterator[MediaHttpServer]:
    state = MediaHttpServer(port=0)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


@dataclass
class ConnectProxy:
    """A CONNECT-only forward proxy; `targets` lists each host:port it was asked to reach."""

    port: int
    targets: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _pipe(a: socket.socket, b: socket.socket) -> None:
    sockets = [a, b]
    while True:
        readable, _, _ = select.select(sockets, [], [], 10)
        if not readable:
            return
        for s in readable:
            data = s.recv(65536)
            if not data:
                return
            (b if s is a else a).sendall(data)


def _serve_proxy_client(client: socket.socket, state: ConnectProxy) -> None:
    with client:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(4096)
            if not chunk:
                return
            head += chunk
        method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        if method != "CONNECT":
            client.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
            return
        state.targets.append(target)
        host, port = target.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as upstream:
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            _pipe(client, upstream)


@pytest.fixture
def connect_proxy() -> Iterator[ConnectProxy]:
    listener = socket.create_server(("127.0.0.1", 0))
    state = ConnectProxy(port=listener.getsockname()[1])
    stop = threading.Event()

    def accept_loop() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=_serve_proxy_client, args=(client, state), daemon=True).start()

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        stop.set()
        thread.join()
        listener.close()


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Clears every proxy variable, so that tests see only what they set."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch

"""Clients that hold what they should let go (loopback, tiny model, PyTorch LLM): a client that stops
reading loses its request at the write timeout, a slow reader does not; a kept-alive connection with no
request is closed at the idle timeout; a request whose client left while it waited leaves the queue at
once; a connection past the cap gets its 503 with Retry-After, never a reset. Each on uvicorn's two HTTP
protocols where the protocol matters (httptools only where it is installed)."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, WebSocket  # noqa: E402  (module level: the route's annotation is resolved here)

from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.conn import ConnectionLimits, guarded_protocol  # noqa: E402
from cosyllama.server.options import ServingOptions  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import VoiceStore  # noqa: E402
from helpers import LoopbackServer, SlowBackend  # noqa: E402

LIMITS = ConnectionLimits(write_timeout=3.0, idle_timeout=1.0)
SERVER_SNDBUF = 16 * 1024  # the server's socket send buffer: the kernel holds little of an unread response
CLIENT_RCVBUF = 4096
LONG = ("The quick brown fox jumps over the lazy dog, and then it runs far away. " * 8)[:400]  # ~3 MB of pcm


def _base(name: str) -> type:
    if name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


def _small_send_buffer(base: type) -> type:
    """``base`` whose sockets keep little in the kernel: an unread response stalls after ~100 KB,
    not after the megabytes a loopback socket buffers by default."""

    class SmallSendBuffer(base):
        def connection_made(self, transport):
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SERVER_SNDBUF)
            super().connection_made(transport)

    return SmallSendBuffer


def _view(tts, voice):
    view = TTS.from_models(tts.models, voices=VoiceStore())
    view.voices.add("en", voice)
    return view


@pytest.fixture(scope="module", params=["h11", "httptools"])
def stalled(request, tts, voice):
    """The server with a short write and idle timeout; uvicorn's own keep-alive timeout is an hour,
    so only the guard's idle timeout can close an idle connection."""
    protocol = guarded_protocol(LIMITS, _small_send_buffer(_base(request.param)))
    view = _view(tts, voice)
    srv = LoopbackServer(create_app(view, ServingOptions(view.options, max_concurrent=4)), http=protocol,
                         timeout_keep_alive=3600)
    yield srv
    srv.stop()


def _request(path: str, body: dict | None = None, close: bool = False) -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n" + ("Connection: close\r\n" if close else "")
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    return head.encode() + b"\r\n" + data


def _raw(port: int, rcvbuf: int | None = CLIENT_RCVBUF) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: it sets the window
    s.connect(("127.0.0.1", port))
    return s


def _health_until(client, pred, what: str, limit_s: float = 120.0) -> dict:
    deadline = time.monotonic() + limit_s
    while not pred(h := client.get("/health").json()):
        assert time.monotonic() < deadline, f"{what}: still {h} after {limit_s} s"
        time.sleep(0.05)
    return h


def _speech(**kw) -> dict:
    # greedy: the same length every run (the tiny model's sampled streams end anywhere past their minimum)
    return {"input": LONG, "voice": "en", "stream_format": "audio", "response_format": "pcm", "greedy": True, **kw}


# -- hole 1: a client that stops reading ---------------------------------------------------------


def test_a_client_that_stops_reading_loses_its_slot(stalled):
    """Three clients stream a long pcm response and never read: each stalls once the buffers are
    full, is aborted --write-timeout later, and its request, LLM sequence and slot are freed; the
    server then answers as before."""
    n = 3
    socks = [_raw(stalled.port) for _ in range(n)]
    try:
        for s in socks:
            s.sendall(_request("/v1/audio/speech", _speech()))
        with httpx.Client(base_url=stalled.url, timeout=60) as c:
            _health_until(c, lambda h: h["requests_running"] == n, "the requests were not admitted")
            _health_until(c, lambda h: h["requests_running"] == 0 and h["active_sequences"] == 0,
                          "the stalled responses kept their slots")
            r = c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en", "response_format": "wav"})
            assert r.status_code == 200 and r.content[:4] == b"RIFF"
    finally:
        for s in socks:
            s.close()


def test_a_slow_reader_is_not_cut(stalled):
    """A client that reads a little at a time, always within the write timeout, gets the whole stream."""
    with _raw(stalled.port) as s:
        s.sendall(_request("/v1/audio/speech", _speech(input=LONG[:20]), close=True))  # ~300 KB
        got = bytearray()
        s.settimeout(120)
        while data := s.recv(CLIENT_RCVBUF):
            got += data
            time.sleep(0.05)  # ~80 KB/s: the server's buffers fill, and drain well within the timeout
    head, _, body = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert body.endswith(b"0\r\n\r\n") and len(body) > 150_000  # chunked to its end, more than the buffers hold


# -- the idle timeout -----------------------------------------------------------------------------


def test_an_idle_connection_is_closed_at_the_idle_timeout(stalled):
    with _raw(stalled.port, rcvbuf=None) as s:
        s.sendall(_request("/health"))
        s.settimeout(30)
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(65536)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(v for k, _, v in (ln.partition(b": ") for ln in head.split(b"\r\n"))
                          if k.lower() == b"content-length"))
        while len(body) < length:
            body += s.recv(65536)
        t0 = time.monotonic()
        try:
            rest = s.recv(65536)  # kept alive, then closed by the server: end of stream
        except socket.timeout:
            pytest.fail("the kept-alive connection with no request was not closed")
        assert rest == b""
        assert time.monotonic() - t0 >= LIMITS.idle_timeout * 0.9


# -- queued requests whose client left -------------------------------------------------------------


class _HeldBackend(SlowBackend):
    """Decode steps wait for ``go``; ``stepping`` is set once one waits."""

    def __init__(self, inner):
        super().__init__(inner)
        self.go, self.stepping = threading.Event(), threading.Event()

    def step(self, batch):
        self.stepping.set()
        self.go.wait(120)
        return self.inner.step(batch)


def test_a_request_whose_client_left_leaves_the_queue_at_once(tts, voice):
    from cosyllama.tts import TTS

    view = _view(tts, voice)
    held = _HeldBackend(tts.llm)  # create_app makes its scheduler over tts.llm
    view = TTS.from_models(dataclasses.replace(tts.models, llm=held), voices=view.voices)
    srv = LoopbackServer(create_app(view, ServingOptions(view.options, max_concurrent=1, max_queue=4)))
    socks = []
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            first = []
            runner = threading.Thread(target=lambda: first.append(
                c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en"}).status_code))
            runner.start()
            assert held.stepping.wait(120), "the first request did not reach the LLM"
            with httpx.Client(base_url=srv.url, timeout=60) as probe:
                for _ in range(3):
                    s = _raw(srv.port, rcvbuf=None)
                    s.sendall(_request("/v1/audio/speech", {"input": "Hello.", "voice": "en"}))
                    socks.append(s)
                _health_until(probe, lambda h: h["requests_waiting"] == 3, "the requests did not queue")
                for s in socks:
                    s.close()
                h = _health_until(probe, lambda h: h["requests_waiting"] == 0, "the left requests stayed queued",
                                  limit_s=30)
                assert h["requests_running"] == 1 and not held.go.is_set()  # the slot was never free
            held.go.set()
            runner.join(120)
            assert first == [200]
            h = c.get("/health").json()
            assert h["requests_running"] == 0 and h["requests_waiting"] == 0
    finally:
        held.go.set()
        for s in socks:
            s.close()
        srv.stop()


# -- the connection cap ----------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["h11", "httptools"])
def test_connections_past_the_cap_get_503_with_retry_after_and_no_reset(tts, voice, protocol):
    """With the cap taken by idle connections, each further one that sends a request (and a body the
    server never reads) gets the whole 503 with Retry-After and the end of the stream, not a reset."""
    limits = ConnectionLimits(max_connections=4, header_timeout=120)
    srv = LoopbackServer(create_app(_view(tts, voice)), http=guarded_protocol(limits, _base(protocol)))
    held = []
    try:
        held = [_raw(srv.port, rcvbuf=None) for _ in range(limits.max_connections)]
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            deadline = time.monotonic() + 30  # the held sockets are accepted by the server's loop in turn
            while c.get("/health").status_code != 503:
                assert time.monotonic() < deadline, "the connection past the cap was served"
                time.sleep(0.05)
        request = _request("/v1/audio/speech", {"input": "x" * 60_000, "voice": "en"})
        for i in range(20):
            with _raw(srv.port, rcvbuf=None) as s:
                s.settimeout(30)
                got = b""
                try:
                    s.sendall(request)
                    while data := s.recv(65536):
                        got += data
                except (ConnectionResetError, BrokenPipeError) as e:
                    pytest.fail(f"refused connection {i} was reset after {len(got)} bytes ({e})")
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), got[:200]
            assert b"\r\nretry-after: 1\r\n" in head.lower() + b"\r\n"
            assert json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
        srv.stop()


# -- a WebSocket ------------------------------------------------------------------------------------


def test_an_upgraded_connection_outlives_the_header_timeout():
    """Once a connection is a WebSocket its own protocol has it: the guard's header timer, armed for the
    upgrade request, writes no 408 into the stream."""
    ws_client = pytest.importorskip("websockets.sync.client")
    app = FastAPI()

    @app.websocket("/echo")
    async def echo(ws: WebSocket):
        await ws.accept()
        while True:
            await ws.send_text(await ws.receive_text())

    limits = ConnectionLimits(header_timeout=0.5)
    srv = LoopbackServer(app, http=guarded_protocol(limits))
    try:
        with ws_client.connect(f"ws://127.0.0.1:{srv.port}/echo") as c:
            c.send("one")
            assert c.recv(30) == "one"
            time.sleep(limits.header_timeout * 3)  # past the timer the upgrade request armed
            c.send("two")
            assert c.recv(30) == "two"
    finally:
        srv.stop()

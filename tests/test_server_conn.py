"""Slow clients on the server (loopback, tiny model, PyTorch LLM): trickled headers and bodies are
cut at their timeouts with 408, an idle connection is closed, connections past the cap get 503,
and ordinary requests (kept-alive too) pass."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.conn import ConnectionLimits, guarded_protocol  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import VoiceStore  # noqa: E402
from helpers import LoopbackServer  # noqa: E402
from server_helpers import json_error as _error  # noqa: E402

LIMITS = ConnectionLimits(header_timeout=1.0, body_timeout=1.5, max_connections=6)


@pytest.fixture(scope="module", params=["h11", "httptools"])
def guarded(request, tts, voice):
    """The server with the limits on each of uvicorn's two HTTP protocols (``serve`` takes the one
    uvicorn picks: httptools where it is installed, else h11)."""
    if request.param == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        options = {"http": guarded_protocol(LIMITS, H11Protocol)}
    else:
        pytest.importorskip("httptools")
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        options = {"http": guarded_protocol(LIMITS, HttpToolsProtocol)}
    view = TTS.from_models(tts.models, voices=VoiceStore())
    view.voices.add("en", voice)
    srv = LoopbackServer(create_app(view), **options)
    yield srv
    srv.stop()


def _trickle_until_closed(port: int, head: bytes, trickle: bytes, limit_s: float) -> tuple[float, bytes]:
    """Send ``head``, then one byte of ``trickle`` every 0.1 s until the server closes the
    connection; returns (seconds from the first byte to the close, what the server sent)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(0.1)
        t0 = time.monotonic()
        s.sendall(head)
        got, i = b"", 0
        while time.monotonic() - t0 < limit_s:
            try:
                data = s.recv(65536)
                if not data:
                    return time.monotonic() - t0, got
                got += data
            except socket.timeout:
                pass
            except ConnectionResetError:  # closed while a trickled byte was unread: the 408 may be lost
                return time.monotonic() - t0, got
            try:
                s.sendall(trickle[i % len(trickle):i % len(trickle) + 1])
            except OSError:  # closed while sending
                return time.monotonic() - t0, got
            i += 1
    pytest.fail(f"the server kept a trickling connection open for {limit_s} s")


def test_trickled_headers_are_cut_at_the_header_timeout(guarded):
    took, got = _trickle_until_closed(guarded.port, b"GET /health HTTP/1.1\r\n", b"X-Slow: aaaaaaaaaa\r\n", 30)
    assert LIMITS.header_timeout * 0.9 <= took < LIMITS.header_timeout + 10
    assert not got or (got.startswith(b"HTTP/1.1 408") and b"--header-timeout" in got)


def test_a_trickled_body_is_cut_at_the_body_timeout(guarded):
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    took, got = _trickle_until_closed(guarded.port, head, b'{"input": "' + b"a" * 900, 30)
    assert LIMITS.body_timeout * 0.9 <= took < LIMITS.body_timeout + 10
    assert not got or (got.startswith(b"HTTP/1.1 408") and b"--body-timeout" in got)


def test_an_idle_connection_is_closed_and_requests_still_pass(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.settimeout(LIMITS.header_timeout + 10)
        t0 = time.monotonic()
        got = s.recv(65536)  # sent nothing at all
        assert got.startswith(b"HTTP/1.1 408") and b"--header-timeout" in got
        assert time.monotonic() - t0 >= LIMITS.header_timeout * 0.9
    with httpx.Client(base_url=guarded.url, timeout=60) as c:  # keep-alive: several requests, one connection
        for _ in range(3):
            assert c.get("/health").status_code == 200
        r = c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en", "response_format": "wav"})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"


def test_connections_past_the_cap_are_refused(guarded):
    held = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(LIMITS.max_connections)]
    try:
        with httpx.Client(base_url=guarded.url, timeout=10) as c:
            deadline = time.monotonic() + 10  # the held sockets are accepted by the server's loop in turn
            while (r := c.get("/health")).status_code != 503:
                assert time.monotonic() < deadline, "the connection past the cap was served"
                time.sleep(0.05)
            _error(r, 503, "--max-connections")
    finally:
        for s in held:
            s.close()
    with httpx.Client(base_url=guarded.url, timeout=10) as c:
        deadline = time.monotonic() + 10
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_connection_limits_are_checked():
    from cosyllama.errors import InputError

    with pytest.raises(InputError, match="--header-timeout must be a number > 0"):
        ConnectionLimits(header_timeout=0)
    with pytest.raises(InputError, match="--max-connections"):
        ConnectionLimits(max_connections=1.5)


@pytest.mark.parametrize("protocol", ["h11", "httptools"])
def test_a_body_refused_before_it_is_read_is_drained_not_reset(protocol):
    """A 413 answered by its Content-Length while the client still sends the body: the guard shuts
    its side and drops what comes, so the client always reads the 413. Closing with the unread body
    in the kernel's buffer resets the connection, and the client (still sending) then never reads it:
    plain uvicorn did that in about 1 of 14 tries of tests/test_server_speech.py's 2 MB upload."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from cosyllama.server.wire import BodyLimit

    if protocol == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        pytest.importorskip("httptools")
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base

    async def ok(request):
        await request.body()
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/", ok, methods=["POST"])])
    srv = LoopbackServer(BodyLimit(app, 1000), http=guarded_protocol(ConnectionLimits(), base))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            codes = [c.post("/", content=b"\0" * 4_000_000).status_code for _ in range(40)]
            assert codes == [413] * 40
            assert c.post("/", content=b"small").text == "ok"
    finally:
        srv.stop()

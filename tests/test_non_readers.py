"""A client that stops reading, on each door (issue #42): the server's writes stall after a bounded
number of bytes (every door bounds its socket's send buffer, :data:`cosyllama.server.conn.SEND_BUFFER_BYTES`),
and its slot is free ``--write-timeout`` later (plus the watch's second and the route's clean-up):
HTTP on h11 and on httptools, the WebSocket, Wyoming. Black-box: a raw client that reads nothing,
the slot seen in /health, what the routes sent counted around the app."""

from __future__ import annotations

import json
import socket
import time

import pytest

from helpers import LoopbackServer
from raw_clients import RawWebSocket, wyoming_event
from server_helpers import WAIT_S

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.request import SynthesisOptions  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.conn import ConnectionLimits, guarded_protocol  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import VoiceStore  # noqa: E402


@pytest.fixture(scope="module")
def view(tts, voice):
    v = TTS.from_models(tts.models, voices=VoiceStore())
    v.voices.add("en", voice)
    return v


WRITE_TIMEOUT = 3.0
SLOW_LIMITS = ConnectionLimits(write_timeout=WRITE_TIMEOUT)
# ~2 MB of 24 kHz 16-bit audio with the tiny model (greedy): more than the server's bounded buffers
# hold (its send buffer, the transport's), less than an unbounded loopback socket swallows (~4 MB)
SPOKEN = " ".join(["This is a long sentence that keeps the model busy for a good while, word after word after "
                   "word."] * 3)
SENT_BOUND = 1 << 20  # bytes a door may send a client that reads nothing before its writes stall
CLEAN_UP_S = 15.0  # the watch's look (1 s), the route's clean-up (a chunk in a thread), /health polls: generous


class CountingApp:
    """The app as uvicorn sees it, counting what the routes send (bytes of response bodies and
    WebSocket messages), when the last send began, and whether an HTTP response or a WebSocket
    utterance (its ``session.done``) was sent whole."""

    def __init__(self, app):
        self.app, self.sent, self.last_send, self.whole = app, 0, None, False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") == "/health":
            return await self.app(scope, receive, send)

        async def counted(message):
            self.last_send = time.monotonic()
            body = message.get("body") or message.get("bytes") or (message.get("text") or "").encode()
            await send(message)
            self.sent += len(body)
            if (message["type"] == "http.response.body" and not message.get("more_body")) or b"session.done" in body:
                self.whole = True

        return await self.app(scope, receive, counted)


def _slot_freed_after_a_stall(url: str, last_send, whole, what: str) -> float:
    """Wait (generously) until a request runs and then none does; the seconds from the last send's
    start (the one that stalled) to the slot being free."""
    with httpx.Client(base_url=url, timeout=WAIT_S) as c:
        deadline = time.monotonic() + WAIT_S
        while c.get("/health").json()["requests_running"] == 0:
            assert time.monotonic() < deadline, f"{what}: the request did not start"
            time.sleep(0.02)
        while c.get("/health").json()["requests_running"] != 0:
            assert time.monotonic() < deadline, f"{what}: the non-reader kept its slot for {WAIT_S} s"
            time.sleep(0.05)
        freed = time.monotonic()
    assert not whole(), f"{what}: the whole answer went to a client that reads nothing (the kernel took it)"
    return freed - last_send()


def _assert_cut(door: str, sent: int, waited: float) -> None:
    assert sent <= SENT_BOUND, f"{door}: {sent} bytes sent before the writes stalled, more than {SENT_BOUND}"
    assert waited <= WRITE_TIMEOUT + CLEAN_UP_S, f"{door}: slot freed {waited:.1f} s after the writes stalled"


def _http_base(name: str) -> type:
    if name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


@pytest.mark.parametrize("protocol", ["h11", "httptools"])
def test_an_http_client_that_stops_reading_is_cut_at_the_write_timeout(view, protocol):
    """A client that sends its request and reads nothing (its socket as the kernel makes it): the
    server's writes stall after at most SENT_BOUND bytes, its slot is free --write-timeout later
    (plus the clean-up), and the response is not finished into the kernel's buffers."""
    app = CountingApp(create_app(view, ServingOptions(view.options, max_concurrent=2, connection_limits=SLOW_LIMITS)))
    srv = LoopbackServer(app, http=guarded_protocol(SLOW_LIMITS, _http_base(protocol)))
    body = json.dumps({"input": SPOKEN, "voice": "en", "stream_format": "audio", "response_format": "pcm",
                       "greedy": True}).encode()
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            waited = _slot_freed_after_a_stall(srv.url, lambda: app.last_send, lambda: app.whole, protocol)
        _assert_cut(f"HTTP ({protocol})", app.sent, waited)
    finally:
        srv.stop()


def test_a_websocket_client_that_stops_reading_is_cut_at_the_write_timeout(view):
    app = CountingApp(create_app(view, ServingOptions(view.options, max_concurrent=2, connection_limits=SLOW_LIMITS)))
    srv = LoopbackServer(app, http=guarded_protocol(SLOW_LIMITS))
    try:
        ws = RawWebSocket(srv.port)
        try:
            ws.send_text(json.dumps({"type": "session.config", "voice": "en", "greedy": True, "response_format": "pcm",
                                     "stream_audio": True, "split_granularity": "none"}))
            ws.send_text(json.dumps({"type": "input.text", "text": SPOKEN}))
            ws.send_text(json.dumps({"type": "input.done"}))
            waited = _slot_freed_after_a_stall(srv.url, lambda: app.last_send, lambda: app.whole, "WebSocket")
        finally:
            ws.close()
        _assert_cut("WebSocket", app.sent, waited)
    finally:
        srv.stop()


def test_a_wyoming_client_that_stops_reading_is_cut_at_the_write_timeout(view, monkeypatch):
    from cosyllama.server import wyoming

    seen = {"sent": 0, "last": None, "stop": False}
    real = wyoming.event_bytes

    def counted(event):
        data = real(event)
        seen["sent"] += len(data)
        seen["last"] = time.monotonic()
        seen["stop"] = seen["stop"] or event.type == "audio-stop"
        return data

    monkeypatch.setattr(wyoming, "event_bytes", counted)
    options = ServingOptions(view.options, max_concurrent=2, defaults=SynthesisOptions(greedy=True),
                             connection_limits=SLOW_LIMITS)
    app = create_app(view, ServeOptions(options, wyoming="tcp://127.0.0.1:0"))
    srv = LoopbackServer(app)
    try:
        with socket.create_connection(("127.0.0.1", app.state.server.wyoming.address[1])) as s:
            s.sendall(wyoming_event("synthesize", {"text": SPOKEN, "voice": {"name": "en"}}))
            waited = _slot_freed_after_a_stall(srv.url, lambda: seen["last"], lambda: seen["stop"], "Wyoming")
        _assert_cut("Wyoming", seen["sent"], waited)
    finally:
        srv.stop()


def test_the_non_reader_script_measures_each_door(capsys):
    """scripts/non_reader.py against a server it starts (--write-timeout 2): every door's client is
    cut, its slot free a little after the timeout."""
    import runpy
    from pathlib import Path

    from helpers import MODEL_DIR

    script = Path(__file__).resolve().parents[1] / "scripts" / "non_reader.py"
    main = runpy.run_path(str(script))["main"]
    assert main(["--model-dir", str(MODEL_DIR), "--write-timeout", "2", "--greedy", "--limit", str(WAIT_S)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["http", "websocket", "wyoming"], rows
    for door, timeout, _, seconds, answer in rows:
        assert timeout == "2" and answer == "cut", (door, seconds, answer)
        assert float(seconds) <= 2 + CLEAN_UP_S, (door, seconds)

"""A streamed connection's life on the WebSocket and Wyoming doors (issue #53), on loopback with the tiny model:
a client that reads slowly but keeps reading is never cut (one write bound, on progress); a client that resets
while the server's write waits leaves no task exception unretrieved; a Wyoming connection's requests are answered
in order, so a refused one does not drop those accepted before it; and ``serve`` runs uvicorn without its
keepalive pings, which would queue behind audio and close a slow reader."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import select
import socket
import struct
import threading
import time

import pytest

from helpers import LoopbackServer
from raw_clients import RawWebSocket, read_wyoming_events, wyoming_event
from server_helpers import WAIT_S, voiced_tts
from server_helpers import wait_until as _wait

pytest.importorskip("fastapi")
pytest.importorskip("wyoming")
httpx = pytest.importorskip("httpx")

from cosyllama.request import SynthesisOptions  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.conn import ConnectionLimits, uvicorn_options  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402

LONG = "This is a long sentence that keeps the model busy for a good while, word after word after word."
CONFIG = {"type": "session.config", "voice": "en", "greedy": True, "seed": 0, "response_format": "pcm"}


@pytest.fixture(scope="module")
def tts():
    return voiced_tts()


def _wyoming_options(tts, **defaults) -> ServeOptions:
    """``serve --wyoming`` of ``tts`` on a free port, every request starting from ``defaults`` (greedy, seed)."""
    return ServeOptions(ServingOptions(tts.options, defaults=SynthesisOptions(**defaults)), wyoming="tcp://127.0.0.1:0")


class Paced:
    """A socket whose ``recv`` takes at most ``piece`` bytes after a pause of ``pause`` seconds: a client that reads
    slowly but steadily (the rest is the socket's)."""

    def __init__(self, sock: socket.socket, piece: int, pause: float):
        self.sock, self.piece, self.pause = sock, piece, pause

    def recv(self, n: int) -> bytes:
        time.sleep(self.pause)
        return self.sock.recv(min(n, self.piece))

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_websocket_client_that_reads_slowly_but_steadily_is_not_cut(tts):
    """At --write-timeout 2, a client with a 4 KiB receive buffer reading 8 KiB every 0.1 s (80 KB/s) gets a
    sentence's whole file (one frame of ~700 KB), its audio.done and session.done: bytes leave every 0.1 s,
    so the write bound (no progress for 2 s) never fires. A deadline per send cut it: the frame after the big
    one waited for the whole backlog to drain (seconds)."""
    limits = ConnectionLimits(write_timeout=2.0)
    srv = LoopbackServer(create_app(tts, ServingOptions(tts.options, connection_limits=limits)),
                         **uvicorn_options(limits))
    try:
        ws = RawWebSocket(srv.port, rcvbuf=4096)
        try:
            ws.send_text(json.dumps(CONFIG))
            ws.send_text(json.dumps({"type": "input.text", "text": LONG}))
            ws.send_text(json.dumps({"type": "input.done"}))
            ws.sock = Paced(ws.sock, 8192, 0.1)
            kinds, audio = [], 0
            while not kinds or kinds[-1] not in ("session.done", "error"):
                op, payload = ws.recv()
                if op == 2:
                    audio += len(payload)
                    kinds.append("audio")
                else:
                    assert op == 1, (op, payload[:200])
                    kinds.append(json.loads(payload)["type"])
        finally:
            ws.close()
        assert kinds == ["audio.start", "audio", "audio.done", "session.done"], kinds
        assert audio > 300_000, f"{audio} bytes: too little audio to outlast a write timeout at this pace"
    finally:
        srv.stop()


# ----------------------------------------------------------------------------------------------
# A client that resets while a write waits


def _watch_blocked_write(monkeypatch, door: str) -> threading.Event:
    """An event set when the server's write of audio to a client that reads nothing begins to wait: the
    WebSocket's second audio frame (the first fills the buffers), Wyoming's drain of its first audio chunk."""
    import asyncio

    from cosyllama.server import speech_stream
    from cosyllama.server.session import Audio

    blocked, audio_sends = threading.Event(), []
    if door == "websocket":
        real_send = speech_stream._Connection.send

        async def send(conn, event):
            if isinstance(event, Audio):
                audio_sends.append(event)
                if len(audio_sends) == 2:
                    blocked.set()
            return await real_send(conn, event)

        monkeypatch.setattr(speech_stream._Connection, "send", send)
    else:
        real_drain = asyncio.StreamWriter.drain

        async def drain(writer):
            if writer.transport.get_write_buffer_size() > 1 << 20:
                blocked.set()
            return await real_drain(writer)

        monkeypatch.setattr(asyncio.StreamWriter, "drain", drain)
    return blocked


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (RST), as a client that goes away hard."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize("door", ["websocket", "wyoming"])
def test_a_client_that_resets_while_a_write_waits_leaves_no_task_exception_unretrieved(tts, door, monkeypatch,
                                                                                     caplog):
    """Every audio chunk is 2 MiB here, so a client that reads nothing makes the server's write wait (the
    WebSocket's second audio frame, Wyoming's first chunk); the client then resets. Its session ends and frees
    its slot, and no task is left holding the exception (asyncio's "Task exception was never retrieved", with a
    traceback, when the task is collected)."""
    import numpy as np

    from cosyllama.server import job, speech

    real_speech, real_samples = speech.SpeechJob.output, job.SynthesisJob.output
    monkeypatch.setattr(speech.SpeechJob, "output",
                        lambda self: None if real_speech(self) is None else b"\0" * (2 << 20))
    monkeypatch.setattr(job.SynthesisJob, "output",
                        lambda self: None if real_samples(self) is None else np.zeros(1 << 20, np.float32))
    blocked = _watch_blocked_write(monkeypatch, door)
    gc.collect()  # what earlier tests left (e.g. an HTTP client library's tasks) is collected before the watch
    caplog.set_level(logging.ERROR, logger="asyncio")
    app = create_app(tts, _wyoming_options(tts, greedy=True))
    srv = LoopbackServer(app, **uvicorn_options(ConnectionLimits()))  # the bounded send buffer of serve
    gate = app.state.server.serving.gate
    try:
        if door == "websocket":
            ws = RawWebSocket(srv.port, rcvbuf=4096)
            ws.send_text(json.dumps({**CONFIG, "stream_audio": True}))
            ws.send_text(json.dumps({"type": "input.text", "text": LONG}))
            ws.send_text(json.dumps({"type": "input.done"}))
            sock = ws.sock
        else:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", app.state.server.wyoming.address[1]))
            sock.sendall(wyoming_event("synthesize", {"text": LONG, "voice": {"name": "en"}}))
        assert blocked.wait(WAIT_S), "the server's write never had to wait"
        _reset(sock)
        _wait(lambda: gate.running == 0, "the session kept its slot")
        _wait(lambda: not srv.server.server_state.tasks and not app.state.server.wyoming.service.connections,
              "the connection's handler did not end")
        gc.collect()
    finally:
        srv.stop()
    gc.collect()
    # the server's tasks (a client library's own, collected here, are not this test's: httpx's aclose once
    # failed so in CI with "Event loop is closed", its loop long gone)
    lost = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()
            and "httpx" not in r.getMessage()]
    assert not lost, lost


# ----------------------------------------------------------------------------------------------
# Wyoming: requests answered in order


@pytest.fixture(scope="module")
def wyoming_server(tts):
    app = create_app(tts, _wyoming_options(tts, greedy=True, seed=0))
    srv = LoopbackServer(app)
    srv.app, srv.port = app, app.state.server.wyoming.address[1]
    yield srv
    srv.stop()


def _read_events(sock: socket.socket) -> list[tuple[str, dict]]:
    """What the server sends until it closes the connection: (type, data) of each event."""
    sock.settimeout(WAIT_S)
    return read_wyoming_events(sock)


def _held_exchange(server, tts, raw: bytes) -> list[tuple[str, dict]]:
    """Send ``raw`` while the LLM is held (nothing can be spoken yet); let it go once the server has read every
    event (its session takes no more) or has answered already; then the events until the connection closes."""
    conns = server.app.state.server.wyoming.service.connections
    tts.llm.hold_after(0)
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(raw)
        _wait(lambda: select.select([sock], [], [], 0)[0] or any(c.session.closing for c in list(conns.values())),
              "the server neither answered nor read the events")
    finally:
        tts.llm.let_go()
    with sock:
        return _read_events(sock)


def _utterances(events) -> list[list[str]]:
    """The event types between each audio-start and its audio-stop (chunks counted once)."""
    out, current = [], None
    for kind, _ in events:
        if kind == "audio-start":
            current = []
        elif kind == "audio-stop":
            out.append(current)
            current = None
        elif current is not None and (not current or current[-1] != kind):
            current.append(kind)
    return out


def test_a_fifth_pipelined_synthesize_is_refused_after_the_four_accepted_are_spoken(wyoming_server, tts):
    """Five ``synthesize`` events sent at once: a connection may have four requests waiting or speaking, so
    the fifth is refused ``busy``; the four are spoken, in order, and the error comes after them."""
    raw = b"".join(wyoming_event("synthesize", {"text": f"Number {i}.", "voice": {"name": "en"}}) for i in range(5))
    events = _held_exchange(wyoming_server, tts, raw)
    assert _utterances(events) == [["audio-chunk"]] * 4, [k for k, _ in events]
    assert events[-1][0] == "error" and events[-1][1]["code"] == "busy", events[-1]
    _wait(lambda: wyoming_server.app.state.server.serving.gate.running == 0, "a request kept its slot")


def test_a_second_synthesize_stop_does_not_cancel_the_finished_stream(wyoming_server, tts):
    """``synthesize-start, -chunk, -stop, -stop``: the stream is spoken (to its synthesize-stopped), then the
    second stop, which has no stream to end, gets its protocol_error."""
    raw = (wyoming_event("synthesize-start", {"voice": {"name": "en"}})
           + wyoming_event("synthesize-chunk", {"text": "Hello there."})
           + wyoming_event("synthesize-stop", {}) + wyoming_event("synthesize-stop", {}))
    events = _held_exchange(wyoming_server, tts, raw)
    kinds = [k for k, _ in events]
    assert _utterances(events) == [["audio-chunk"]] and kinds[-2:] == ["synthesize-stopped", "error"], kinds
    assert events[-1][1]["code"] == "protocol_error" and "synthesize-stop" in events[-1][1]["text"]


# ----------------------------------------------------------------------------------------------
# uvicorn's keepalive pings


def test_serve_runs_uvicorn_without_keepalive_pings(monkeypatch):
    """uvicorn pings a WebSocket every 20 s and closes it (1011) when no pong comes within 20 s; a ping is
    queued behind the audio not yet read, so a client reading slowly (2 KB/s behind ~330 KB) was closed though
    it answered every ping. ``serve`` turns the pings off: the write bound (no progress for --write-timeout)
    and --idle-timeout find a client that is gone."""
    from types import SimpleNamespace

    import uvicorn

    from cosyllama.options import LoadOptions
    from cosyllama.server import app as server
    from cosyllama.server import startup
    from cosyllama.server.options import ServeOptions, ServingOptions
    from helpers import MODEL_DIR

    models = SimpleNamespace(llm=SimpleNamespace(name="torch"))
    monkeypatch.setattr(startup, "load_models", lambda options: models)
    monkeypatch.setattr(startup, "warm_voices", lambda tts, **kw: None)
    monkeypatch.setattr(server, "prepare", lambda models, options, voices: SimpleNamespace(
        models=models, tts=None, options=options, close=lambda: None))
    monkeypatch.setattr(server, "check_can_listen", lambda *a: None)
    monkeypatch.setattr(server, "create_app", lambda serving, options: object())
    configs = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: configs.append(self.config))
    with contextlib.suppress(SystemExit):  # uvicorn.run exits when its server did not start
        server.serve(ServeOptions(ServingOptions(LoadOptions(MODEL_DIR)), host="127.0.0.1", port=8000))
    assert len(configs) == 1
    assert configs[0].ws_ping_interval is None and configs[0].ws_ping_timeout is None

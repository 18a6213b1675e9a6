"""SIGTERM (issue #53): ``cosyllama serve`` and ``cosyllama wyoming``, each in its own process on the tiny model,
stop taking work at once on every door (a new connection is refused, an idle session is told
``server_stopping`` and closed), let the work that runs finish (an open utterance is spoken to its end), cut what
is still running after the drain (a client that reads nothing), and exit with status 0 within the drain's bound."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import time

import pytest

from cli_run import COSYLLAMA, Background, free_port
from helpers import MODEL_DIR
from raw_clients import wyoming_event
from server_helpers import PROMPT_TEXT, PROMPT_WAV

pytest.importorskip("fastapi")
pytest.importorskip("wyoming")
pytest.importorskip("websockets")
httpx = pytest.importorskip("httpx")
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from cosyllama.server.shutdown import DRAIN_S, FAREWELL_S  # noqa: E402

TIMEOUT = 60  # seconds for any one answer: generous, only a hang reaches it
EXIT_SLACK_S = 10.0  # past the drain and the farewell: uvicorn's own stop, the model threads, the interpreter's exit
LONG = " ".join(["This is a long sentence that keeps the model busy for a good while, word after word after "
                 "word."] * 3)


def _stopping(server: Background) -> None:
    """Wait for the server's line saying it stopped taking work (the signal was handled)."""
    def said() -> bool:
        return bool(re.search(r"stopping: no new work is taken", server.output(tail=10**6)))

    server.wait_until(said, "the stop line", timeout=TIMEOUT)


def _wyoming_events(sock: socket.socket, until: str | None = None) -> list[tuple[str, dict]]:
    """Events read from ``sock`` up to one of type ``until`` (or to the end of the connection)."""
    sock.settimeout(TIMEOUT)
    events, buf = [], b""
    while True:
        while b"\n" not in buf:
            with contextlib.suppress(ConnectionResetError):
                data = sock.recv(1 << 16)
                if data:
                    buf += data
                    continue
            return events
        line, _, buf = buf.partition(b"\n")
        header = json.loads(line)
        n = header.get("data_length", 0) + header.get("payload_length", 0)
        while len(buf) < n:
            data = sock.recv(1 << 16)
            assert data, "the connection ended inside an event"
            buf += data
        k = header.get("data_length", 0)
        events.append((header["type"], json.loads(buf[:k]) if k else {}))
        buf = buf[n:]
        if header["type"] == until:
            return events


def _kind(message) -> str:
    """A WebSocket message's type, ``audio`` for a binary one."""
    return "audio" if isinstance(message, bytes) else json.loads(message)["type"]


def _non_reader(port: int, raw: bytes) -> socket.socket:
    """A client that sends ``raw`` and never reads (a 4 KiB receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(raw)
    return s


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
    except ConnectionRefusedError:
        return True
    return False


def _exits_0_within_the_bound(server: Background, signalled: float) -> float:
    rc = server.proc.wait(DRAIN_S + FAREWELL_S + EXIT_SLACK_S + TIMEOUT)
    took = time.monotonic() - signalled
    log = server.output(tail=10**6)
    assert rc == 0, f"exit status {rc}:\n{log[-3000:]}"
    assert took <= DRAIN_S + FAREWELL_S + EXIT_SLACK_S, f"exited {took:.1f} s after SIGTERM:\n{log[-3000:]}"
    assert "Traceback" not in log and "never retrieved" not in log, log[-5000:]
    return took


def test_serve_drains_every_door_on_sigterm_and_exits_0(tmp_path):
    http, wyoming = free_port(), free_port()
    server = Background([*COSYLLAMA, "serve", "--model-dir", str(MODEL_DIR), "--threads", "1", "--port", str(http),
                         "--wyoming", f"tcp://127.0.0.1:{wyoming}", "--greedy"],
                        cwd=tmp_path, log=tmp_path / "serve.log")
    try:
        server.wait_http(http)
        with httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=TIMEOUT) as c:
            assert c.post("/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                          data={"id": "en", "text": PROMPT_TEXT}).status_code == 200
            body = json.dumps({"input": LONG, "voice": "en", "stream_format": "audio", "response_format": "pcm"})
            non_reader = _non_reader(http, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
            deadline = time.monotonic() + TIMEOUT
            while c.get("/health").json()["requests_running"] == 0:  # its stream is under way
                assert time.monotonic() < deadline, "the non-reader's request did not start"
                time.sleep(0.05)
        with connect(f"ws://127.0.0.1:{http}/v1/audio/speech/stream", open_timeout=TIMEOUT, max_size=None) as ws:
            ws.send(json.dumps({"type": "session.config", "voice": "en", "response_format": "pcm"}))
            ws.send(json.dumps({"type": "input.text", "text": "Hello there. "}))  # an utterance open: one sentence
            assert [_kind(ws.recv(TIMEOUT)) for _ in range(3)] == ["audio.start", "audio", "audio.done"]
            idle = socket.create_connection(("127.0.0.1", wyoming), timeout=TIMEOUT)
            idle.sendall(wyoming_event("describe", {}))
            assert _wyoming_events(idle, until="info")[-1][0] == "info"

            signalled = time.monotonic()
            os.kill(server.proc.pid, signal.SIGTERM)
            _stopping(server)
            assert _refused(http) and _refused(wyoming)  # the listeners are closed
            with idle:  # an idle session is told at once
                assert [(k, d["code"]) for k, d in _wyoming_events(idle)] == [("error", "server_stopping")]
            ws.send(json.dumps({"type": "input.text", "text": "Goodbye now."}))  # the open utterance goes on
            ws.send(json.dumps({"type": "input.done"}))
            got = []
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    got.append(ws.recv(TIMEOUT))
            kinds = [_kind(m) for m in got]
            assert kinds == ["audio.start", "audio", "audio.done", "session.done", "error"], kinds
            assert json.loads(got[-1])["code"] == "server_stopping" and closed.value.rcvd.code == 1001
        took = _exits_0_within_the_bound(server, signalled)
        assert took >= DRAIN_S * 0.9, "the non-reader's response should have held the drain to its end"
        assert "stopping: cutting what still runs" in server.output(tail=10**6)
        non_reader.close()
    finally:
        server.stop()


def test_wyoming_drains_on_sigterm_and_exits_0(tmp_path):
    voices = tmp_path / "voices"
    (voices / "en").mkdir(parents=True)
    shutil.copy(PROMPT_WAV, voices / "en" / "ref.wav")
    (voices / "en" / "ref.txt").write_text(PROMPT_TEXT)
    port = free_port()
    server = Background([*COSYLLAMA, "wyoming", "--model-dir", str(MODEL_DIR), "--threads", "1", "--uri",
                         f"tcp://127.0.0.1:{port}", "--voices", str(voices), "--greedy"],
                        cwd=tmp_path, log=tmp_path / "wyoming.log")
    try:
        server.wait_tcp(port)
        stream = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        stream.sendall(wyoming_event("synthesize-start", {"voice": {"name": "en"}})
                       + wyoming_event("synthesize-chunk", {"text": "Hello there. "}))
        assert _wyoming_events(stream, until="audio-chunk")[-1][0] == "audio-chunk"  # its first sentence speaks
        non_reader = _non_reader(port, wyoming_event("synthesize", {"text": LONG, "voice": {"name": "en"}}))
        # Its request is under way once its first event comes: peeked, not read (its buffer stays full). Without
        # this the signal could come before the server read its request, which is then refused as an idle one's.
        non_reader.settimeout(TIMEOUT)
        assert non_reader.recv(1, socket.MSG_PEEK)
        idle = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        idle.sendall(wyoming_event("describe", {}))
        assert _wyoming_events(idle, until="info")[-1][0] == "info"

        signalled = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        _stopping(server)
        assert _refused(port)
        with idle:
            assert [(k, d["code"]) for k, d in _wyoming_events(idle)] == [("error", "server_stopping")]
        with stream:  # the open stream goes on to its end, then is told
            stream.sendall(wyoming_event("synthesize-chunk", {"text": "Goodbye now."})
                           + wyoming_event("synthesize-stop", {}))
            kinds = [k for k, _ in _wyoming_events(stream)]
        assert kinds[-3:] == ["audio-stop", "synthesize-stopped", "error"] and "audio-chunk" in kinds, kinds
        took = _exits_0_within_the_bound(server, signalled)
        assert took >= DRAIN_S * 0.9, "the non-reader's request should have held the drain to its end"
        non_reader.close()
    finally:
        server.stop()

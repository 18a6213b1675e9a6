"""What an operator reads (issue #53): ``serve`` and ``wyoming`` write cosyllama's log lines from ``--log-level``
(info by default) to stderr, one line each: the start (where, which model, how many voices), every refusal over
HTTP, the WebSocket and Wyoming, every client closed for a timeout, the stop; no line quotes more of a client's
text than its error message does (64 characters of a string)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import sys
import time

import pytest

from cli_run import COSYLLAMA, Background, free_port
from helpers import MODEL_DIR

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("wyoming")
pytest.importorskip("websockets")
from websockets.sync.client import connect  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.tts import Synthesize, SynthesizeVoice  # noqa: E402

from cosyllama.server.startup import configure_logging  # noqa: E402

TIMEOUT = 60  # seconds for any one answer: generous, only a hang reaches it
SECRET = "Whisper-" + "s" * 100  # a client's string: its log lines keep at most 64 characters of it


def test_configure_logging_sets_the_level_and_keeps_one_handler():
    logger = logging.getLogger("cosyllama")
    level, handlers = logger.level, list(logger.handlers)
    try:
        configure_logging("warning")
        assert logger.level == logging.WARNING
        configure_logging("info")
        assert logger.level == logging.INFO
        ours = [h for h in logger.handlers if type(h).__name__ == "_StderrHandler"]
        assert len(ours) == 1 and ours[0].stream is sys.stderr  # the stream of the moment (a capture too)
        with pytest.raises(Exception, match="--log-level must be one of debug, info, warning, error"):
            configure_logging("loud")
    finally:
        logger.setLevel(level)
        logger.handlers[:] = handlers


def _lines(server: Background, pattern: str) -> list[str]:
    return [line for line in server.output(tail=10**6).splitlines() if re.search(pattern, line)]


def _wait_line(server: Background, pattern: str) -> str:
    server.wait_until(lambda: _lines(server, pattern), f"a log line matching {pattern!r}", timeout=TIMEOUT)
    return _lines(server, pattern)[-1]


async def _wyoming_unknown_voice(port: int) -> dict:
    client = AsyncTcpClient("127.0.0.1", port)
    await client.connect()
    try:
        await client.write_event(Synthesize(text="Hello.", voice=SynthesizeVoice(name=SECRET)).event())
        event = await asyncio.wait_for(client.read_event(), TIMEOUT)
        return event.data
    finally:
        await client.disconnect()


def test_serve_logs_its_start_refusals_timeouts_and_stop(tmp_path):
    http, wyoming = free_port(), free_port()
    server = Background([*COSYLLAMA, "serve", "--model-dir", str(MODEL_DIR), "--threads", "1", "--port", str(http),
                         "--wyoming", f"tcp://127.0.0.1:{wyoming}", "--idle-timeout", "1"],
                        cwd=tmp_path, log=tmp_path / "serve.log")
    try:
        server.wait_http(http)
        start = _wait_line(server, r"listening on http://")
        assert f"http://127.0.0.1:{http}" in start and str(MODEL_DIR) in start and "0 voices" in start
        assert _lines(server, rf"INFO cosyllama\.server: Wyoming server listening on tcp://127\.0\.0\.1:{wyoming}")

        r = httpx.post(f"http://127.0.0.1:{http}/v1/audio/speech", json={"input": SECRET * 3, "voice": SECRET},
                       timeout=TIMEOUT)
        assert r.status_code == 404
        line = _wait_line(server, r"refused POST /v1/audio/speech of 127\.0\.0\.1:\d+: 404 voice_not_found: ")
        assert "INFO" in line and SECRET[:64] in line and SECRET[:65] not in line

        with connect(f"ws://127.0.0.1:{http}/v1/audio/speech/stream", open_timeout=TIMEOUT) as ws:
            ws.send(json.dumps({"type": "session.config", "voice": SECRET}))
            assert json.loads(ws.recv(timeout=TIMEOUT))["code"] == "voice_not_found"
        _wait_line(server, r"refused a /v1/audio/speech/stream session of 127\.0\.0\.1:\d+: 1008 voice_not_found: ")

        assert asyncio.run(_wyoming_unknown_voice(wyoming))["code"] == "voice_not_found"
        _wait_line(server, r"refused a Wyoming request of 127\.0\.0\.1:\d+: voice_not_found: ")

        with socket.create_connection(("127.0.0.1", wyoming), timeout=TIMEOUT) as idle:
            assert b"idle_timeout" in idle.recv(4096)
        _wait_line(server, r"closed the Wyoming connection of 127\.0\.0\.1:\d+: no event for 1 s \(--idle-timeout\)")
        time.sleep(0.5)
    finally:
        server.stop()
    log = server.output(tail=10**6)
    assert _lines(server, r"INFO cosyllama\.server: stopped serving \(HTTP and Wyoming\)")
    assert SECRET not in log and "Traceback" not in log
    for pattern in (r"listening on http://", r"refused POST", r"refused a Wyoming", r"no event for", "stopped serving"):
        assert len(_lines(server, pattern)) == 1, (pattern, log[-3000:])


def test_wyoming_logs_its_start_and_stop_at_the_level_asked(tmp_path):
    """``cosyllama wyoming`` says where it listens and that it stopped (SIGTERM); at ``--log-level warning``
    neither INFO line is written."""
    for level, shown in (("info", True), ("warning", False)):
        port = free_port()
        server = Background([*COSYLLAMA, "wyoming", "--model-dir", str(MODEL_DIR), "--threads", "1", "--uri",
                             f"tcp://127.0.0.1:{port}", "--log-level", level],
                            cwd=tmp_path, log=tmp_path / f"wyoming-{level}.log")
        try:
            server.wait_tcp(port)
            if shown:
                line = _wait_line(server, rf"listening on tcp://127\.0\.0\.1:{port}")
                assert str(MODEL_DIR) in line and "0 voices" in line
        finally:
            assert server.stop() == 0
        assert bool(_lines(server, r"INFO cosyllama\.server: cosyllama [^ ]+ listening on tcp://")) is shown
        assert bool(_lines(server, r"INFO cosyllama\.wyoming: Wyoming server stopped")) is shown


def test_the_guards_refusals_are_logged_without_the_clients_header(caplog):
    """A request without the API key, or from a refused origin, is one line with its status and code; the
    Origin header (quoted whole in the 403's message) is not in it."""
    from cosyllama.server.app import create_app
    from cosyllama.server.options import ServeOptions, ServingOptions
    from helpers import LoopbackServer
    from server_helpers import voiced_tts

    caplog.set_level(logging.INFO, logger="cosyllama")
    origin = "https://" + "o" * 300 + ".example"
    tts = voiced_tts(gated=False)
    srv = LoopbackServer(create_app(tts, ServeOptions(ServingOptions(tts.options), api_key="k")))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            assert c.post("/v1/audio/speech", json={}).status_code == 401
            assert c.post("/v1/audio/speech", json={}, headers={"Origin": origin}).status_code == 403
    finally:
        srv.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"refused POST /v1/audio/speech of 127\.0\.0\.1:\d+: 401 invalid_api_key", lines[0])
    assert re.fullmatch(r"refused POST /v1/audio/speech of 127\.0\.0\.1:\d+: 403 origin_not_allowed", lines[1])

"""Holes black-box probes found in what the server parses and echoes (issue #42), on loopback with
the tiny model:

* deeply nested JSON (a few KB of ``[[[…``) is a client's mistake on every door: a protocol error
  on Wyoming and the WebSocket, 400/422 over HTTP, never an internal error or a traceback
  (:mod:`cosyllama.server.client_json` bounds the nesting before parsing);
* an error message echoes at most 64 characters of any string a client sent, and names at most a
  few of them.
"""

from __future__ import annotations

import json
import logging

import pytest

from helpers import LoopbackServer
from raw_clients import RawWebSocket, wyoming_event, wyoming_exchange
from server_helpers import WAIT_S

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.client_json import ClientJSONError, clip, clip_names, loads, nesting_depth  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import VoiceStore  # noqa: E402

SHOWN = 64  # characters of a client's string a message may echo
DEEP_ARRAY = "[" * 3000 + "]" * 3000  # 6 KB, far inside every message bound


@pytest.fixture(scope="module")
def view(tts, voice):
    v = TTS.from_models(tts.models, voices=VoiceStore())
    v.voices.add("en", voice)
    return v


@pytest.fixture(scope="module")
def server(view):
    """The HTTP API, its WebSocket and Wyoming, from one app."""
    app = create_app(view, ServeOptions(ServingOptions(view.options, max_concurrent=2), wyoming="tcp://127.0.0.1:0"))
    srv = LoopbackServer(app)
    srv.app, srv.wyoming_port = app, app.state.server.wyoming.address[1]
    yield srv
    srv.stop()


def _no_tracebacks(caplog) -> None:
    bad = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()
           or "RecursionError" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]


# -- a raw WebSocket client: it sends what it likes and reads only when told ------------------------



# ==================================================================================================
# 1. deeply nested JSON


def test_client_json_bounds_depth_and_size():
    assert loads('{"a": [[1, {"b": "]]]"}]]}') == {"a": [[1, {"b": "]]]"}]]}
    assert nesting_depth('{"a": "[[[[\\"[[[["}') == 1  # brackets inside strings (escaped quotes too) do not count
    assert loads("[" * 32 + "]" * 32, max_depth=32)
    for text, why, cap in [("[" * 33 + "]" * 33, "nested more than 32 levels", None),
                           (DEEP_ARRAY, "nested more than 32", None), ("[" * 100_000, "nested more than 32", None),
                           ('{"a": 1', "not JSON", None), ("\"" + "[" * 5000, "not JSON", None),
                           ("x" * 101, "larger than 100 bytes", 100), ("\"é\"" * 30, "larger than 100 bytes", 100)]:
        with pytest.raises(ClientJSONError) as e:
            loads(text, max_bytes=cap)
        assert why in str(e.value) and "\n" not in str(e.value), (text[:20], e.value)
    with pytest.raises(ClientJSONError, match="not UTF-8"):
        loads(b"\xff[]")
    assert isinstance(ClientJSONError("x"), ValueError)


def test_deeply_nested_json_on_wyoming_is_a_protocol_error(server, caplog):
    """A synthesize event whose data is 3001 arrays deep, and a header whose version nests 5000 deep:
    each gets one ``error`` event ``protocol_error`` saying why, and the connection closes."""
    caplog.set_level(logging.INFO)
    data = b"[" * 3001 + b"]" * 3001
    header_deep = b'{"type": "describe", "version": ' + b"[" * 5000 + b"]" * 5000 + b"}\n"
    for raw in (json.dumps({"type": "synthesize", "data_length": len(data)}).encode() + b"\n" + data, header_deep):
        events = wyoming_exchange(server.wyoming_port, raw)
        assert [t for t, _ in events] == ["error"], events
        err = events[0][1]
        assert err["code"] == "protocol_error" and "nested more than 32 levels" in err["text"], err
    _no_tracebacks(caplog)


def test_deeply_nested_json_on_the_websocket_is_a_protocol_error(server, caplog):
    """The issue's frame: input.text whose text is 3000 arrays deep (6 KB) gets the error of a
    malformed message (``invalid_json``, close 1008), not ``internal_error`` and 1011."""
    caplog.set_level(logging.INFO)
    for first in (None, {"type": "session.config", "voice": "en"}):
        ws = RawWebSocket(server.port)
        try:
            if first is not None:
                ws.send_text(json.dumps(first))
            ws.send_text('{"type":"input.text","text":' + DEEP_ARRAY + "}")
            message, code = ws.refused()
        finally:
            ws.close()
        assert message["code"] == "invalid_json" and "nested more than 32 levels" in message["message"], message
        assert code == 1008
    _no_tracebacks(caplog)


def test_deeply_nested_json_over_http_is_a_clients_mistake(server, caplog):
    caplog.set_level(logging.INFO)
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as c:
        for body in ('{"input": "Hi.", "voice": "en", "x": ' + DEEP_ARRAY + "}", DEEP_ARRAY, "[" * 100_000):
            r = c.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})
            assert r.status_code in (400, 422), (r.status_code, r.text[:300])
            err = r.json()["error"]
            assert len(err["message"]) < 600 and "Recursion" not in err["message"], err
    _no_tracebacks(caplog)


LONE = '"\\ud800 hi"'  # JSON text with half a surrogate pair: valid JSON, no character (the fuzzer found it)


def test_half_a_surrogate_pair_is_a_clients_mistake_on_every_door(server, caplog):
    """A JSON string escape ``\\ud800`` alone is valid JSON but no text (no encoder writes it): a ping
    that echoed it was an internal error. Wyoming answers ``protocol_error``, the WebSocket
    ``invalid_json``, HTTP 4xx; no traceback."""
    caplog.set_level(logging.INFO)
    for raw in (b'{"type": "ping", "data": {"text": ' + LONE.encode() + b"}}\n",
                b'{"type": "synthesize", "data": {"text": ' + LONE.encode() + b', "voice": {"name": "en"}}}\n'):
        events = wyoming_exchange(server.wyoming_port, raw)
        assert [t for t, _ in events] == ["error"], events
        assert events[0][1]["code"] == "protocol_error" and "half a character" in events[0][1]["text"], events
    ws = RawWebSocket(server.port)
    try:
        ws.send_text(json.dumps({"type": "session.config", "voice": "en"}))
        ws.send_text('{"type":"input.text","text":' + LONE + "}")
        message, code = ws.refused()
    finally:
        ws.close()
    assert (message["code"], code) == ("invalid_json", 1008), message
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as c:
        r = c.post("/v1/audio/speech", content='{"input": ' + LONE + ', "voice": "en"}',
                   headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    _no_tracebacks(caplog)


# ==================================================================================================
# 4. what an error message echoes of a client's strings


def test_clip_and_clip_names():
    assert clip("abc") == "'abc'"
    assert clip("x" * 30_000) == repr("x" * SHOWN) + "... (30000 characters)"
    assert clip(5) == "(a int)"
    assert clip_names(["a", "b"]) == "'a', 'b'"
    assert clip_names(["y" * 100] * 7) == ", ".join([repr("y" * SHOWN) + "... (100 characters)"] * 5) + " and 2 more"


def _short(text: str, limit: int = 600) -> None:
    assert len(text) < limit, (len(text), text[:200])
    for c in "xyzvmq":
        assert c * (SHOWN + 1) not in text, text[:300]


def test_websocket_errors_echo_at_most_64_characters_of_a_clients_string(server):
    long = 30_000
    config = {"type": "session.config", "voice": "en"}
    cases = [
        [{"type": "x" * long}],
        [config, {"type": "input.text", "text": "Hi.", "y" * long: 1}],
        [config, {"type": "input.text", "text": "Hi.", **{f"{i:03d}" + "y" * 80: 1 for i in range(300)}}],
        [config, {"type": "input.done", "z" * long: 1}],
        [config, {"type": "session.close", "z" * long: 1}],
        [{**config, "q" * long: 1}],
        [{**config, "voice": "v" * long}],
        [{**config, "mode": "m" * long}],
        [{**config, "response_format": "x" * long}],
        [{**config, "split_granularity": "x" * long}],
    ]
    for messages in cases:
        ws = RawWebSocket(server.port)
        try:
            for m in messages:
                ws.send_text(json.dumps(m))
            error, code = ws.refused()
        finally:
            ws.close()
        assert code == 1008, (messages[-1].get("type", "")[:20], error)
        _short(error["message"])
        assert error["param"] is None or len(error["param"]) <= SHOWN + 3, error["param"][:100]


def test_wyoming_wire_errors_echo_at_most_64_characters(server):
    for raw in (wyoming_event("x" * 30_000, {}), json.dumps({"type": "describe", "data_length": "9" * 30_000}).encode()
                + b"\n", wyoming_event("synthesize", {"text": "Hi.", "voice": {"name": "v" * 30_000}})):
        events = wyoming_exchange(server.wyoming_port, raw)
        assert [t for t, _ in events] == ["error"], events
        _short(events[0][1]["text"])


def test_wyoming_errors_echo_at_most_64_characters_of_a_language(server):
    events = wyoming_exchange(server.wyoming_port,
                      wyoming_event("synthesize", {"text": "Hi.", "voice": {"language": "q" * 30_000}}))
    assert [t for t, _ in events] == ["error"], events
    _short(events[0][1]["text"])

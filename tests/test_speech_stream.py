"""``/v1/audio/speech/stream`` (vLLM-Omni's WebSocket messages) on loopback, driven by the
``websockets`` package's plain client: text pieces in, each sentence's audio out as soon as it is
complete (before the next piece is sent), equal to ``/v1/audio/speech`` for the same sentence and
seed; the protocol's error messages (then a clean close) for bad configs, unknown voices, bounds
and bad messages; a disconnect frees the LLM sequence; the HTTP routes' API key and origin checks."""

from __future__ import annotations

import json
import random
import time

import pytest

from helpers import LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from cosyllama.limits import RequestLimits  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.conn import ConnectionLimits, uvicorn_options  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from server_helpers import continued_pcm, voiced_tts  # noqa: E402
from server_helpers import wait_until as _wait  # noqa: E402

TIMEOUT = 120  # seconds for any one message: generous, only a hang reaches it
PATH = "/v1/audio/speech/stream"
CONFIG = {"type": "session.config", "voice": "en", "greedy": True, "seed": 0}
LONG = "This is a long sentence that keeps the model busy for a good while, word after word after word."


@pytest.fixture(scope="module")
def tts():
    return voiced_tts()


def _serve(app, **config) -> LoopbackServer:
    srv = LoopbackServer(app, **config)
    srv.app = app
    return srv


@pytest.fixture(scope="module")
def server(tts):
    srv = _serve(create_app(tts))
    yield srv
    srv.stop()


def _ws(srv, **kw):
    return connect(f"ws://127.0.0.1:{srv.port}{PATH}", open_timeout=TIMEOUT, close_timeout=TIMEOUT, max_size=None,
                   **kw)


def _send(ws, **message) -> None:
    ws.send(json.dumps(message))


def _recv(ws):
    """The next message: a dict for JSON text, bytes for audio."""
    m = ws.recv(timeout=TIMEOUT)
    return m if isinstance(m, bytes) else json.loads(m)


def _sentence(ws) -> tuple[dict, bytes, dict]:
    """One sentence's ``audio.start``, audio and ``audio.done``."""
    start = _recv(ws)
    assert isinstance(start, dict) and start["type"] == "audio.start", start
    audio = b""
    while isinstance(m := _recv(ws), bytes):
        audio += m
    assert m["type"] == "audio.done", m
    assert (m["utterance_index"], m["sentence_index"]) == (start["utterance_index"], start["sentence_index"])
    assert m["total_bytes"] == len(audio) and m["error"] is False
    return start, audio, m


def _refused(ws) -> tuple[dict, int]:
    """The ``error`` message the server answers with, and the code it then closes with."""
    m = _recv(ws)
    assert isinstance(m, dict) and m["type"] == "error", m
    with pytest.raises(ConnectionClosed):
        ws.recv(timeout=TIMEOUT)
    return m, ws.close_code


def _http(srv, text: str, **fields) -> bytes:
    body = {"input": text, "voice": "en", "greedy": True, "seed": 0, **fields}
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    return r.content


def test_each_sentence_is_spoken_before_the_next_piece_is_sent(server, tts):
    """Event-driven: the client sends the second sentence only after the first one's audio has
    arrived whole, so a server that waited for more text (or for input.done) hangs this test."""
    with _ws(server) as ws:
        _send(ws, **CONFIG, response_format="pcm", stream_audio=True)
        _send(ws, type="input.text", text="Hello there. ")
        start, first, _ = _sentence(ws)
        assert start == {"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                         "sentence_text": "Hello there.", "format": "pcm", "sample_rate": tts.sample_rate,
                         "channels": 1}
        for piece in ("How are", " you", " today?"):
            _send(ws, type="input.text", text=piece)
        _send(ws, type="input.done")
        start, second, _ = _sentence(ws)
        assert (start["sentence_index"], start["sentence_text"]) == (1, "How are you today?")
        assert _recv(ws) == {"type": "session.done", "utterance_index": 0, "total_sentences": 2}
        # the connection stays open for the next utterance, with the same config
        _send(ws, type="input.text", text="Bye.")
        _send(ws, type="input.done")
        start, third, _ = _sentence(ws)
        assert (start["utterance_index"], start["sentence_index"]) == (1, 0)
        assert _recv(ws) == {"type": "session.done", "utterance_index": 1, "total_sentences": 1}
        _send(ws, type="session.close")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=TIMEOUT)
        assert ws.close_code == 1000
    # each utterance's first sentence is /v1/audio/speech's for that sentence, with the same seed; a later one is
    # that sentence with the space before it, as the whole text's segments keep it (docs/server.md)
    for text, got in (("Hello there.", first), ("Bye.", third)):
        assert got and got == _http(server, text, response_format="pcm", stream_format="audio"), text
    assert second == continued_pcm(tts, "How are you today?", "en", seed=1)
    assert second != _http(server, "How are you today?", response_format="pcm", stream_format="audio", seed=1)


def test_a_text_streamed_sentence_by_sentence_is_the_same_text_sent_whole(server):
    """Two long sentences after a space: the whole text splits between them (its second segment keeps the space,
    the reference's segmentation) and the stream speaks the same two inputs with the same seeds, so the audio
    is /v1/audio/speech's for the whole text, byte for byte. Before the streamed sentence kept the space before
    it, its second sentence was one token shorter and sounded different."""
    from test_streamed_as_whole import A, B

    pieces = [A[:40], A[40:] + " " + B[:10], B[10:]]
    with _ws(server) as ws:
        _send(ws, **CONFIG, response_format="pcm", stream_audio=True)
        for piece in pieces:
            _send(ws, type="input.text", text=piece)
        _send(ws, type="input.done")
        audio = b"".join(_sentence(ws)[1] for _ in range(2))
        assert _recv(ws)["type"] == "session.done"
    assert audio == _http(server, A + " " + B, response_format="pcm", stream_format="audio")


def test_the_python_api_gives_the_doors_bytes(server, tts):
    """The Python API's synthesis of a request, streamed or not, is the HTTP door's body, byte for byte
    (docs/usage.md, determinism), before and after the voice's prompt block is kept."""
    from cosyllama.audio_out import pcm16

    tts.token2wav.clear_prompt_cache()
    for stream in (True, False):
        api = pcm16(tts.synthesize("Nice to meet you.", voice="en", greedy=True, seed=0, stream=stream).audio())
        fields = {"stream_format": "audio"} if stream else {}
        assert api == _http(server, "Nice to meet you.", response_format="pcm", **fields), stream


def test_a_whole_file_per_sentence_and_the_whole_text_at_once(server):
    """Without stream_audio each sentence is one frame, /v1/audio/speech's whole file (here with a
    speed); with split_granularity none the utterance is one request. A new config between
    utterances applies to the next one."""
    with _ws(server) as ws:
        _send(ws, **CONFIG, response_format="wav", speed=1.5)
        _send(ws, type="input.text", text="One.\nTwo")  # after a line break: nothing before "Two" is kept
        _send(ws, type="input.done")
        frames = []
        for _ in range(2):
            start, audio, _ = _sentence(ws)
            frames.append((start["sentence_text"], audio))
        assert _recv(ws)["type"] == "session.done"
        _send(ws, **CONFIG, response_format="pcm", split_granularity="none")
        _send(ws, type="input.text", text="Three. ")
        _send(ws, type="input.text", text="Four.")
        _send(ws, type="input.done")
        start, whole, _ = _sentence(ws)
        assert start["sentence_text"] == "Three. Four." and start["format"] == "pcm"
        assert _recv(ws) == {"type": "session.done", "utterance_index": 1, "total_sentences": 1}
    assert [t for t, _ in frames] == ["One.", "Two"]
    for text, audio in frames:
        assert audio[:4] == b"RIFF" and audio == _http(server, text, response_format="wav", speed=1.5)
    assert whole == _http(server, "Three. Four.", response_format="pcm")


def test_a_stream_at_another_speed_or_as_flac_is_the_whole_file_sent_as_encoded(server):
    """stream_audio with a speed other than 1, or as flac, is not refused: the sentence is the
    whole-file synthesis of /v1/audio/speech, sent as it is encoded (as the HTTP route streams it)."""
    for fields in ({"response_format": "pcm", "speed": 1.5}, {"response_format": "flac"}):
        with _ws(server) as ws:
            _send(ws, **CONFIG, stream_audio=True, **fields)
            _send(ws, type="input.text", text="One.")
            _send(ws, type="input.done")
            _, audio, _ = _sentence(ws)
            assert _recv(ws)["type"] == "session.done"
        assert audio == _http(server, "One.", **fields)


def test_an_empty_utterance_and_punctuation_only(server):
    with _ws(server) as ws:
        _send(ws, **CONFIG)
        _send(ws, type="input.done")
        assert _recv(ws) == {"type": "session.done", "utterance_index": 0, "total_sentences": 0}
        _send(ws, type="input.text", text="... ")
        _send(ws, type="input.done")
        assert _recv(ws) == {"type": "session.done", "utterance_index": 1, "total_sentences": 0}


@pytest.mark.parametrize("messages, code, param, words", [
    ([{"type": "input.text", "text": "Hi."}], "session_not_configured", "type", "session.config first"),
    ([{**CONFIG, "voice": "nobody"}], "voice_not_found", "voice", "'nobody'"),
    ([{"type": "session.config"}], "missing", "voice", "voice"),
    ([{**CONFIG, "speed": "fast"}], "float_type", "speed", "speed"),
    ([{**CONFIG, "speed": 9.0}], "less_than_equal", "speed", "speed"),
    ([{**CONFIG, "language": "en"}], "extra_forbidden", "language", "language"),
    ([{**CONFIG, "input": "Hi."}], "invalid_config", "input", "input.text"),
    ([{**CONFIG, "mode": "instruct"}], "conflicting_fields", "instructions", "instructions"),
    ([{**CONFIG, "split_granularity": "clause"}], "literal_error", "split_granularity", "split_granularity"),
    ([CONFIG, {"type": "speak", "text": "Hi."}], "unknown_message_type", "type", "'speak'"),
    ([CONFIG, {"type": "input.text", "text": 5}], "invalid_message", "text", "string"),
    ([CONFIG, {"type": "input.text", "text": "Hi", "voice": "en"}], "invalid_message", "voice", "voice"),
    ([CONFIG, {"type": "input.text", "text": "Hi"}, CONFIG], "utterance_in_progress", "type", "input.done"),
    (["not json"], "invalid_json", None, "JSON"),
    ([[1, 2]], "invalid_message", "type", "JSON object"),
    ([b"\x00\x01"], "invalid_message", None, "binary"),
])
def test_bad_messages_get_the_protocols_error_and_a_clean_close(server, messages, code, param, words):
    with _ws(server) as ws:
        for m in messages:
            ws.send(m if isinstance(m, (bytes, str)) else json.dumps(m))
        err, close = _refused(ws)
    assert (err["code"], err["param"], close) == (code, param, 1008), err
    assert words in err["message"] and "Traceback" not in err["message"]
    _wait(lambda: server.app.state.server.serving.gate.running == 0, "a refused session kept a slot")


def test_bounds_on_what_a_client_sends(tts):
    small = RequestLimits(input_chars=40, instructions_chars=20, session_chars=60)
    srv = _serve(create_app(tts, ServingOptions(tts.options, limits=small)))
    try:
        def refused(*messages):
            with _ws(srv) as ws:
                for m in messages:
                    ws.send(json.dumps(m))
                return _refused(ws)

        err, close = refused({**CONFIG, "instructions": "x" * 21})  # the route's instructions limit
        assert (err["code"], err["param"], close) == ("string_above_max_length", "instructions", 1008)
        assert "--max-instructions-chars" in err["message"]
        err, close = refused(CONFIG, {"type": "input.text", "text": "x" * 41})  # one piece
        assert (err["code"], close) == ("string_above_max_length", 1008) and "--max-input-chars" in err["message"]
        err, _ = refused(CONFIG, *[{"type": "input.text", "text": "word "} for _ in range(9)])  # a sentence never ends
        assert err["code"] == "string_above_max_length" and "--max-input-chars" in err["message"]
        err, _ = refused(CONFIG, *[{"type": "input.text", "text": ""} for _ in range(61)])  # empty pieces count
        assert err["code"] == "string_above_max_length" and "--max-session-chars" in err["message"]
        with _ws(srv) as ws:  # a message larger than any text the limits allow
            _send(ws, **CONFIG)
            _send(ws, type="input.text", text=" " * 100_000)
            err, close = _refused(ws)
        assert (err["code"], close) == ("message_too_large", 1009)
    finally:
        srv.stop()


def test_an_idle_session_is_closed_and_a_long_one_outlives_the_header_timeout(tts):
    """--idle-timeout closes a session with nothing to do; the HTTP header timeout (which runs from
    a connection's first byte) does not apply to a WebSocket once it is open."""
    # the sleep below must outlast the header timeout and not the idle one: 2.4 s to spare, so that only a
    # stalled test thread (not a busy machine) could wake up past the idle timeout
    idle_s, header_s, pause_s = 3.0, 0.2, 0.6
    app = create_app(tts, ServingOptions(tts.options, connection_limits=ConnectionLimits(idle_timeout=idle_s)))
    srv = _serve(app, **uvicorn_options(ConnectionLimits(header_timeout=header_s)))
    try:
        with _ws(srv) as ws:
            _send(ws, **CONFIG, response_format="pcm")
            t0 = time.monotonic()
            err, close = _refused(ws)
            assert time.monotonic() - t0 >= 0.9 * idle_s  # not earlier (a slow machine only makes it later)
        assert (err["code"], close) == ("idle_timeout", 1008) and "--idle-timeout" in err["message"]
        with _ws(srv) as ws:
            _send(ws, **CONFIG, response_format="pcm")
            time.sleep(pause_s)  # past the header timeout (3 times it), within the idle timeout
            _send(ws, type="input.text", text="Hi.")
            _send(ws, type="input.done")
            _, audio, _ = _sentence(ws)
            assert audio and _recv(ws)["type"] == "session.done"
    finally:
        srv.stop()


def test_a_client_that_stops_reading_frees_its_slot(tts):
    """--write-timeout: a client that reads nothing while its audio is sent loses its session (the
    sequence and the slot), though its connection is still open. Small socket buffers and a client
    that stops reading after one message make the server's sends block."""
    import socket

    app = create_app(tts, ServingOptions(tts.options, connection_limits=ConnectionLimits(write_timeout=1.0)))
    srv = _serve(app)
    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted connections inherit it
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    scheduler = app.state.server.serving.scheduler
    try:
        with connect(f"ws://127.0.0.1:{srv.port}{PATH}", sock=sock, open_timeout=TIMEOUT, max_size=None,
                     max_queue=1) as ws:
            _send(ws, **CONFIG, response_format="pcm", stream_audio=True)
            _send(ws, type="input.text", text=LONG + " " + LONG + " And")
            _wait(lambda: app.state.server.serving.gate.running == 1, "the session took no slot")
            _wait(lambda: app.state.server.serving.gate.running == 0 and scheduler.stats()["active_sequences"] == 0,
                  "a client that reads nothing kept its slot")
    finally:
        srv.stop()


def test_disconnect_mid_stream_frees_the_sequence(server, tts):
    scheduler = server.app.state.server.serving.scheduler
    tokens_before = scheduler.stats()["tokens"]
    tts.llm.hold_after(60)  # the first chunk needs ~28 tokens; the sentence decodes hundreds
    try:
        with _ws(server) as ws:
            _send(ws, **CONFIG, response_format="pcm", stream_audio=True)
            _send(ws, type="input.text", text=LONG + " And")
            assert _recv(ws)["type"] == "audio.start"
            assert isinstance(_recv(ws), bytes)
            assert scheduler.stats()["active_sequences"] == 1  # held: still decoding
            with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
                assert c.get("/health").json()["requests_running"] == 1
        # the server cancels the sequence when it sees the connection end, before the LLM goes on
        _wait(lambda: all(r.cancelled for r in scheduler._active), "the sequence was not cancelled")
    finally:
        tts.llm.let_go()
    _wait(lambda: scheduler.stats()["active_sequences"] == 0, "the sequence was not released")
    assert scheduler.stats()["tokens"] - tokens_before <= 62, "the cancelled sequence decoded on"
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        _wait(lambda: c.get("/health").json()["requests_running"] == 0, "the session kept its slot")
    assert _http(server, "After the disconnect.", response_format="pcm")  # still serving


def test_a_busy_server_says_so(tts):
    srv = _serve(create_app(tts, ServingOptions(tts.options, max_concurrent=1, max_queue=0)))
    tts.llm.hold_after(0)
    try:
        with _ws(srv) as first, _ws(srv) as second:
            _send(first, **CONFIG, response_format="pcm", stream_audio=True)
            _send(first, type="input.text", text="Hello there. ")
            _wait(lambda: srv.app.state.server.serving.gate.running == 1, "the first session took no slot")
            _send(second, **CONFIG)
            _send(second, type="input.text", text="Me too. ")
            err, close = _refused(second)
            assert (err["code"], close) == ("server_busy", 1013) and "busy" in err["message"]
            tts.llm.let_go()
            _, audio, _ = _sentence(first)
            assert audio
    finally:
        tts.llm.let_go()
        srv.stop()


def test_the_api_key_and_the_origin_check(tts):
    key, allowed = "s3cret", "https://app.example.com"
    srv = _serve(create_app(tts, ServeOptions(ServingOptions(tts.options), api_key=key, allow_origins=(allowed,))))
    auth = {"Authorization": f"Bearer {key}"}
    try:
        for headers, status, code in (({}, 401, "invalid_api_key"),
                                      ({"Authorization": "Bearer wrong"}, 401, "invalid_api_key")):
            with pytest.raises(InvalidStatus) as e:
                _ws(srv, additional_headers=headers)
            assert e.value.response.status_code == status
            assert json.loads(e.value.response.body)["error"]["code"] == code
        with pytest.raises(InvalidStatus) as e:  # a page elsewhere must not use the server through a browser
            _ws(srv, additional_headers=auth, origin="https://evil.example.com")
        assert e.value.response.status_code == 403
        assert json.loads(e.value.response.body)["error"]["code"] == "origin_not_allowed"
        for origin in (None, allowed, srv.url):  # no Origin (not a browser), an allowed one, the server's own
            with _ws(srv, additional_headers=auth, origin=origin) as ws:
                _send(ws, **CONFIG)
                _send(ws, type="session.close")
                with pytest.raises(ConnectionClosed):
                    ws.recv(timeout=TIMEOUT)
                assert ws.close_code == 1000
    finally:
        srv.stop()


# -- the sentence cutting both streamed protocols share ----------------------------------------


def test_take_sentences_resumes_where_it_left_off():
    """Fed piece by piece with ``known``, take_sentences gives what it gives when it scans all the
    text each time (random pieces of text full of end punctuation, quotes and line breaks)."""
    from cosyllama.text.normalize import take_sentences

    rng = random.Random(0)
    alphabet = ["a", "b", " ", ".", "!", "?", ";", ":", '"', "”", "\n", "。", "3", "  "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 8)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        rest_a = rest_b = ""
        got_a, got_b = [], []
        for p in pieces:
            s, new_a = take_sentences(rest_a + p)
            got_a += s
            s, new_b = take_sentences(rest_b + p, known=len(rest_b))
            got_b += s
            assert new_a == new_b, (text, pieces)
            rest_a, rest_b = new_a, new_b
        assert got_a == got_b, (text, pieces)


def test_sentence_stream_bounds():
    from cosyllama.limits import LimitExceeded
    from cosyllama.server.sentences import SentenceStream

    st = SentenceStream(RequestLimits(input_chars=10, session_chars=30))
    assert st.add("Hi. Ho") == ["Hi."] and st.add("! ") == ["Ho!"] and st.add("...") == []
    assert st.finish() == [] and st.n_sentences == 2  # punctuation only: nothing to say
    with pytest.raises(LimitExceeded, match="--max-input-chars"):
        st.add("no end in sight")
    whole = SentenceStream(RequestLimits(input_chars=10), whole=True)
    assert whole.add("A. ") == [] and whole.add("B.") == [] and whole.finish() == ["A. B."]
    with pytest.raises(LimitExceeded, match="--max-session-chars"):
        st2 = SentenceStream(RequestLimits(session_chars=3))
        for _ in range(4):
            st2.add("")

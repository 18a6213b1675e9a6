"""Word times through the server's doors, on loopback: ``POST /dev/captioned_speech`` in Kokoro-FastAPI's
shapes (one JSON object, or NDJSON lines when streamed) and the WebSocket's ``word_timestamps`` option.

The tiny model speaks noise, whose words may or may not align: with the aligner replaced by one that refuses,
these tests check that the doors say why (a segment's ``words_why``, the WebSocket's ``null`` with a reason),
and with one that spaces the words evenly, that the words each door sends are each segment's, placed in the
output, after its audio. The
aligner itself is measured on real speech in tests/test_align.py."""

from __future__ import annotations

import base64
import io
import json

import pytest

from helpers import LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("websockets")
from websockets.sync.client import connect  # noqa: E402

import cosyllama.alignment as alignment  # noqa: E402
from cosyllama.captions import Word  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from server_helpers import voiced_tts  # noqa: E402

TEXT = "Hello there. How are you today, my friend?"
BODY = {"input": TEXT, "voice": "en", "greedy": True, "seed": 1}
TIMEOUT = 120


@pytest.fixture(scope="module")
def server():
    srv = LoopbackServer(create_app(voiced_tts(gated=False)))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def _even(audio, sample_rate, text, language=None, **kw):
    """An aligner that spaces the words of ``text`` evenly over ``audio``."""
    words, n = text.split(), len(audio) / sample_rate
    return alignment.Alignment(tuple(Word(w, round(i * n / len(words), 3), round((i + 1) * n / len(words), 3))
                                     for i, w in enumerate(words)), language or "en", 0.0)


@pytest.fixture
def even_words(monkeypatch):
    monkeypatch.setattr(alignment, "align", _even)


@pytest.fixture
def no_words(monkeypatch):
    """An aligner that always refuses, as it does for a text that does not match (the tiny model speaks noise,
    which may or may not align to a short text, depending on the CPU's arithmetic)."""

    def refuse(*args, **kwargs):
        raise alignment.AlignError("the text does not match the audio (a stand-in aligner)")

    monkeypatch.setattr(alignment, "align", refuse)


def _lines(client, **fields) -> list[dict]:
    with client.stream("POST", "/dev/captioned_speech", json={**BODY, **fields}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in r.iter_lines() if line]


def test_the_whole_answer_carries_the_file_its_words_and_its_captions(client, even_words):
    import soundfile as sf

    r = client.post("/dev/captioned_speech", json={**BODY, "stream": False, "response_format": "wav"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    d = r.json()
    assert d["audio_format"] == "audio/wav" and set(d) == {"audio", "audio_format", "timestamps", "segments", "srt",
                                                           "vtt"}
    audio, rate = sf.read(io.BytesIO(base64.b64decode(d["audio"])), dtype="int16")
    plain = client.post("/v1/audio/speech", json={**BODY, "response_format": "wav"}).content
    assert base64.b64decode(d["audio"]) == plain  # the same bytes as without word times
    segs = d["segments"]
    assert segs[-1]["end_sample"] == audio.size and [w["word"] for w in d["timestamps"]] == TEXT.split()
    for seg in segs:
        assert seg["words"] and seg["start"] <= seg["words"][0]["start"] and seg["words"][-1]["end"] <= seg["end"]
    assert d["timestamps"][0] == {"word": "Hello", "start_time": segs[0]["words"][0]["start"],
                                  "end_time": segs[0]["words"][0]["end"]}
    assert d["srt"].startswith("1\n00:00:00,000 --> ") and d["vtt"].startswith("WEBVTT")


def test_streamed_lines_send_each_segments_words_after_its_audio(client, even_words):
    lines = _lines(client, response_format="pcm")
    audio = b"".join(base64.b64decode(x["audio"]) for x in lines)
    with client.stream("POST", "/v1/audio/speech", json={**BODY, "response_format": "pcm", "stream": True}) as r:
        assert audio == r.read()  # the same stream as /v1/audio/speech's
    words = [i for i, x in enumerate(lines) if x["timestamps"]]
    assert words and all(lines[i]["audio"] == "" and "segment" in lines[i] for i in words)
    assert lines[0]["audio"] and not lines[0]["timestamps"]  # audio first, its words after it
    samples = 0
    for x in lines:
        samples += len(base64.b64decode(x["audio"])) // 2
        if x["timestamps"]:
            seg = x["segment"]
            assert seg["end_sample"] == samples  # a segment's words come once all its audio has been sent
            assert x["timestamps"][-1]["end_time"] <= seg["end"]
    assert [w["word"] for i in words for w in lines[i]["timestamps"]] == TEXT.split()


def test_without_return_timestamps_nothing_is_aligned(client, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("aligned")

    monkeypatch.setattr(alignment, "align", refuse)
    d = client.post("/dev/captioned_speech", json={**BODY, "stream": False, "return_timestamps": False}).json()
    assert d["timestamps"] is None and all(s["words"] is None for s in d["segments"])


def test_words_that_do_not_align_are_said_not_guessed(client, no_words):
    d = client.post("/dev/captioned_speech", json={**BODY, "stream": False}).json()
    assert d["timestamps"] == [] and d["segments"]
    assert all(s["words"] is None and s["words_why"] for s in d["segments"])
    lines = _lines(client, response_format="pcm")
    said = [x for x in lines if "segment" in x]
    assert said and all(x["timestamps"] == [] and x["segment"]["words_why"] for x in said)


@pytest.mark.parametrize("fields,param", [
    ({"volume_multiplier": 2.0}, "volume_multiplier"),
    ({"return_download_link": True}, "return_download_link"),
    ({"stream_format": "sse"}, "stream_format"),
    ({"lang_code": "../../etc"}, "lang_code"),
    ({"return_timestamps": "yes"}, "return_timestamps"),
    ({"input": "x" * 100_000}, "input"),
])
def test_bad_requests_are_refused_naming_the_field(client, fields, param):
    r = client.post("/dev/captioned_speech", json={**BODY, **fields})
    assert r.status_code in (413, 422), r.text
    err = r.json()["error"]
    assert err["param"] == param and "/" not in err["message"].replace("/dev/captioned_speech", "")


def test_kokoros_fields_are_taken(client, even_words):
    d = client.post("/dev/captioned_speech", json={**BODY, "stream": False, "lang_code": "a", "model": "kokoro",
                                                   "normalization_options": {"normalize": True}}).json()
    assert [w["word"] for w in d["timestamps"]] == TEXT.split()


# -- the WebSocket ----------------------------------------------------------------------------------------------


def _ws_sentence(ws) -> tuple[bytes, dict]:
    start = json.loads(ws.recv(timeout=TIMEOUT))
    assert start["type"] == "audio.start"
    audio = b""
    while isinstance(m := ws.recv(timeout=TIMEOUT), bytes):
        audio += m
    assert json.loads(m)["type"] == "audio.done"
    words = json.loads(ws.recv(timeout=TIMEOUT))
    assert words["type"] == "word_timestamps"
    assert (words["utterance_index"], words["sentence_index"]) == (start["utterance_index"], start["sentence_index"])
    return audio, words


def _ws_run(server, text: str, **config) -> list[tuple[bytes, dict]]:
    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", open_timeout=TIMEOUT,
                 max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "en", "greedy": True, "seed": 1,
                            "response_format": "pcm", "word_timestamps": True, **config}))
        ws.send(json.dumps({"type": "input.text", "text": text}))
        ws.send(json.dumps({"type": "input.done"}))
        out = [_ws_sentence(ws) for _ in range(len([c for c in text if c in ".?!"]))]
        assert json.loads(ws.recv(timeout=TIMEOUT))["type"] == "session.done"
        return out


def test_the_websocket_sends_each_sentences_words_after_its_audio(server, even_words):
    out = _ws_run(server, TEXT, stream_audio=True)
    assert [w["word"] for _, m in out for w in m["word_timestamps"]] == TEXT.split()
    for audio, m in out:
        ms = 1000 * len(audio) / 2 / 24000
        assert m["word_timestamps"][0]["start_ms"] == 0 and abs(m["word_timestamps"][-1]["end_ms"] - ms) <= 1


def test_the_websocket_says_null_with_the_reason_when_words_do_not_align(server, no_words):
    out = _ws_run(server, "Hello there.")
    assert out[0][1]["word_timestamps"] is None and "does not match" in out[0][1]["reason"]


def test_the_websocket_sends_no_words_unless_asked(server):
    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", open_timeout=TIMEOUT) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "en", "greedy": True, "response_format": "pcm"}))
        ws.send(json.dumps({"type": "input.text", "text": "Hello there."}))
        ws.send(json.dumps({"type": "input.done"}))
        kinds = []
        while (m := ws.recv(timeout=TIMEOUT)) is not None:
            if isinstance(m, str):
                kinds.append(json.loads(m)["type"])
                if kinds[-1] == "session.done":
                    break
        assert kinds == ["audio.start", "audio.done", "session.done"]


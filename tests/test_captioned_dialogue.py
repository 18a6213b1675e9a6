"""``POST /dev/captioned_dialogue`` on loopback: a dialogue's audio with its captions in ``/dev/captioned_speech``'s
shapes, each segment naming its speaker (JSON ``voice``, WebVTT ``<v en>``, SRT ``[en]``); its audio is
``/v1/audio/dialogue``'s, byte for byte. The aligner is replaced by one that spaces the words evenly (the tiny
model speaks noise; the aligner is measured on real speech in tests/test_align.py)."""

from __future__ import annotations

import base64
import json

import pytest

from helpers import LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import cosyllama.alignment as alignment  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from server_helpers import voiced_tts  # noqa: E402
from test_captioned_speech import _even  # noqa: E402

TURNS = [{"voice": "en", "text": "Good morning, how are you?"}, {"voice": "bare", "text": "Fine, thank you."}]
BODY = {"turns": TURNS, "pause_between_turns": 0.3, "greedy": True, "seed": 3}
TIMEOUT = 120


@pytest.fixture(scope="module")
def server():
    srv = LoopbackServer(create_app(voiced_tts("bare", gated=False)))
    yield srv
    srv.stop()


@pytest.fixture
def client(server, monkeypatch):
    monkeypatch.setattr(alignment, "align", _even)
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def test_the_whole_answer_names_each_speaker(client):
    r = client.post("/dev/captioned_dialogue", json={**BODY, "stream": False, "response_format": "wav"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    d = r.json()
    plain = client.post("/v1/audio/dialogue", json={**BODY, "response_format": "wav"})
    assert plain.status_code == 200 and base64.b64decode(d["audio"]) == plain.content  # the dialogue's audio
    assert [s["voice"] for s in d["segments"]] == ["en", "bare"]
    assert [w["word"] for w in d["timestamps"]] == " ".join(t["text"] for t in TURNS).split()
    assert d["segments"][1]["start"] >= d["segments"][0]["end"] + 0.3 - 1e-3  # the pause between the turns
    assert "<v en>" in d["vtt"] and "<v bare>" in d["vtt"] and "[en]" in d["srt"] and "[bare]" in d["srt"]


def test_streamed_lines_carry_each_turns_words_after_its_audio(client):
    with client.stream("POST", "/dev/captioned_dialogue", json={**BODY, "response_format": "pcm"}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    segs = [x["segment"] for x in lines if "segment" in x]
    assert [s["voice"] for s in segs] == ["en", "bare"]
    audio = b"".join(base64.b64decode(x["audio"]) for x in lines)
    with client.stream("POST", "/v1/audio/dialogue", json={**BODY, "response_format": "pcm", "stream": True}) as r:
        assert audio == r.read()


@pytest.mark.parametrize("fields, param", [({"stream_format": "audio"}, "stream_format"),
                                           ({"turns": [{"voice": "nobody", "text": "Hi."}]}, "turns[0].voice"),
                                           ({"volume_multiplier": 2.0}, "volume_multiplier")])
def test_bad_requests_are_refused_naming_the_field(client, fields, param):
    r = client.post("/dev/captioned_dialogue", json={**BODY, **fields})
    assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, r.text

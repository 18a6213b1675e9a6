"""What the HTTP server lets out (loopback, tiny model, PyTorch LLM): error bodies name nothing of the
server, broken voice files are never voices, and what only the API key may see.

* a directory with an empty ``aaa.pt``, a good ``anna.pt`` and a truncated ``trunc.pt``: the
  skipped files are no default voice, not counted (start-up line, ``--max-voices``), a request
  naming one gets the 404 of an unknown voice, ``/health`` without the key says only how many;
* a sweep of many bad requests whose error bodies must name no path, library or exception;
* with an API key the web page loads, and its origin still needs the key;
* the smaller ones: samples far outside [-1, 1], a clip with no signal (silence, a DC offset),
  ``HEAD /v1/voices``, ``voice: ""``, control characters in the text, ids echoed clipped.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from helpers import MODEL_DIR, LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.server.startup import open_voice_store  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import VoiceStore  # noqa: E402
from server_helpers import PROMPT_WAV  # noqa: E402
from server_helpers import broken_voice_dir as _broken_dir  # noqa: E402
from server_helpers import float_wav as _wav  # noqa: E402
from server_helpers import json_error as _error  # noqa: E402

KEY = "leaks-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def vdir(tmp_path_factory, voice):
    return _broken_dir(tmp_path_factory.mktemp("voices6"), voice)


@pytest.fixture(scope="module")
def server(tts, vdir):
    view = TTS.from_models(tts.models, voices=open_voice_store(str(vdir)))
    srv = LoopbackServer(create_app(view, ServeOptions(ServingOptions(view.options), api_key=KEY, max_voices=2)))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        yield c


def _speech() -> np.ndarray:
    return 0.1 * np.sin(np.arange(32_000) / 5.0)


# -- hole 4: broken voice files are never voices -------------------------------------------------


def test_skipped_files_do_not_count_toward_max_voices(client):
    assert [v["id"] for v in client.get("/v1/voices").json()["voices"]] == ["anna"]
    files = {"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")}
    r = client.post("/v1/voices", files=files, data={"id": "bob"})  # 1 voice + bob = 2 = --max-voices
    assert r.status_code == 200, r.text
    try:
        err = _error(client.post("/v1/voices", files=files, data={"id": "carl"}), 409, "holds 2 voices")
        assert err["code"] == "too_many_voices"
    finally:
        assert client.delete("/v1/voices/bob").status_code == 200


def test_a_skipped_voice_gets_the_404_of_an_unknown_one(client, vdir):
    answers = {}
    for vid in ("aaa", "trunc", "nobody"):
        r = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": vid})
        err = _error(r, 404, f"unknown voice '{vid}'")
        assert (err["param"], err["code"], err["type"]) == ("voice", "voice_not_found", "not_found_error")
        answers[vid] = err["message"].replace(repr(vid), "ID")
    assert len(set(answers.values())) == 1, answers  # the same answer: the client learns nothing of the files
    assert "registered voices: anna;" in answers["nobody"]


def test_health_says_how_many_were_skipped_and_which_only_with_the_key(server, vdir):
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        r = anon.get("/health")
        assert r.status_code == 200 and r.json()["voices"] == {"skipped_count": 2}
        assert "aaa" not in r.text and "trunc" not in r.text and "Error" not in r.text
        assert anon.head("/health").status_code == 200
        wrong = anon.get("/health", headers={"Authorization": "Bearer nope"}).json()["voices"]
        assert wrong == {"skipped_count": 2}
        full = anon.get("/health", headers=AUTH).json()["voices"]
    assert full["skipped_count"] == 2 and [s["file"] for s in full["skipped"]] == ["aaa.pt", "trunc.pt"]
    for s in full["skipped"]:
        assert s["error"].startswith("not a voice file") and str(vdir) not in s["error"] and "\n" not in s["error"]
        assert len(s["error"]) <= 200


# -- hole 5: error bodies name nothing of the server ---------------------------------------------

_LEAKS = [re.compile(p) for p in (
    r"/tmp", r"/home", r"/usr", r"/work", r"site-packages", r"\.py\b", r"[Tt]orch", r"Traceback", r"unpickl",
    r"Weights only", r"wetext", r"soundfile|libsndfile", r"onnx", r"pydantic", r"starlette|fastapi|uvicorn",
    r"\b[A-Z][A-Za-z]*(Error|Exception)\b",  # an exception class: EOFError, UnpicklingError, AttributeError
)]


def _bad_requests(c, vdir):
    """(what, response) of many requests a client can get wrong."""
    speak = {"input": "Hello there.", "voice": "anna"}
    post = lambda body: c.post("/v1/audio/speech", content=json.dumps(body),  # noqa: E731 (\ud800 as is)
                               headers={"Content-Type": "application/json"})
    files = lambda data: {"audio": ("p.wav", data, "audio/wav")}  # noqa: E731
    yield "skipped voice", post({**speak, "voice": "aaa"})
    yield "truncated voice", post({**speak, "voice": "trunc"})
    yield "unknown voice", post({**speak, "voice": "nobody"})
    yield "empty voice", post({**speak, "voice": ""})
    yield "long voice", post({**speak, "voice": "x" * 10_000})
    yield "path voice", post({**speak, "voice": "../../etc/passwd"})
    yield "control char", post({**speak, "input": "Hi\x07 there"})
    yield "lone surrogate", post({**speak, "input": "Hi \ud800 there"})
    yield "symbols", post({**speak, "input": "10¢ 20¢ ¢¢¢ 5¢"})
    yield "empty input", post({**speak, "input": " "})
    yield "no input", post({"voice": "anna"})
    yield "input type", post({**speak, "input": 5})
    yield "format", post({**speak, "response_format": "aiff"})
    yield "speed", post({**speak, "speed": 99})
    yield "mode", post({**speak, "mode": "vc"})
    yield "instructions", post({**speak, "mode": "instruct"})
    yield "extra", post({**speak, "bogus": 1})
    yield "long extra", post({**speak, "k" * 10_000: 1})
    yield "many extras", post({**speak, **{f"field{i}": i for i in range(500)}})
    yield "bad json", c.post("/v1/audio/speech", content=b"{nope", headers={"Content-Type": "application/json"})
    yield "not json", c.post("/v1/audio/speech", content=b"\xff\xfe", headers={"Content-Type": "text/plain"})
    yield "garbage audio", c.post("/v1/voices", files=files(b"RIFF\x00\x00garbage" * 10), data={"id": "g"})
    yield "empty audio", c.post("/v1/voices", files=files(b""), data={"id": "g"})
    yield "huge audio", c.post("/v1/voices", files=files(_wav(1e17 * _speech())), data={"id": "g"})
    yield "dc audio", c.post("/v1/voices", files=files(_wav(np.full(32_000, 0.5))), data={"id": "g"})
    yield "nan audio", c.post("/v1/voices", files=files(_wav(np.full(32_000, np.nan))), data={"id": "g"})
    yield "long id", c.post("/v1/voices", files=files(PROMPT_WAV.read_bytes()), data={"id": "y" * 10_000})
    yield "path id", c.post("/v1/voices", files=files(PROMPT_WAV.read_bytes()), data={"id": "../x"})
    yield "no audio", c.post("/v1/voices", data={"id": "g"})
    yield "bad transcript", c.post("/v1/voices", files=files(PROMPT_WAV.read_bytes()), data={"text": "a\x00b"})
    yield "delete long", c.delete("/v1/voices/" + "z" * 10_000)
    yield "delete unknown", c.delete("/v1/voices/nobody")
    yield "delete path", c.delete("/v1/voices/..%2F..%2Fetc")
    yield "not found", c.get("/nothing/here")
    yield "method", c.put("/v1/voices")
    yield "wrong key", c.get("/v1/voices", headers={"Authorization": "Bearer wrong"})


def test_error_bodies_name_no_path_library_or_exception(client, vdir):
    seen = 0
    for what, r in _bad_requests(client, vdir):
        if r.status_code < 400:
            continue
        seen += 1
        body = r.text
        for pat in _LEAKS:
            assert not pat.search(body), f"{what}: {r.status_code} {body[:500]}"
        assert str(vdir) not in body and str(MODEL_DIR) not in body, what
        assert len(body) < 1200, f"{what}: the body grows with the request ({len(body)} bytes)"
        if r.headers.get("content-type", "").startswith("application/json"):
            err = r.json()["error"]
            assert err["message"] and err["type"], what
    assert seen >= 30


def test_an_internal_error_says_nothing_of_it(tts, vdir, monkeypatch):
    from fastapi.testclient import TestClient

    view = TTS.from_models(tts.models, voices=open_voice_store(str(vdir)))

    def boom(*a, **kw):
        raise RuntimeError(f"secret detail at {MODEL_DIR}/llm.pt")

    monkeypatch.setattr(type(view), "run", boom)  # every door synthesizes through TTS.run
    with TestClient(create_app(view), raise_server_exceptions=False) as c:
        err = _error(c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "anna"}), 500, "server's log")
    assert "secret" not in err["message"] and "RuntimeError" not in err["message"]


def test_ids_are_echoed_clipped_and_lists_are_shared():
    from cosyllama.voices import show_id, unknown_voice

    long = "q" * 10_000
    assert show_id(long) == repr("q" * 64) + "... (10000 characters)"
    assert show_id("anna") == "'anna'" and show_id(5) == "of type int"
    msg = unknown_voice(long, [f"v{i}" for i in range(12)], more=" (describe lists them)")
    assert msg == (f"unknown voice {show_id(long)}; registered voices: v0, v1, v2, v3, v4 and 7 more "
                   "(describe lists them)")


# -- the smaller ones ---------------------------------------------------------------------------


def test_samples_far_outside_the_range_are_refused(client):
    files = {"audio": ("h.wav", _wav(1e18 * _speech()), "audio/wav")}  # peak 1e17
    _error(client.post("/v1/voices", files=files, data={"id": "huge"}), 400, "far outside [-1, 1] (peak 1e+17")
    louder = {"audio": ("l.wav", _wav(np.clip(15 * _speech(), -1.4, 1.4)), "audio/wav")}  # a clipped float export
    r = client.post("/v1/voices", files=louder, data={"id": "loud"})
    assert r.status_code == 200, r.text
    assert client.delete("/v1/voices/loud").status_code == 200


@pytest.mark.parametrize("samples, kind", [
    (np.full(32_000, 0.5), "constant"), (np.full(32_000, -0.02), "constant"), (np.zeros(32_000), "silent"),
    (0.5 + 1e-4 * np.sin(np.arange(32_000) / 5.0), "constant")])
def test_a_clip_with_no_signal_is_refused(client, samples, kind):
    files = {"audio": ("dc.wav", _wav(samples), "audio/wav")}
    err = _error(client.post("/v1/voices", files=files, data={"id": "dc"}), 400, "has no signal")
    assert kind in err["message"] and "-60 dBFS" in err["message"]
    assert "dc" not in [v["id"] for v in client.get("/v1/voices").json()["voices"]]


def test_head_voices_is_get_without_a_body(client):
    r = client.head("/v1/voices")
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-type"] == "application/json"


def test_an_empty_voice_is_a_422(client):
    for v in ("", "  "):
        err = _error(client.post("/v1/audio/speech", json={"input": "Hi.", "voice": v}), 422, "voice is empty")
        assert (err["param"], err["code"]) == ("voice", "empty_string")


@pytest.mark.parametrize("text, needle", [
    ("Hello\x07 there", "control character (U+0007) at character 5"),
    ("Hi \x1b[31m", "control character (U+001B) at character 3"),
    ("Hi \ud800 there", "lone surrogate (U+D800) at character 3"),
    ("\x00", "control character (U+0000) at character 0")])
def test_bad_characters_in_the_text_are_named(client, text, needle):
    body = json.dumps({"input": text, "voice": "anna"})  # ensure_ascii: a lone surrogate travels as \ud800
    r = client.post("/v1/audio/speech", content=body, headers={"Content-Type": "application/json"})
    err = _error(r, 422, needle)
    assert (err["param"], err["code"]) == ("input", "invalid_characters")
    assert "symbols" not in err["message"]
    err = _error(client.post("/v1/audio/speech", content=json.dumps({"input": "Hi.", "voice": "anna",
                                                                      "instructions": text}),
                             headers={"Content-Type": "application/json"}), 422, needle)
    assert err["param"] == "instructions"


def test_tabs_and_newlines_are_text(client):
    r = client.post("/v1/audio/speech", json={"input": "Hello\tthere.\r\nHow are you?", "voice": "anna",
                                              "greedy": True})
    assert r.status_code == 200, r.text


def test_an_echoed_id_is_clipped(client):
    for r in (client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "x" * 10_000}),
              client.post("/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                          data={"id": "x" * 10_000}),
              client.delete("/v1/voices/" + "x" * 10_000)):
        msg = r.json()["error"]["message"]
        assert "x" * 64 in msg and "x" * 65 not in msg and "(10000 characters)" in msg, (r.status_code, msg)


def test_with_an_api_key_the_page_loads_and_its_origin_needs_the_key(tts, voice):
    from fastapi.testclient import TestClient

    view = TTS.from_models(tts.models, voices=VoiceStore())
    view.voices.add("en", voice)
    with TestClient(create_app(view, ServeOptions(ServingOptions(view.options), api_key=KEY)),
                    base_url="http://tts.example") as c:
        page = c.get("/")
        assert page.status_code == 200 and "<html" in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert c.get("/ui/app.js").status_code == 200 and c.get("/ui/style.css").status_code == 200
        same = {"Origin": "http://tts.example"}
        _error(c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en"}, headers=same), 401)
        r = c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en"},
                   headers={**same, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200

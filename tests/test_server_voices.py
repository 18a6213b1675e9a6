"""The server's voices and who may change them, on loopback with the tiny model (PyTorch LLM):
`cosyllama serve --voices DIR` replicas share registrations and keep them through kill -9; 409 on
an existing id unless replace=true; cross-origin POST/DELETE refused; the API key, also through
the `openai` SDK; unusable audio and oversized transcripts refused with readable messages; every
voice the frontend makes is finite; bad files in a voice directory are skipped at start and said;
an unknown voice's message names a few voices and counts the rest."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from helpers import MODEL_DIR

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.limits import RequestLimits  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.server.startup import open_voice_store  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voice_directory import VoiceDirectory  # noqa: E402
from cosyllama.voices import VoiceStore  # noqa: E402
from helpers import LoopbackServer  # noqa: E402
from server_helpers import PROMPT_WAV  # noqa: E402
from server_helpers import broken_voice_dir as _broken_dir  # noqa: E402
from server_helpers import float_wav as _float_wav  # noqa: E402
from server_helpers import json_error as _error  # noqa: E402

KEY = "test-key-0123456789"
GOOD_ORIGIN = "http://app.example:3000"
SRC = str(Path(__import__("cosyllama").__file__).resolve().parents[1])


def _files(data: bytes | None = None, name: str = "p.wav"):
    return {"audio": (name, PROMPT_WAV.read_bytes() if data is None else data, "audio/wav")}


def _ids(client, **kw) -> list[str]:
    r = client.get("/v1/voices", **kw)
    assert r.status_code == 200, r.text
    return [v["id"] for v in r.json()["voices"]]


def _speak(client, voice: str, **kw):
    body = {"input": "Hello there.", "voice": voice, "greedy": True, "response_format": "wav"}
    return client.post("/v1/audio/speech", json=body, **kw)


# ----------------------------------------------------------------------------------------------
# Real `cosyllama serve` processes sharing one voice directory


class ServeProcess:
    """`python -m cosyllama.cli serve` on a free loopback port, with this checkout's package."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        env.pop("COSYLLAMA_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cosyllama.cli", "serve", "--model-dir", str(MODEL_DIR), "--port", "0",
             "--threads", "1", "--precision", "fp32", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 120) -> ServeProcess:
        assert self._ready.wait(timeout) and self.url, "server did not start:\n" + "".join(self.log[-30:])
        return self

    def client(self):
        return httpx.Client(base_url=self.url, timeout=60)

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()


def test_replicas_share_a_voice_directory_and_survive_kill_9(tmp_path):
    """Two `cosyllama serve --voices DIR` behind an imaginary load balancer: a voice registered,
    replaced or deleted through one is seen by the other; after kill -9 and a restart the
    voices are there (and the deleted one is not), and speak."""
    vdir = tmp_path / "voices"
    a, b = ServeProcess("--voices", str(vdir)), ServeProcess("--voices", str(vdir))
    a2 = None
    try:
        a.wait_ready(), b.wait_ready()
        with a.client() as ca, b.client() as cb:
            r = ca.post("/v1/voices", files=_files(), data={"id": "anna", "text": "Hello, this is my voice."})
            assert r.status_code == 200, r.text
            assert _ids(cb) == ["anna"]
            spoken = _speak(cb, "anna")
            assert spoken.status_code == 200 and spoken.content[:4] == b"RIFF"
            _error(cb.post("/v1/voices", files=_files(), data={"id": "anna"}), 409, "replace=true")
            r = cb.post("/v1/voices", files=_files(), data={"id": "anna", "replace": "true"})  # no transcript now
            assert r.status_code == 200, r.text
            assert ca.get("/v1/voices").json()["voices"][0]["has_transcript"] is False  # a sees b's replacement
            assert ca.post("/v1/voices", files=_files(), data={"id": "bob"}).status_code == 200
            assert _speak(cb, "bob").status_code == 200
            assert cb.delete("/v1/voices/bob").json() == {"id": "bob", "deleted": True}
            _error(_speak(ca, "bob"), 404, "bob")  # a had bob cached; the file is gone
            assert _ids(ca) == ["anna"]
            assert ca.post("/v1/voices", files=_files(), data={"id": "carl", "text": "Hi."}).status_code == 200
        a.kill9()  # right after the answer: what was acknowledged must be on disk
        assert sorted(p.name for p in vdir.iterdir()) == ["anna.pt", "carl.pt"]  # no temporary file left
        a2 = ServeProcess("--voices", str(vdir)).wait_ready()
        with a2.client() as c:
            voices = {v["id"]: v for v in c.get("/v1/voices").json()["voices"]}
            assert sorted(voices) == ["anna", "carl"]
            assert voices["carl"]["has_transcript"] and not voices["anna"]["has_transcript"]
            for vid in ("anna", "carl"):
                r = _speak(c, vid)
                assert r.status_code == 200 and len(r.content) > 44
    finally:
        for s in (a, b, a2):
            if s is not None:
                s.stop()


# ----------------------------------------------------------------------------------------------
# One in-process server with an API key and one allowed origin


@pytest.fixture(scope="module")
def server(tts, tmp_path_factory):
    view = TTS.from_models(tts.models, voices=VoiceDirectory(tmp_path_factory.mktemp("voices")))
    options = ServingOptions(view.options, limits=RequestLimits(transcript_chars=200))
    srv = LoopbackServer(create_app(view, ServeOptions(options, api_key=KEY, allow_origins=(GOOD_ORIGIN,))))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_api_key(server, client):
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        err = _error(anon.get("/v1/voices"), 401, "Authorization: Bearer")
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
        assert anon.get("/v1/voices").headers["www-authenticate"] == "Bearer"
        _error(anon.get("/v1/voices", headers={"Authorization": "Bearer wrong"}), 401, "incorrect API key")
        _error(anon.get("/v1/voices", headers={"Authorization": f"Basic {KEY}"}), 401)
        _error(anon.get("/v1/voices", headers={"Authorization": f"Bearer {KEY}x"}), 401)
        _error(anon.post("/v1/voices", files=_files(), data={"id": "sneaky"}), 401)
        _error(anon.get("/openapi.json"), 401)
        assert anon.get("/health").json()["status"] == "ok"  # load balancers probe it without a key
    assert client.get("/v1/voices").status_code == 200
    assert "sneaky" not in _ids(client)


def test_openai_sdk_with_api_key(server, client):
    openai = pytest.importorskip("openai")
    assert client.post("/v1/voices", files=_files(), data={"id": "sdk", "text": "Hello, this is my voice.",
                                                           "replace": "true"}).status_code == 200
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    audio = sdk.audio.speech.create(model="cosyvoice3", voice="sdk", input="Hello there.", response_format="wav")
    samples, sr = sf.read(io.BytesIO(audio.content), dtype="int16")
    assert sr == 24_000 and samples.size > 0
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.audio.speech.create(model="cosyvoice3", voice="sdk", input="Hello there.")


def test_cross_origin_changes_refused(server, client):
    evil = {"Origin": "http://evil.example"}
    err = _error(client.post("/v1/voices", files=_files(), data={"id": "en"}, headers=evil), 403, "evil.example")
    assert err["type"] == "permission_error" and GOOD_ORIGIN in err["message"]
    assert "en" not in _ids(client)
    _error(client.post("/v1/voices", files=_files(), data={"id": "en"}, headers={"Origin": "null"}), 403)
    _error(_speak(client, "en", headers=evil), 403)
    r = client.post("/v1/voices", files=_files(), data={"id": "en", "text": "Hi."}, headers={"Origin": GOOD_ORIGIN})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == GOOD_ORIGIN
    _error(client.delete("/v1/voices/en", headers=evil), 403)
    assert client.get("/v1/voices", headers=evil).status_code == 200  # reading is not a change
    # a web app at the allowed origin gets its CORS preflight (which carries no key) answered; another does not
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    with httpx.Client(base_url=server.url, timeout=60) as browser:
        ok = browser.options("/v1/audio/speech", headers={"Origin": GOOD_ORIGIN, **pre})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == GOOD_ORIGIN
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        assert browser.options("/v1/audio/speech", headers={**evil, **pre}).status_code == 400
    assert client.delete("/v1/voices/en").status_code == 200  # no Origin: curl, SDKs


def test_existing_id_needs_replace(client):
    assert client.post("/v1/voices", files=_files(), data={"id": "twice", "text": "Hi."}).status_code == 200
    err = _error(client.post("/v1/voices", files=_files(), data={"id": "twice"}), 409, "'twice' exists")
    assert err["type"] == "conflict_error"
    assert client.get("/v1/voices").json()["voices"][[*_ids(client)].index("twice")]["has_transcript"]
    r = client.post("/v1/voices", files=_files(), data={"id": "twice", "replace": "true"})
    assert r.status_code == 200 and r.json() == {"id": "twice"}
    voices = {v["id"]: v for v in client.get("/v1/voices").json()["voices"]}
    assert voices["twice"]["has_transcript"] is False
    assert client.delete("/v1/voices/twice").status_code == 200


@pytest.mark.parametrize("bad", [".", "..", ".hidden", "a/b", "../x", "a b", "x" * 65])
def test_reserved_ids_refused(client, bad):
    _error(client.post("/v1/voices", files=_files(), data={"id": bad}), 422, "not allowed")


def test_reserved_ids_refused_on_delete(client):
    _error(client.delete("/v1/voices/%2E%2E"), 422, "not allowed")
    _error(client.delete("/v1/voices/.hidden"), 422, "not allowed")
    _error(client.delete("/v1/voices/nobody"), 404, "nobody")


def test_unusable_audio_and_transcripts_refused(client):
    speech = 0.1 * np.sin(np.arange(32_000) / 5.0)
    nan = speech.copy()
    nan[1000] = np.nan
    _error(client.post("/v1/voices", files=_files(_float_wav(nan)), data={"id": "nan"}), 400,
           "prompt audio holds samples that are not finite numbers (NaN or infinity: 1 of 32000)")
    inf = speech.copy()
    inf[5] = np.inf
    _error(client.post("/v1/voices", files=_files(_float_wav(inf)), data={"id": "inf"}), 400, "not finite")
    err = _error(client.post("/v1/voices", files=_files(b"just some text, renamed", "notes.wav"), data={"id": "txt"}),
                 400, "prompt audio is not a readable audio file (Format not recognised); give a wav")
    assert "0x" not in err["message"] and "<" not in err["message"]
    _error(client.post("/v1/voices", files=_files(_float_wav(speech[:800])), data={"id": "short"}), 400, "too short")
    _error(client.post("/v1/voices", files=_files(b""), data={"id": "empty"}), 400, "empty")
    err = _error(client.post("/v1/voices", files=_files(), data={"id": "long", "text": "x" * 201}), 413,
                 "transcript is too long: 201 characters, at most 200 allowed (--max-transcript-chars)")
    assert (err["type"], err["param"], err["code"]) == ("request_too_large", "text", "string_above_max_length")
    _error(client.post("/v1/voices", files=_files(), data={"id": "toks", "text": "\U0001F600" * 190}), 413,
           "760 text tokens as the LLM sees them, at most 512 allowed (--max-transcript-tokens)")
    assert not {"nan", "inf", "txt", "short", "empty", "long", "toks"} & set(_ids(client))
    assert client.post("/v1/voices", files=_files(_float_wav(speech)), data={"id": "fine", "replace": "true"}
                       ).status_code == 200  # the same clip, finite
    assert _speak(client, "fine").status_code == 200


def test_a_voice_file_is_served_read_only(tts, tmp_path):
    """`--voices FILE`: its voices speak; POST and DELETE get 403 pointing at --voices DIR."""
    from fastapi.testclient import TestClient

    from cosyllama.server.startup import open_voice_store

    bundle = VoiceStore()
    bundle.add("en", tts.make_voice(PROMPT_WAV, "Hello, this is my voice."))
    bundle.save(tmp_path / "voices.pt")
    view = TTS.from_models(tts.models, voices=open_voice_store(str(tmp_path / "voices.pt")))
    with TestClient(create_app(view)) as c:
        assert _ids(c) == ["en"]
        assert _speak(c, "en").status_code == 200
        err = _error(c.post("/v1/voices", files=_files(), data={"id": "new"}), 403, "--voices DIR")
        assert err["type"] == "permission_error"
        _error(c.delete("/v1/voices/en"), 403, "read-only")
        assert _ids(c) == ["en"]
    from cosyllama.errors import InputError

    with pytest.raises(InputError, match="voice file .*nothere.pt' does not exist"):
        open_voice_store(str(tmp_path / "nothere.pt"))


def test_every_voice_the_frontend_makes_is_finite(tts):
    """The same check in the Python API: no voice with NaN features is ever made."""
    from cosyllama.errors import InputError

    with pytest.raises(InputError, match=r"far outside \[-1, 1\]"):
        tts.make_voice(io.BytesIO(_float_wav(1e20 * np.sin(np.arange(32_000) / 5.0))))


def test_a_bad_voice_file_is_skipped_at_start_and_reported(tts, voice, tmp_path, caplog):
    from fastapi.testclient import TestClient

    from cosyllama.server.startup import open_voice_store

    VoiceDirectory(tmp_path).add("good", voice)
    good = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "cut.pt").write_bytes(good[: len(good) // 2])
    with caplog.at_level(logging.WARNING, logger="cosyllama.voices"):
        store = open_voice_store(str(tmp_path))  # `serve --voices DIR` at start: no error
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "empty.pt" in warned and "cut.pt" in warned and "not a voice file" in warned
    assert sorted(store.skipped) == ["cut.pt", "empty.pt"]
    view = TTS.from_models(tts.models, voices=store)
    with TestClient(create_app(view)) as c:  # no API key: /health has the details
        voices = c.get("/health").json()["voices"]
        assert voices["skipped_count"] == 2
        assert [s["file"] for s in voices["skipped"]] == ["cut.pt", "empty.pt"]
        assert all(s["error"].startswith("not a voice file") for s in voices["skipped"])
        assert [v["id"] for v in c.get("/v1/voices").json()["voices"]] == ["good"]
        assert c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "good"}).status_code == 200
        (tmp_path / "cut.pt").unlink()  # the operator removes it: no longer reported
        assert c.get("/health").json()["voices"] == {"skipped_count": 1, "skipped": [voices["skipped"][1]]}


def test_unknown_voice_names_a_few_and_counts_the_rest(tts, voice):
    from fastapi.testclient import TestClient

    from cosyllama.errors import InputError

    store = VoiceStore()
    for i in range(12):
        store.add(f"voice{i:02d}", voice)
    view = TTS.from_models(tts.models, voices=store)
    with TestClient(create_app(view)) as c:
        err = _error(c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "nobody"}), 404, "nobody")
        assert "voice00, voice01, voice02, voice03, voice04 and 7 more" in err["message"]
        assert "voice05" not in err["message"]
    with pytest.raises(InputError, match="and 7 more"):
        store.get("nobody")


def test_skipped_files_are_no_voices(tts, voice, tmp_path, caplog):
    """The store and the start-up line: skipped files are not counted, never the default."""
    from cosyllama.server.wyoming import WyomingService
    from server_helpers import serving_of

    _broken_dir(tmp_path, voice)
    with caplog.at_level(logging.WARNING, logger="cosyllama.voices"):
        store = open_voice_store(str(tmp_path))
    found = [r.getMessage() for r in caplog.records if r.name == "cosyllama.voices"]
    assert len(found) == 2 and all(f.startswith("voices: skipped, not served: ") for f in found)
    assert f"{tmp_path / 'aaa.pt'}: not a voice file (EOFError" in found[0]  # the log has path and reason
    assert store.ids() == ["anna"] and len(store) == 1
    assert sorted(store.skipped) == ["aaa.pt", "trunc.pt"]
    assert "aaa" not in store and "trunc" not in store
    view = TTS.from_models(tts.models, voices=store)
    with caplog.at_level(logging.WARNING, logger="cosyllama.server"):
        serving = serving_of(view)
    try:
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "cosyllama.server" and r.getMessage().startswith("voices:")]
        assert lines == [f"voices: 1 in the directory {tmp_path}, where registrations are kept; "
                         "2 skipped: aaa.pt, trunc.pt"]
        # Wyoming's default voice (a request naming none) is the first voice that can be served
        service = WyomingService(serving)
        name, features = service.voice(None)
        assert name == "anna" and features is not None
        assert [v.name for v in service.info().tts[0].voices] == ["default", "anna"]
    finally:
        serving.close()

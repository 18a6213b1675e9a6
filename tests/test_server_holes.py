"""What an attacker found open on the server (loopback, tiny model, PyTorch LLM), each closed:
finite but huge samples, a bad file in a shared voice directory (slow clients: test_server_conn.py),
and the smaller ones (the field an empty text names, HEAD /health, unknown-voice messages that grow with the
store, no bound on the voices, a huge chunked body); and the same-origin rule the web page and
/docs rely on."""

from __future__ import annotations

import copy
import io
import logging

import numpy as np
import pytest
import soundfile as sf

from helpers import FIXTURES, MODEL_DIR, LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.voices import VoiceDirectory, VoiceStore  # noqa: E402

PROMPT_WAV = FIXTURES / "wavs" / "prompt_en_16k.wav"
KEY = "holes-key-0123456789"




@pytest.fixture(scope="module")
def tts():
    from cosyllama.tts import TTS

    return TTS(MODEL_DIR, threads=1, precision="fp32")


@pytest.fixture(scope="module")
def voice(tts):
    return tts.make_voice(PROMPT_WAV, "Hello, this is my voice.")


@pytest.fixture(scope="module")
def server(tts, voice):
    view = copy.copy(tts)
    view.voices = VoiceStore()
    view.voices.add("en", voice)
    srv = LoopbackServer(create_app(view, max_prompt_bytes=1_000_000, max_voices=4))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _error(r, status: int, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert contains in err["message"], err
    return err


def _float_wav(samples) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, np.float32), 16_000, format="WAV", subtype="FLOAT")
    return buf.getvalue()


# -- 1. finite but huge samples ------------------------------------------------------------------


def test_huge_finite_samples_are_refused_naming_the_problem(client):
    speech = np.sin(np.arange(32_000) / 5.0)
    err = _error(client.post("/v1/voices", files={"audio": ("h.wav", _float_wav(1e20 * speech), "audio/wav")},
                             data={"id": "huge"}), 400, "far outside [-1, 1]")
    assert "1e+20" in err["message"]
    assert "huge" not in [v["id"] for v in client.get("/v1/voices").json()["voices"]]


def test_every_voice_the_frontend_makes_is_finite(tts):
    """The same check in the Python API: no voice with NaN features is ever made."""
    from cosyllama.errors import InputError

    with pytest.raises(InputError, match=r"far outside \[-1, 1\]"):
        tts.make_voice(io.BytesIO(_float_wav(1e20 * np.sin(np.arange(32_000) / 5.0))))


# -- 2. a bad file in the voice directory --------------------------------------------------------


def test_a_bad_voice_file_is_skipped_at_start_and_reported(tts, voice, tmp_path, caplog):
    from fastapi.testclient import TestClient

    from cosyllama.server.serving import open_voice_store

    VoiceDirectory(tmp_path).add("good", voice)
    good = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "cut.pt").write_bytes(good[: len(good) // 2])
    with caplog.at_level(logging.WARNING, logger="cosyllama.voices"):
        store = open_voice_store(str(tmp_path))  # `serve --voices DIR` at start: no error
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "empty.pt" in warned and "cut.pt" in warned and "not a voice file" in warned
    assert sorted(store.skipped) == ["cut.pt", "empty.pt"]
    view = copy.copy(tts)
    view.voices = store
    with TestClient(create_app(view)) as c:  # no API key: /health has the details
        voices = c.get("/health").json()["voices"]
        assert voices["skipped_count"] == 2
        assert [s["file"] for s in voices["skipped"]] == ["cut.pt", "empty.pt"]
        assert all(s["error"].startswith("not a voice file") for s in voices["skipped"])
        assert [v["id"] for v in c.get("/v1/voices").json()["voices"]] == ["good"]
        assert c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "good"}).status_code == 200
        (tmp_path / "cut.pt").unlink()  # the operator removes it: no longer reported
        assert c.get("/health").json()["voices"] == {"skipped_count": 1, "skipped": [voices["skipped"][1]]}


# -- 4. the smaller ones ------------------------------------------------------------------------


def test_empty_text_fields_name_the_field(client):
    err = _error(client.post("/v1/audio/speech", json={"input": "  ", "voice": "en"}), 422, "input is empty")
    assert err["param"] == "input"
    err = _error(client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en", "instructions": " "}), 422,
                 "instructions is empty")
    assert err["param"] == "instructions"


def test_mode_is_checked_against_instructions(client):
    speak = {"input": "Hello there.", "voice": "en", "greedy": True}
    err = _error(client.post("/v1/audio/speech", json={**speak, "mode": "instruct"}), 422, "needs instructions")
    assert err["param"] == "instructions"
    err = _error(client.post("/v1/audio/speech", json={**speak, "mode": "zero-shot", "instructions": "Slowly."}),
                 422, "takes no instructions")
    assert err["param"] == "mode"
    _error(client.post("/v1/audio/speech", json={**speak, "mode": "vc"}), 422, "mode")
    auto = client.post("/v1/audio/speech", json=speak)
    zero = client.post("/v1/audio/speech", json={**speak, "mode": "zero-shot"})
    cross = client.post("/v1/audio/speech", json={**speak, "mode": "cross-lingual"})
    assert auto.status_code == zero.status_code == cross.status_code == 200
    assert auto.content == zero.content != cross.content  # "en" has a transcript: auto is zero-shot


def test_head_health(client):
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""


def test_unknown_voice_names_a_few_and_counts_the_rest(tts, voice):
    from fastapi.testclient import TestClient

    from cosyllama.errors import InputError

    store = VoiceStore()
    for i in range(12):
        store.add(f"voice{i:02d}", voice)
    view = copy.copy(tts)
    view.voices = store
    with TestClient(create_app(view)) as c:
        err = _error(c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "nobody"}), 404, "nobody")
        assert "voice00, voice01, voice02, voice03, voice04 and 7 more" in err["message"]
        assert "voice05" not in err["message"]
    with pytest.raises(InputError, match="and 7 more"):
        store.get("nobody")


def test_max_voices(client):
    files = {"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")}
    added = []
    try:
        for i in range(3):  # "en" and three more: the limit of 4
            r = client.post("/v1/voices", files=files, data={"id": f"extra{i}"})
            assert r.status_code == 200, r.text
            added.append(f"extra{i}")
        err = _error(client.post("/v1/voices", files=files, data={"id": "one-too-many"}), 409, "--max-voices 4")
        assert (err["code"], err["param"]) == ("too_many_voices", "id")
        r = client.post("/v1/voices", files=files, data={"id": "extra0", "replace": "true"})
        assert r.status_code == 200, r.text  # replacing one is not a new voice
    finally:
        for vid in added:
            client.delete(f"/v1/voices/{vid}")


def test_a_huge_chunked_body_gets_413(client):
    def body(head: bytes, tail: bytes):  # a generator: httpx sends it chunked, with no Content-Length
        yield head
        for _ in range(25):
            yield b"\0" * 1_000_000
        yield tail

    form = body(b'--x\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n'
                b"Content-Type: audio/wav\r\n\r\n", b"\r\n--x--\r\n")
    r = client.post("/v1/voices", content=form, headers={"Content-Type": "multipart/form-data; boundary=x"})
    _error(r, 413, "larger than")
    r = client.post("/v1/audio/speech", content=body(b'{"input": "', b'"}'),
                    headers={"Content-Type": "application/json"})
    _error(r, 413, "larger than")
    assert client.get("/health").status_code == 200


# -- the page's and /docs' own origin -----------------------------------------------------------


def test_the_servers_own_origin_may_post(server, client):
    """Swagger UI (/docs) and the web page post from the server's own origin; an attacker's DNS
    name rebound to it may not, unless an API key guards the server."""
    body = {"input": "Hi.", "voice": "en"}
    assert client.post("/v1/audio/speech", json=body, headers={"Origin": server.url}).status_code == 200
    local = f"http://localhost:{server.port}"
    r = client.post("/v1/audio/speech", json=body, headers={"Origin": local, "Host": f"localhost:{server.port}"})
    assert r.status_code == 200
    rebound = {"Origin": f"http://evil.example:{server.port}", "Host": f"evil.example:{server.port}"}
    _error(client.post("/v1/audio/speech", json=body, headers=rebound), 403, "evil.example")
    other_port = {"Origin": f"http://127.0.0.1:{server.port + 1}"}
    _error(client.post("/v1/audio/speech", json=body, headers=other_port), 403)


def test_with_an_api_key_the_page_loads_and_its_origin_needs_the_key(tts, voice):
    from fastapi.testclient import TestClient

    view = copy.copy(tts)
    view.voices = VoiceStore()
    view.voices.add("en", voice)
    with TestClient(create_app(view, api_key=KEY), base_url="http://tts.example") as c:
        page = c.get("/")
        assert page.status_code == 200 and "<html" in page.text
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert c.get("/ui/app.js").status_code == 200 and c.get("/ui/style.css").status_code == 200
        same = {"Origin": "http://tts.example"}
        _error(c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en"}, headers=same), 401)
        r = c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en"},
                   headers={**same, "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200

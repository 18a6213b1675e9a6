"""What a client sends the HTTP API is checked and refused by name (loopback, tiny model, PyTorch LLM):
finite but huge samples, an empty text field, a mode that disagrees with the instructions, a bad character
in the text (the Python API too), no bound on the voices, a huge chunked body; HEAD /health; and the
same-origin rule the web page and /docs rely on. Slow clients: test_server_conn.py."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import LoopbackServer

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from cosyllama.tts import TTS  # noqa: E402
from cosyllama.voices import VoiceStore  # noqa: E402
from server_helpers import PROMPT_WAV  # noqa: E402
from server_helpers import float_wav as _float_wav  # noqa: E402
from server_helpers import json_error as _error  # noqa: E402


@pytest.fixture(scope="module")
def server(tts, voice):
    view = TTS.from_models(tts.models, voices=VoiceStore())
    view.voices.add("en", voice)
    from cosyllama.server.conn import ConnectionLimits, uvicorn_options

    # with the connection guard, as `cosyllama serve` runs: a 413 answered before its body is read drains the
    # body instead of resetting the connection (plain uvicorn resets it now and then: the huge-body test saw it)
    srv = LoopbackServer(create_app(view, ServeOptions(ServingOptions(view.options), max_prompt_bytes=1_000_000,
                                                       max_voices=4)),
                         **uvicorn_options(ConnectionLimits()))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# -- 1. finite but huge samples ------------------------------------------------------------------


def test_huge_finite_samples_are_refused_naming_the_problem(client):
    speech = np.sin(np.arange(32_000) / 5.0)
    err = _error(client.post("/v1/voices", files={"audio": ("h.wav", _float_wav(1e20 * speech), "audio/wav")},
                             data={"id": "huge"}), 400, "far outside [-1, 1]")
    assert "1e+20" in err["message"]
    assert "huge" not in [v["id"] for v in client.get("/v1/voices").json()["voices"]]


# -- 2. a bad file in the voice directory --------------------------------------------------------


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


def test_the_python_api_names_bad_characters_too(tts, voice):
    from cosyllama.errors import InputError

    with pytest.raises(InputError, match=r"text holds a control character \(U\+0007\) at character 2"):
        tts.synthesize("Hi\x07", voice=voice)
    with pytest.raises(InputError, match=r"transcript holds a lone surrogate"):
        tts.make_voice(PROMPT_WAV, "Hi \udfff")

"""The HTTP server on loopback (uvicorn in a thread, tiny model, llama.cpp F32 backend): batched
requests equal requests alone, disconnects free their sequence, bad input gets JSON errors, 503."""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

from helpers import MODEL_DIR, LoopbackServer, slow_backend

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")

import cosyllama  # noqa: E402
from cosyllama.config import load_config  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from server_helpers import PROMPT_WAV  # noqa: E402
from server_helpers import speech as _speech  # noqa: E402
from server_helpers import wait_idle as _wait_idle  # noqa: E402

TEXTS = ["Hello there.", "Good morning!", "How are you?", "See you soon.", "One two three.",
         "Nice to meet you.", "It is raining.", "Thank you."]


@pytest.fixture(scope="module")
def tts(tiny_gguf):
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM
    from cosyllama.tts import TTS

    path = tiny_gguf("speech", "F32")
    backend = LlamaCppLLM(path, load_config(MODEL_DIR), n_threads=1, n_seq_max=8)
    yield TTS(MODEL_DIR, llm="llamacpp", llm_backend=slow_backend(backend))
    backend.close()


@pytest.fixture(scope="module")
def server(tts):
    from cosyllama.server.conn import ConnectionLimits, uvicorn_options

    # with the connection guard, as `cosyllama serve` runs: a 413 answered before its body is read
    # drains the body instead of resetting the connection (plain uvicorn resets it now and then)
    srv = LoopbackServer(create_app(tts, ServeOptions(ServingOptions(tts.options), max_prompt_bytes=1_000_000)),
                         **uvicorn_options(ConnectionLimits()))
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        wav = PROMPT_WAV.read_bytes()
        r = c.post("/v1/voices", files={"audio": ("p.wav", wav, "audio/wav")},
                   data={"text": "Hello, this is my voice.", "id": "en"})
        assert r.status_code == 200 and r.json() == {"id": "en"}
        r = c.post("/v1/voices", files={"audio": ("p.wav", wav, "audio/wav")}, data={"id": "bare"})
        assert r.status_code == 200
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _request(i: int) -> dict:
    # mixed modes and formats: zero-shot / cross-lingual / instruct, stream or not
    kw = {"input": TEXTS[i], "voice": "bare" if i % 3 == 1 else "en", "greedy": True,
          "stream": i % 2 == 1, "response_format": "wav" if i % 4 < 2 else "pcm"}
    if i % 3 == 2:
        kw["instructions"] = "Speak slowly."
    return kw


def test_voices_and_health(client):
    ids = [v["id"] for v in client.get("/v1/voices").json()["voices"]]
    assert {"en", "bare"} <= set(ids)
    voices = {v["id"]: v for v in client.get("/v1/voices").json()["voices"]}
    assert voices["en"]["has_transcript"] and not voices["bare"]["has_transcript"]
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["active_sequences"] == 0 and h["queue_depth"] == 0
    assert h["version"] == cosyllama.__version__
    assert h["llm"]["n_seq_max"] == 8
    assert set(h["prompt_cache"]) == {"prompts", "bytes"}


def test_a_registered_voice_is_warmed_in_the_background(client, tts):
    """Registering a voice solves its shared flow blocks after the answer (no synthesis needed):
    the prompt cache gains one prompt; a quieter copy of the clip is a different prompt."""
    if tts.token2wav._prompt_cache_bytes() == 0:
        pytest.skip("the flow caches are off at fp32 (precision auto on a CPU without native bf16)")
    _wait_idle(client)
    before = client.get("/health").json()["prompt_cache"]["prompts"]
    audio, sr = sf.read(PROMPT_WAV, dtype="float32")
    buf = io.BytesIO()
    sf.write(buf, 0.5 * audio, sr, format="WAV")
    r = client.post("/v1/voices", files={"audio": ("q.wav", buf.getvalue(), "audio/wav")},
                    data={"text": "Hello, this is my voice.", "id": "quiet"})
    assert r.status_code == 200
    try:
        deadline = time.monotonic() + 30
        while client.get("/health").json()["prompt_cache"]["prompts"] != before + 1:
            assert time.monotonic() < deadline, "the voice was not warmed"
            time.sleep(0.05)
    finally:
        assert client.delete("/v1/voices/quiet").status_code == 200


def test_formats(client):
    wav = _speech(client, "Hello there.", response_format="wav")
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
    audio, sr = sf.read(io.BytesIO(wav.content), dtype="int16")
    assert sr == 24_000 and audio.size > 0
    pcm = _speech(client, "Hello there.", response_format="pcm")
    assert pcm.content == wav.content[44:]
    flac = _speech(client, "Hello there.", response_format="flac")
    np.testing.assert_array_equal(sf.read(io.BytesIO(flac.content), dtype="int16")[0], audio)
    mp3 = _speech(client, "Hello there.")  # OpenAI's default format
    assert mp3.headers["content-type"] == "audio/mpeg" and sf.info(io.BytesIO(mp3.content)).frames == audio.size
    streamed = _speech(client, "Hello there.", stream=True, response_format="wav")
    assert streamed.status_code == 200 and streamed.content[:4] == b"RIFF"
    assert len(streamed.content) > 44


def test_concurrent_requests_equal_alone(client):
    alone = []
    for i in range(8):
        r = client.post("/v1/audio/speech", json=_request(i))
        assert r.status_code == 200, r.text
        alone.append(r.content)
    before = client.get("/health").json()
    barrier = threading.Barrier(8)

    def run(i):
        with httpx.Client(base_url=str(client.base_url), timeout=60) as c:
            barrier.wait()
            r = c.post("/v1/audio/speech", json=_request(i))
            return r.status_code, r.content

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, range(8)))
    assert [s for s, _ in together] == [200] * 8
    for i, (_, body) in enumerate(together):
        assert body == alone[i], f"request {i} differs when batched"
    h = _wait_idle(client)
    assert h["max_batch"] >= 4, h  # the LLM really advanced several sequences per step
    assert h["interleave"] in ("off", "first", "all")
    assert h["decode_steps"] - before["decode_steps"] < h["decoded_tokens"] - before["decoded_tokens"]


def test_disconnect_frees_sequence(client, server, tts):
    text = "This is a long sentence that keeps the model busy for a good while, word after word after word."
    body = {"input": text, "voice": "en", "stream": True, "response_format": "pcm", "greedy": True}
    tts.llm.step_delay = 0.01  # ~500 tokens to decode: about 5 s
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/v1/audio/speech", json=body) as r:
                assert r.status_code == 200
                next(_chunks := r.iter_bytes())  # keep it: a dropped iterator closes the connection
                at_first = client.get("/health").json()
                assert at_first["active_sequences"] == 1
            # leaving the block closes the connection mid-stream
        h = _wait_idle(client, timeout=60)  # only a hang reaches this
    finally:
        tts.llm.step_delay = 0.0
    assert h["active_sequences"] == 0 and h["llm"]["active_sequences"] == 0
    # counted, not timed: the whole answer is ~500 tokens, 10 ms a step at least (a slow machine decodes fewer,
    # not more); 250 more after the client had its first audio would be 2.5 s of not seeing it leave
    assert h["decoded_tokens"] - at_first["decoded_tokens"] < 250, "the cancelled request decoded on"
    assert _speech(client, "After the disconnect.").status_code == 200


def _assert_error(r, status, kind=None, contains=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}  # OpenAI's error object
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if kind:
        assert err["type"] == kind
    if contains:
        assert contains in err["message"]


def test_bad_requests_get_json_errors(client):
    _assert_error(_speech(client, "x" * 5000), 413, "request_too_large", "4096")
    _assert_error(_speech(client, "   "), 422, contains="empty")
    _assert_error(client.post("/v1/audio/speech", json={"input": "Hi", "voice": "nobody"}), 404,
                  "not_found_error", "nobody")
    _assert_error(_speech(client, "Hi", speed=5), 422, contains="speed")
    _assert_error(_speech(client, "Hi", response_format="ogg"), 422,
                  contains="'mp3', 'wav', 'pcm', 'flac', 'opus' or 'aac'")
    _assert_error(_speech(client, "Hi", temperature=0.3), 422, contains="temperature")
    _assert_error(_speech(client, "Hi", seed=-1), 422, contains="seed")
    _assert_error(client.post("/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}),
                  422)
    _assert_error(client.post("/v1/audio/speech", json={"voice": "en"}), 422, contains="input")
    files = {"audio": ("p.wav", b"this is not audio", "audio/wav")}
    _assert_error(client.post("/v1/voices", files=files, data={"id": "junk"}), 400,
                  contains="prompt audio is not a readable audio file (Format not recognised)")
    _assert_error(client.post("/v1/voices", data={"id": "x", "text": "hi"}), 422, contains="audio")
    wav = PROMPT_WAV.read_bytes()
    _assert_error(client.post("/v1/voices", files={"audio": ("p.wav", wav, "audio/wav")}, data={"id": "a b"}),
                  422, contains="a b")
    _assert_error(client.post("/v1/voices", files={"audio": ("p.wav", b"\0" * 1_000_001, "audio/wav")}), 413)
    _assert_error(client.post("/v1/voices", files={"audio": ("p.wav", b"\0" * 2_000_000, "audio/wav")}), 413,
                  "request_too_large", "body")
    silent = io.BytesIO()
    sf.write(silent, np.zeros(24_000, np.float32), 24_000, format="WAV")
    _assert_error(client.post("/v1/voices", files={"audio": ("s.wav", silent.getvalue(), "audio/wav")}), 400,
                  contains="silent")
    long = io.BytesIO()
    sf.write(long, np.full(16_000 * 31, 0.1, np.float32), 16_000, format="WAV", subtype="PCM_16")
    _assert_error(client.post("/v1/voices", files={"audio": ("l.wav", long.getvalue(), "audio/wav")}), 400,
                  contains="30 s")
    _assert_error(client.delete("/v1/voices/nobody"), 404, "not_found_error")
    _assert_error(client.get("/v1/nothing"), 404)
    assert "junk" not in [v["id"] for v in client.get("/v1/voices").json()["voices"]]
    # the server keeps serving
    assert _speech(client, "Still here.").status_code == 200
    r = client.post("/v1/voices", files={"audio": ("p.wav", wav, "audio/wav")}, data={"text": "Hi."})
    vid = r.json()["id"]
    assert client.delete(f"/v1/voices/{vid}").json() == {"id": vid, "deleted": True}
    _wait_idle(client)


def test_full_server_answers_503(tts, server):
    srv = LoopbackServer(create_app(tts, ServingOptions(tts.options, max_concurrent=1, max_queue=0)))
    tts.llm.step_delay = 0.01  # the first request must still be running when the second comes
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            body = {"input": "A long sentence that takes a while to speak, one word after another.",
                    "voice": "en", "stream": True, "response_format": "pcm", "greedy": True}
            with c.stream("POST", "/v1/audio/speech", json=body) as r:
                next(_chunks := r.iter_bytes())  # keep it: a dropped iterator closes the connection
                with httpx.Client(base_url=srv.url, timeout=60) as c2:
                    busy = c2.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en"})
                _assert_error(busy, 503, "server_busy")
                assert busy.json()["error"]["code"] == "server_busy"  # as the WebSocket's error says it
                assert busy.headers["retry-after"] == "1"
            tts.llm.step_delay = 0.0
            _wait_idle(c)
            assert c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "en"}).status_code == 200
    finally:
        tts.llm.step_delay = 0.0
        srv.stop()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.mark.slow
def test_rss_flat_over_200_requests(client):
    rss = {}
    for i in range(1, 201):
        r = _speech(client, TEXTS[i % len(TEXTS)], stream=bool(i % 2), response_format="pcm")
        assert r.status_code == 200
        if i in (20, 200):
            rss[i] = _rss_mb()
    print(f"RSS after 20 requests: {rss[20]:.1f} MB, after 200: {rss[200]:.1f} MB "
          f"({100 * (rss[200] / rss[20] - 1):+.2f} %)")
    assert rss[200] <= rss[20] * 1.05

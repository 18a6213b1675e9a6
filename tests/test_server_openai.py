"""The official ``openai`` Python SDK as the server's client (loopback, tiny model, llama.cpp F32):
every response format decodes to the expected length, ``with_streaming_response`` streams raw
audio and Server-Sent Events, and errors surface as the SDK's exceptions with OpenAI's fields."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf

from helpers import MODEL_DIR

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from cosyllama.config import load_config  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from helpers import LoopbackServer  # noqa: E402
from test_server import PROMPT_WAV  # noqa: E402

TEXT = "Hello there."
SR = 24_000
# A streamed mp3 has no LAME tag, so decoders also play the encoder's delay and padding (server_wire)
MP3_STREAM_EXTRA = int(0.1 * SR)


@pytest.fixture(scope="module")
def server(tiny_gguf):
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM
    from cosyllama.tts import TTS

    backend = LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(MODEL_DIR), n_threads=1, n_seq_max=4)
    srv = LoopbackServer(create_app(TTS(MODEL_DIR, llm="llamacpp", llm_backend=backend)))
    r = httpx.post(f"{srv.url}/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                   data={"text": "Hello, this is my voice.", "id": "en"}, timeout=60)
    assert r.status_code == 200, r.text
    yield srv
    srv.stop()
    backend.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _create(client, **kw):
    kw.setdefault("extra_body", {"greedy": True})  # cosyllama's own field: deterministic tokens
    return client.audio.speech.with_raw_response.create(model="cosyvoice3", voice="en", input=TEXT, **kw)


@pytest.fixture(scope="module")
def reference(client) -> np.ndarray:
    """The int16 samples of the whole-file wav (non-streaming synthesis)."""
    r = _create(client, response_format="wav")
    audio, sr = sf.read(io.BytesIO(r.content), dtype="int16")
    assert sr == SR and audio.size > SR // 4
    return audio


@pytest.fixture(scope="module")
def streamed_pcm(client) -> bytes:
    """The pcm body of streaming synthesis."""
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice3", voice="en", input=TEXT, response_format="pcm", stream_format="audio",
            extra_body={"greedy": True}) as r:
        assert r.headers["content-type"] == "audio/pcm"
        return b"".join(r.iter_bytes())


@pytest.mark.parametrize("fmt, media_type", [("wav", "audio/wav"), ("flac", "audio/flac"), ("mp3", "audio/mpeg"),
                                             ("opus", "audio/ogg"), ("pcm", "audio/pcm")])
def test_every_format_decodes_to_the_same_length(client, reference, fmt, media_type):
    r = _create(client, response_format=fmt)
    assert r.headers["content-type"] == media_type
    data = r.content
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(data, "<i2"), reference)
        return
    with sf.SoundFile(io.BytesIO(data)) as f:
        assert (f.samplerate, f.channels) == (SR, 1)
        assert f.format == {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "opus": "OGG"}[fmt]
        audio = f.read(dtype="int16")
    assert audio.size == reference.size  # the mp3's LAME tag trims its delay and padding
    if fmt in ("wav", "flac"):
        np.testing.assert_array_equal(audio, reference)
    else:
        assert _same_sound(audio, reference)


def _same_sound(audio: np.ndarray, reference: np.ndarray) -> bool:
    """A lossy copy of ``reference``: aligned (cross-correlation peaks at lag 0) with the energy
    below 10 kHz within 30 % (the tiny model's noise-like audio keeps most of its energy above,
    which mp3 cuts; opus keeps band energies, not waveforms, so correlation would say little)."""
    x, y = audio.astype(np.float64), reference.astype(np.float64)
    lag = int(np.argmax(np.correlate(x, y, "full"))) - (y.size - 1)
    n = max(x.size, y.size)
    low = np.fft.rfftfreq(n, 1 / SR) < 10_000
    ex, ey = (np.sum(np.abs(np.fft.rfft(v, n)[low]) ** 2) for v in (x, y))
    return lag == 0 and 0.7 < np.sqrt(ex / ey) < 1.3


def test_same_sound_tells_a_shifted_or_quieter_copy():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(12_000)
    assert _same_sound(ref + 0.1 * rng.standard_normal(ref.size), ref)
    assert not _same_sound(np.roll(ref, 480), ref)
    assert not _same_sound(0.6 * ref, ref)


def test_the_sdk_streams_raw_audio(client, streamed_pcm, reference):
    """stream_format="audio" is streaming synthesis: the same bytes as the older stream=true, the
    same length as the whole file (chunked synthesis: not the same samples)."""
    assert len(streamed_pcm) == 2 * reference.size
    r = httpx.post(f"{client.base_url}audio/speech", timeout=60,
                   json={"input": TEXT, "voice": "en", "greedy": True, "response_format": "pcm", "stream": True})
    assert r.status_code == 200 and r.content == streamed_pcm


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus"])
def test_streamed_encodings_decode(client, streamed_pcm, fmt):
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice3", voice="en", input=TEXT, response_format=fmt, stream_format="audio",
            extra_body={"greedy": True}) as r:
        data = b"".join(r.iter_bytes())
    want = np.frombuffer(streamed_pcm, "<i2")
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[44:] == streamed_pcm
        return
    with sf.SoundFile(io.BytesIO(data)) as f:
        audio = f.read(dtype="int16")
    if fmt == "opus":  # Ogg is written front to back: the stream is a whole file
        assert audio.size == want.size
    else:
        assert want.size <= audio.size <= want.size + MP3_STREAM_EXTRA


def _events(lines) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: "):]))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def test_the_sdk_streams_server_sent_events(client, streamed_pcm):
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice3", voice="en", input=TEXT, response_format="pcm", stream_format="sse",
            extra_body={"greedy": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.iter_lines())
    *deltas, done = events
    assert deltas and all(e["type"] == "speech.audio.delta" and set(e) == {"type", "audio"} for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == streamed_pcm
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["output_tokens"] * 960 * 2 == len(streamed_pcm)  # 960 samples per speech token
    assert 0 < usage["input_tokens"] < len(TEXT)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def _error(excinfo, status, param=None, code=None, contains=None):
    e = excinfo.value
    assert e.status_code == status
    assert set(e.body) == {"message", "type", "param", "code"}, e.body
    assert (e.param, e.code) == (param, code), e.body
    if contains:
        assert contains in e.body["message"]


def test_errors_surface_as_sdk_exceptions(client):
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, response_format="aac")
    _error(ei, 422, "response_format", "literal_error", "'wav', 'pcm', 'flac', 'mp3' or 'opus'")
    with pytest.raises(openai.NotFoundError) as ei:
        client.audio.speech.create(model="m", voice="nobody", input=TEXT)
    _error(ei, 404, "voice", "voice_not_found", "nobody")
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, speed=4.5)
    _error(ei, 422, "speed", "less_than_equal", "4")
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, speed=1.5, stream_format="sse")
    _error(ei, 422, "speed", "unsupported_for_streaming", "non-streaming")
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, response_format="flac", stream_format="audio")
    _error(ei, 422, "response_format", "unsupported_for_streaming", "wav, pcm, mp3, opus")
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, stream_format="sse", extra_body={"stream": False})
    _error(ei, 422, "stream", "conflicting_fields")
    with pytest.raises(openai.APIStatusError) as ei:
        client.audio.speech.create(model="m", voice="en", input="x" * 5000)
    _error(ei, 413, "input", "string_above_max_length", "input is too long: 5000 characters, at most 4096 allowed")
    r = httpx.post(f"{client.base_url}voices", data={"id": "x"}, timeout=60)  # a multipart form without audio
    assert r.status_code == 422 and r.json()["error"]["param"] == "audio" and r.json()["error"]["code"] == "missing"


@pytest.mark.parametrize("extra, param, code", [
    ({"stream": "yes"}, "stream", "bool_type"),
    ({"greedy": 1}, "greedy", "bool_type"),
    ({"seed": "5"}, "seed", "int_type"),
    ({"seed": 5.0}, "seed", "int_type"),
    ({"speed": "1.5"}, "speed", "float_type"),
    ({"temperature": 0.3}, "temperature", "extra_forbidden"),
])
def test_no_silent_coercion(client, extra, param, code):
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, extra_body=extra)
    _error(ei, 422, param, code)


def test_speed_range_is_openais(client, reference):
    for speed, rel in ((0.25, 4.0), (4.0, 0.25)):
        audio, _ = sf.read(io.BytesIO(_create(client, speed=speed, response_format="wav").content), dtype="int16")
        assert abs(audio.size - rel * reference.size) <= 480  # int(frames / speed) mel frames, 480 samples each


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_a_streamed_encoding_sends_each_chunk_as_it_comes(fmt):
    """After each 1 s chunk most of its audio is on the wire (opus: 100 ms Ogg pages, where
    libsndfile's default would hold a second back), and the pieces decode as one file."""
    from cosyllama.server.wire import StreamEncoder, encode

    rng = np.random.default_rng(0)
    chunks = [(0.1 * rng.standard_normal(SR)).astype(np.float32) for _ in range(3)]
    enc = StreamEncoder(fmt, SR)
    pieces = [enc.write(c) for c in chunks] + [enc.close()]
    whole = len(encode(np.concatenate(chunks), SR, fmt))
    for i, piece in enumerate(pieces[:-1]):
        assert len(piece) > 0.25 * whole, f"chunk {i}: {len(piece)} of about {whole // 3} bytes sent"
    audio, sr = sf.read(io.BytesIO(b"".join(pieces)), dtype="float32")
    assert sr == SR and 3 * SR <= audio.size <= 3 * SR + (MP3_STREAM_EXTRA if fmt == "mp3" else 0)


def test_sse_reports_a_failure_after_the_first_chunk_as_an_error_event():
    import anyio

    from cosyllama.server.speech import _sse_body

    class FailingJob:
        def next_bytes(self):
            raise RuntimeError("the vocoder broke")

    async def collect():
        return [e async for e in _sse_body(FailingJob(), b"\x01\x02")]

    events = _events(b"".join(anyio.run(collect)).decode().splitlines())
    assert [e["type"] for e in events] == ["speech.audio.delta", "error"]
    assert base64.b64decode(events[0]["audio"]) == b"\x01\x02"
    assert events[1]["error"] == {"message": "synthesis failed: RuntimeError: the vocoder broke",
                                  "type": "internal_error", "param": None, "code": None}

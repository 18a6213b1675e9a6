"""The official ``openai`` Python SDK as the server's client (loopback, tiny model, llama.cpp F32):
every response format decodes to the expected length, ``with_streaming_response`` streams raw
audio and Server-Sent Events, errors surface as the SDK's exceptions with OpenAI's fields, and what
OpenAI's reference for POST /v1/audio/speech says holds: mp3 by default, the voice as a string or
``{"id": ...}``, its built-in voice names, ``x-request-id``, speed and flac in a stream, aac."""

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
from cosyllama.server.options import ServeOptions, ServingOptions  # noqa: E402
from helpers import LoopbackServer  # noqa: E402
from server_helpers import PROMPT_WAV  # noqa: E402

TEXT = "Hello there."
SR = 24_000
# A streamed mp3 has no LAME tag, so decoders also play the encoder's delay and padding (server_wire)
MP3_STREAM_EXTRA = int(0.1 * SR)


@pytest.fixture(scope="module")
def server(tiny_gguf):
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM
    from cosyllama.tts import TTS

    backend = LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(MODEL_DIR), n_threads=1, n_seq_max=4)
    # OpenAI's built-in names speak with "en"; "verse" through the alias table, to a voice never registered
    tts = TTS(MODEL_DIR, llm="llamacpp", llm_backend=backend)
    srv = LoopbackServer(create_app(tts, ServeOptions(ServingOptions(tts.options, default_voice="en"),
                                                      voice_aliases={"verse": "nobody", "narrator": "en"})))
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
    kw.setdefault("voice", "en")
    return client.audio.speech.with_raw_response.create(model="cosyvoice3", input=TEXT, **kw)


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
        assert _same_sound(audio, reference, 10_000 if fmt == "mp3" else None)


def _same_sound(audio: np.ndarray, reference: np.ndarray, below_hz: float | None = 10_000) -> bool:
    """A lossy copy of ``reference``: aligned (cross-correlation peaks at lag 0), the same loudness
    over time (20 ms RMS envelopes correlated at least 0.9; a copy shifted by 20 ms, reversed or other
    noise gives under 0.1), and the energy below ``below_hz`` (None: all of it) within 30 %. The tiny
    model's noise-like audio keeps most of its energy above 10 kHz, which mp3 cuts, so mp3 is weighed
    below it; opus codes band energies, not waveforms, and on the noise of the lower bands its error
    is large (the energy below 10 kHz came back 1.47x on a Zen 4 host, the whole band's 0.81x), so
    opus is weighed over the whole band."""
    x, y = audio.astype(np.float64), reference.astype(np.float64)
    lag = int(np.argmax(np.correlate(x, y, "full"))) - (y.size - 1)
    frame = SR // 50
    ex_env, ey_env = (np.sqrt((v[:v.size // frame * frame].reshape(-1, frame) ** 2).mean(1)) for v in (x, y))
    n = max(x.size, y.size)
    band = np.fft.rfftfreq(n, 1 / SR) < (below_hz if below_hz is not None else np.inf)
    ex, ey = (np.sum(np.abs(np.fft.rfft(v, n)[band]) ** 2) for v in (x, y))
    return lag == 0 and np.corrcoef(ex_env, ey_env)[0, 1] >= 0.9 and 0.7 < np.sqrt(ex / ey) < 1.3


def test_same_sound_tells_a_shifted_or_quieter_copy():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(12_000)
    for below_hz in (10_000, None):
        assert _same_sound(ref + 0.1 * rng.standard_normal(ref.size), ref, below_hz)
        assert not _same_sound(0.6 * ref, ref, below_hz)
        assert not _same_sound(np.roll(ref, 480), ref, below_hz)
    loud = ref * np.repeat(rng.uniform(0.2, 2.0, ref.size // 480), 480)  # a loudness envelope to keep
    assert _same_sound(loud + 0.05 * rng.standard_normal(ref.size), loud, None)
    assert not _same_sound(loud[::-1].copy(), loud, None)  # the same energy, another envelope


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
        _create(client, response_format="ogg")
    _error(ei, 422, "response_format", "literal_error", "'mp3', 'wav', 'pcm', 'flac', 'opus' or 'aac'")
    with pytest.raises(openai.NotFoundError) as ei:
        client.audio.speech.create(model="m", voice="nobody", input=TEXT)
    _error(ei, 404, "voice", "voice_not_found", "nobody")
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, speed=4.5)
    _error(ei, 422, "speed", "less_than_equal", "4")
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
    assert events[1]["error"] == {"message": "internal error; the server's log has the details",
                                  "type": "internal_error", "param": None, "code": None}  # the log has the rest


# -- OpenAI's reference, field by field ---------------------------------------------------------


def _pcm(client, **kw) -> bytes:
    return _create(client, response_format="pcm", **kw).content


def test_the_default_format_is_mp3(client, reference):
    r = client.audio.speech.with_raw_response.create(model="gpt-4o-mini-tts", voice="en", input=TEXT,
                                                     extra_body={"greedy": True})
    assert r.headers["content-type"] == "audio/mpeg"
    info = sf.info(io.BytesIO(r.content))
    assert (info.format, info.samplerate, info.frames) == ("MP3", SR, reference.size)


def test_the_voice_as_an_object_and_by_openais_names(client, reference):
    """``{"id": ...}`` (the SDK's custom-voice form) is the same voice as its id; OpenAI's names speak
    with --default-voice unless the alias table or a registered voice says otherwise."""
    want = reference.tobytes()
    assert _pcm(client, voice={"id": "en"}) == want
    assert _pcm(client, voice="alloy") == want  # not registered: --default-voice
    assert _pcm(client, voice={"id": "cedar"}) == want
    assert _pcm(client, voice="narrator") == want  # --voice-alias narrator=en
    with pytest.raises(openai.NotFoundError) as ei:
        _create(client, voice="verse")  # --voice-alias verse=nobody
    _error(ei, 404, "voice", "voice_not_found", "'verse' speaks with 'nobody' (--voice-alias verse=nobody)")
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, voice={"name": "en"})
    assert ei.value.param.startswith("voice") and "voice.CustomVoice.id: Field required" in ei.value.message


def test_voice_names_resolve_in_order():
    """Alias first, then a registered id, then (OpenAI's names only) the default voice; a 404 says
    how to register one, and names no file or library."""
    from cosyllama.server.errors import api_error
    from cosyllama.server.voice_names import VoiceNames
    from cosyllama.voices import UnknownVoiceError

    class Store(set):
        def ids(self):
            return sorted(self)

    voices = Store({"anna", "alloy", "bob"})
    names = VoiceNames({"ash": "bob", "echo": "carl"}, default="anna")
    assert names.voice_id(voices, "alloy") == "alloy"  # registered under OpenAI's name
    assert names.voice_id(voices, "ash") == "bob"
    assert names.voice_id(voices, "nova") == "anna"
    assert names.voice_id(voices, "bob") == "bob"
    for name, where in (("echo", "--voice-alias echo=carl"), ("zed", "POST /v1/voices")):
        with pytest.raises(UnknownVoiceError) as ei:
            names.voice_id(voices, name)
        assert api_error(ei.value).status == 404 and where in str(ei.value)
    with pytest.raises(UnknownVoiceError) as ei:
        VoiceNames().voice_id(voices, "nova")  # no --default-voice: no silent fallback
    err = api_error(ei.value)
    assert err.status == 404 and err.code == "voice_not_found"
    assert "--default-voice ID or --voice-alias nova=ID" in err.message
    assert "register a voice with id 'nova' (POST /v1/voices)" in err.message
    with pytest.raises(Exception, match="voice id"):
        VoiceNames({"ash": "../x"})


def test_voice_alias_flags_are_checked():
    from cosyllama.errors import InputError
    from cosyllama.server.voice_names import parse_voice_aliases

    assert parse_voice_aliases(["alloy=anna", " echo = bob "]) == {"alloy": "anna", "echo": "bob"}
    assert parse_voice_aliases(None) == {}
    for bad in (["alloy"], ["=anna"], ["alloy=anna", "alloy=bob"]):
        with pytest.raises(InputError, match="--voice-alias"):
            parse_voice_aliases(bad)


def test_x_request_id_on_every_response(client, server):
    r = _create(client, response_format="pcm")
    assert r.headers["x-request-id"].startswith("req_") and len(r.headers["x-request-id"]) == 36
    assert _create(client, response_format="pcm").headers["x-request-id"] != r.headers["x-request-id"]
    r = _create(client, response_format="pcm", extra_headers={"X-Request-ID": "trace-42"})
    assert r.headers.get_list("x-request-id") == ["trace-42"]  # the client's, once
    with pytest.raises(openai.NotFoundError) as ei:
        client.audio.speech.create(model="m", voice="nobody", input=TEXT, extra_headers={"x-request-id": "t-7"})
    assert ei.value.request_id == "t-7"
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, speed="fast")
    assert ei.value.request_id.startswith("req_")
    for path in ("/health", "/", "/nowhere"):
        assert httpx.get(server.url + path, timeout=30).headers["x-request-id"].startswith("req_")
    long = "x" * 129  # too long (or with spaces): replaced, not echoed
    for sent in (long, "a b"):
        got = httpx.get(server.url + "/health", headers={"x-request-id": sent}, timeout=30).headers["x-request-id"]
        assert got.startswith("req_")
    with client.audio.speech.with_streaming_response.create(
            model="m", voice="en", input=TEXT, response_format="pcm", stream_format="sse") as r:
        assert r.headers["x-request-id"].startswith("req_")


def test_x_request_id_on_refusals_and_unexpected_errors():
    """RequestId stands outside the guard (401) and the body limit (413), and answers a bug's 500
    itself, with the header."""
    import anyio
    from starlette.responses import PlainTextResponse

    from cosyllama.server.security import RequestGuard
    from cosyllama.server.wire import BodyLimit, RequestId

    async def ok(scope, receive, send):
        await PlainTextResponse("ok")(scope, receive, send)

    async def broken(scope, receive, send):
        raise RuntimeError("secret detail")

    async def run():
        apps = {"guarded": RequestId(RequestGuard(BodyLimit(ok, 10), api_key="k")), "broken": RequestId(broken)}
        out = {}
        for name, app in apps.items():
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                out[name, 401] = await c.post("/v1/x", content=b"{}")
                out[name, 413] = await c.post("/v1/x", content=b"x" * 100, headers={"Authorization": "Bearer k"})
        return out

    out = anyio.run(run)
    for key in (("guarded", 401), ("guarded", 413)):
        assert out[key].status_code == key[1] and out[key].headers["x-request-id"].startswith("req_")
    r = out["broken", 401]
    assert r.status_code == 500 and r.headers["x-request-id"].startswith("req_")
    assert r.json()["error"] == {"message": "internal error; the server's log has the details",
                                 "type": "internal_error", "param": None, "code": None}


def test_the_app_puts_request_id_outermost(server):
    from cosyllama.server.wire import RequestId

    assert server.server.config.app.user_middleware[0].cls is RequestId


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_speed_in_a_stream_is_the_non_streaming_audio(client, stream_format):
    """No 422 for a request OpenAI takes: a stream at speed 1.5 is the non-streaming synthesis,
    sample for sample."""
    want = _pcm(client, speed=1.5)
    with client.audio.speech.with_streaming_response.create(
            model="m", voice="en", input=TEXT, response_format="pcm", speed=1.5, stream_format=stream_format,
            extra_body={"greedy": True}) as r:
        if stream_format == "audio":
            got = b"".join(r.iter_bytes())
        else:
            events = _events(r.iter_lines())
            assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
            got = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert got == want and len(want) > SR // 2


@pytest.mark.parametrize("extra", [{"stream_format": "audio"}, {"stream_format": "sse"},
                                   {"stream_format": "audio", "speed": 0.5}])
def test_flac_in_a_stream_is_the_whole_file(client, extra):
    """A streamed flac is the non-streaming synthesis' file, byte for byte (seeded sampling: streaming
    synthesis would make other tokens)."""
    speed, seeded = extra.get("speed", 1.0), {"seed": 3}
    want = _create(client, response_format="flac", speed=speed, extra_body=seeded).content
    with client.audio.speech.with_streaming_response.create(
            model="m", voice="en", input=TEXT, response_format="flac", extra_body=seeded, **extra) as r:
        if extra["stream_format"] == "audio":
            assert r.headers["content-type"] == "audio/flac"
            got = b"".join(r.iter_bytes())
        else:
            got = b"".join(base64.b64decode(e["audio"]) for e in _events(r.iter_lines())[:-1])
    assert got == want
    pcm = _pcm(client, speed=speed, extra_body=seeded)
    np.testing.assert_array_equal(sf.read(io.BytesIO(got), dtype="int16")[0], np.frombuffer(pcm, "<i2"))


def _decode_aac(data: bytes) -> np.ndarray:
    av = pytest.importorskip("av")
    with av.open(io.BytesIO(data), format="aac") as f:
        frames = list(f.decode(audio=0))
    assert frames and all((fr.sample_rate, len(fr.layout.channels)) == (SR, 1) for fr in frames)
    return np.concatenate([fr.to_ndarray().reshape(-1) for fr in frames])


def test_aac(client, reference):
    """ADTS AAC as OpenAI sends it: the whole text decodes to its length plus the encoder's priming
    and padding (under two 1024-sample frames); a stream arrives as ADTS too."""
    pytest.importorskip("av")
    r = _create(client, response_format="aac")
    assert r.headers["content-type"] == "audio/aac" and r.content[:2] in (b"\xff\xf1", b"\xff\xf9")
    audio = _decode_aac(r.content)
    assert reference.size <= audio.size < reference.size + 2048
    assert np.sqrt(np.mean(audio ** 2)) > 0.5 * np.sqrt(np.mean((reference / 32768.0) ** 2))
    with client.audio.speech.with_streaming_response.create(
            model="m", voice="en", input=TEXT, response_format="aac", stream_format="audio",
            extra_body={"greedy": True}) as r:
        streamed = _decode_aac(b"".join(r.iter_bytes()))
    assert reference.size <= streamed.size < reference.size + 2048


def test_a_streamed_aac_is_a_file_sent_as_it_is_encoded():
    pytest.importorskip("av")
    from cosyllama.server.wire import StreamEncoder, encode

    rng = np.random.default_rng(0)
    chunks = [(0.1 * rng.standard_normal(SR)).astype(np.float32) for _ in range(3)]
    enc = StreamEncoder("aac", SR)
    pieces = [enc.write(c) for c in chunks] + [enc.close()]
    assert all(len(p) > 0 for p in pieces[:-1])  # each chunk's frames leave with it
    assert b"".join(pieces) == encode(np.concatenate(chunks), SR, "aac")


def test_aac_without_pyav_is_a_422_naming_the_formats(client, monkeypatch):
    from cosyllama.server import openai_speech

    monkeypatch.setattr(openai_speech, "aac_available", lambda: False)
    with pytest.raises(openai.UnprocessableEntityError) as ei:
        _create(client, response_format="aac")
    _error(ei, 422, "response_format", "unsupported_value", "use one of mp3, wav, pcm, flac, opus")


def test_async_openai(server, reference):
    """AsyncOpenAI, as agents use it: a whole file and a stream."""
    import anyio

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:
            whole = await c.audio.speech.create(model="tts-1", voice="coral", input=TEXT, response_format="pcm",
                                                extra_body={"greedy": True})
            async with c.audio.speech.with_streaming_response.create(
                    model="tts-1", voice={"id": "en"}, input=TEXT, response_format="pcm", stream_format="audio",
                    speed=2.0, extra_body={"greedy": True}) as r:
                fast = b"".join([piece async for piece in r.iter_bytes()])
            return whole.content, fast

    whole, fast = anyio.run(run)
    assert whole == reference.tobytes()
    assert abs(len(fast) // 2 - reference.size // 2) <= 480


def test_instructions_select_instruct_mode(client, reference):
    """OpenAI's instructions field is the style instruction of instruct mode: other audio than
    without it, the same as asking for mode 'instruct' by name, streamed or whole."""
    styled = _pcm(client, instructions="Speak slowly and calmly.")
    assert styled != reference.tobytes() and len(styled) > SR // 2
    named = _pcm(client, instructions="Speak slowly and calmly.", extra_body={"greedy": True, "mode": "instruct"})
    assert named == styled
    with client.audio.speech.with_streaming_response.create(
            model="m", voice="en", input=TEXT, response_format="pcm", stream_format="sse",
            instructions="Speak slowly and calmly.", extra_body={"greedy": True}) as r:
        events = _events(r.iter_lines())
    assert events[-1]["type"] == "speech.audio.done" and len(events) > 1

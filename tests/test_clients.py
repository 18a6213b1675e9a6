"""Voice-agent clients as they are shipped, against a server on loopback (tiny model, llama.cpp F32):
pipecat's ``OpenAITTSService`` through pipecat's own test pipeline, LiveKit's ``openai.TTS`` through
its ``synthesize()`` and ``StreamAdapter`` ``stream()``, and the ``openai`` SDK's ``AsyncOpenAI``.
None of them can send cosyllama's ``seed``; the server gives every request one that does not
(``ServingOptions.defaults``), so each client's audio is compared with a direct API call
carrying that seed: the same pcm bytes, or the same samples after decoding. They need the
``clients`` extra."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest

from helpers import MODEL_DIR

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")

from cosyllama.config import load_config  # noqa: E402
from cosyllama.request import SynthesisOptions  # noqa: E402
from cosyllama.server.app import create_app  # noqa: E402
from cosyllama.server.options import ServingOptions  # noqa: E402
from helpers import LoopbackServer  # noqa: E402
from server_helpers import PROMPT_WAV  # noqa: E402

SR = 24_000
SEED = 7
TEXT = "Hello there."
VOICE = "en"  # registered; OpenAI's voice names speak with it (--default-voice)


@pytest.fixture(scope="module")
def server(tiny_gguf):
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM
    from cosyllama.tts import TTS

    backend = LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(MODEL_DIR), n_threads=1, n_seq_max=4)
    tts = TTS(MODEL_DIR, llm="llamacpp", llm_backend=backend)
    app = create_app(tts, ServingOptions(tts.options, default_voice=VOICE, defaults=SynthesisOptions(seed=SEED)))
    srv = LoopbackServer(app)
    r = httpx.post(f"{srv.url}/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                   data={"text": "Hello, this is my voice.", "id": VOICE}, timeout=60)
    assert r.status_code == 200, r.text
    yield srv
    srv.stop()
    backend.close()


def direct(server, **body) -> bytes:
    """The body of a plain POST /v1/audio/speech with the seed the clients' requests get."""
    body = {"input": TEXT, "voice": VOICE, "seed": SEED, **body}
    r = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.content


def sse_events(body: bytes) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in body.decode().split("\n\n") if e]


# -- pipecat ----------------------------------------------------------------------------------


def _pipecat_audio(server, **settings) -> tuple[np.ndarray, list]:
    """What pipecat's OpenAITTSService (its default voice, alloy) makes of TTSSpeakFrame(TEXT) in
    pipecat's own test pipeline: the TTSAudioRawFrames' samples, and every frame that came down."""
    pytest.importorskip("pipecat")
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.tests.utils import run_test

    tts = OpenAITTSService(api_key="unused", base_url=f"{server.url}/v1",
                           settings=OpenAITTSService.Settings(**settings) if settings else None)
    down, up = asyncio.run(run_test(tts, frames_to_send=[TTSSpeakFrame(TEXT)], start_timeout=30))
    errors = [f for f in [*down, *up] if isinstance(f, ErrorFrame)]
    assert not errors, errors
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and all((f.sample_rate, f.num_channels) == (SR, 1) for f in audio)
    return np.frombuffer(b"".join(f.audio for f in audio), "<i2"), down


def test_pipecat_openai_tts_service(server):
    """pipecat sends only OpenAI's voice names and asks for pcm without stream_format: its voice
    'alloy' speaks with the default voice, and its audio is the whole-text synthesis."""
    samples, _ = _pipecat_audio(server)
    want = np.frombuffer(direct(server, voice="alloy", model="gpt-4o-mini-tts", response_format="pcm"), "<i2")
    assert samples.size > SR // 4
    np.testing.assert_array_equal(samples, want)
    np.testing.assert_array_equal(want, np.frombuffer(direct(server, response_format="pcm"), "<i2"))


def test_pipecat_with_speed_and_instructions(server):
    samples, _ = _pipecat_audio(server, speed=1.5, instructions="Speak slowly.")
    want = direct(server, response_format="pcm", speed=1.5, instructions="Speak slowly.")
    np.testing.assert_array_equal(samples, np.frombuffer(want, "<i2"))


# -- LiveKit ----------------------------------------------------------------------------------


def _livekit_audio(server, how: str = "synthesize", **options) -> tuple[np.ndarray, list[str]]:
    """LiveKit's openai.TTS (its default voice, ash; default format, mp3; it always asks for sse)
    speaking TEXT through ``synthesize()`` or, wrapped in its StreamAdapter, ``stream()``: the
    frames' int16 samples and the request ids they came with."""
    pytest.importorskip("livekit.agents")
    from livekit.agents import tts as agents_tts
    from livekit.agents.tokenize.basic import SentenceTokenizer
    from livekit.plugins import openai as lk_openai

    async def run():
        tts = lk_openai.TTS(base_url=f"{server.url}/v1", api_key="unused", **options)
        frames, ids = [], []
        try:
            if how == "synthesize":
                async with tts.synthesize(TEXT) as stream:
                    async for ev in stream:
                        frames.append(ev.frame)
                        ids.append(ev.request_id)
            else:
                adapter = agents_tts.StreamAdapter(tts=tts, sentence_tokenizer=SentenceTokenizer())
                async with adapter.stream() as stream:
                    stream.push_text(TEXT)
                    stream.end_input()
                    async for ev in stream:
                        frames.append(ev.frame)
                        ids.append(ev.request_id)
                await adapter.aclose()
        finally:
            await tts.aclose()
        return frames, ids

    frames, ids = asyncio.run(run())
    assert frames and all((f.sample_rate, f.num_channels) == (SR, 1) for f in frames)
    samples = [np.frombuffer(f.data, "<i2") for f in frames]
    while samples[-1].size == SR // 100 and not samples[-1].any():
        samples.pop()  # LiveKit's end-of-segment markers (10 ms of silence) after audio that filled its frames
    return np.concatenate(samples), ids


def lk_decode(body: bytes, fmt: str) -> np.ndarray:
    """The int16 samples LiveKit's own decoder (its AudioStreamDecoder, on PyAV) makes of ``body``."""
    from livekit.agents.utils.codecs import AudioStreamDecoder

    async def run():
        dec = AudioStreamDecoder(sample_rate=SR, num_channels=1, format=f"audio/{fmt}")
        dec.push(body)
        dec.end_input()
        out = [np.frombuffer(f.data, "<i2") async for f in dec]
        await dec.aclose()
        return np.concatenate(out)

    return asyncio.run(run())


def sse_audio(body: bytes) -> bytes:
    events = sse_events(body)
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "opus", "aac", "wav"])
def test_livekit_synthesize(server, fmt, caplog):
    """LiveKit's plugin asks for Server-Sent Events in every format (mp3 by default): the samples
    it makes are those of a direct sse request, decoded the same way; its request id is the
    server's x-request-id, so it logs no 'no request_id provided' warning."""
    if fmt == "aac":
        pytest.importorskip("av")
    samples, ids = _livekit_audio(server, **({} if fmt == "mp3" else {"response_format": fmt}))
    audio = sse_audio(direct(server, response_format=fmt, stream_format="sse", model="gpt-4o-mini-tts", voice="ash"))
    assert samples.size > SR // 4
    np.testing.assert_array_equal(samples, np.frombuffer(audio, "<i2") if fmt == "pcm" else lk_decode(audio, fmt))
    assert set(ids) == {ids[0]} and ids[0].startswith("req_")
    assert "no request_id" not in caplog.text.lower()


@pytest.mark.parametrize("options", [{"speed": 1.5, "response_format": "pcm"}, {"speed": 0.75},
                                     {"response_format": "flac"}, {"response_format": "flac", "speed": 2.0}])
def test_livekit_speed_and_flac(server, options):
    """A stream of what streaming synthesis cannot make (speed != 1, flac) is the non-streaming
    synthesis: LiveKit's samples are a direct sse request's, decoded the same way, and that audio
    is exactly the samples of a request without stream_format (a streamed flac is the whole file)."""
    import soundfile as sf

    samples, _ = _livekit_audio(server, **options)
    fmt, speed = options.get("response_format", "mp3"), options.get("speed", 1.0)
    audio = sse_audio(direct(server, response_format=fmt, speed=speed, stream_format="sse"))
    np.testing.assert_array_equal(samples, np.frombuffer(audio, "<i2") if fmt == "pcm" else lk_decode(audio, fmt))
    whole = np.frombuffer(direct(server, response_format="pcm", speed=speed), "<i2")
    if fmt == "pcm":
        np.testing.assert_array_equal(samples, whole)
    elif fmt == "flac":
        assert audio == direct(server, response_format="flac", speed=speed)
        np.testing.assert_array_equal(sf.read(io.BytesIO(audio), dtype="int16")[0], whole)
    else:  # mp3: the same length as the whole synthesis, give or take the encoder's delay and padding
        assert abs(sf.info(io.BytesIO(audio)).frames - whole.size) <= int(0.1 * SR)


def test_livekit_stream_adapter(server):
    """LiveKit's StreamAdapter (what an agent session wraps a non-streaming TTS in) speaks each
    sentence through synthesize()."""
    samples, ids = _livekit_audio(server, "stream", response_format="pcm")
    audio = sse_audio(direct(server, response_format="pcm", stream_format="sse"))
    np.testing.assert_array_equal(samples, np.frombuffer(audio, "<i2"))

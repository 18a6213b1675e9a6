"""Helpers the server tests share (the HTTP API, its WebSocket stream and the Wyoming server): the
prompt clip, the tiny TTS with its voices the streamed protocols serve, and checks
of the HTTP API's answers. Imported by the test modules (``from server_helpers import ...``); the
``tts`` and ``voice`` fixtures most of them use are in ``conftest.py``. Not a test module."""

from __future__ import annotations

import dataclasses
import io
import time
from pathlib import Path

import numpy as np

from helpers import FIXTURES, MODEL_DIR, Gated

PROMPT_WAV = FIXTURES / "wavs" / "prompt_en_16k.wav"
PROMPT_TEXT = "Hello, this is my voice."  # what PROMPT_WAV says
WAIT_S = 120  # seconds for anything a server test waits for: generous, only a hang reaches it


def tiny_tts():
    """The tiny model with the PyTorch LLM, one thread, fp32: what most server tests serve."""
    from cosyllama.tts import TTS

    return TTS(MODEL_DIR, threads=1, precision="fp32")


def voiced_tts(*voices: str, gated: bool = True):
    """The tiny model (one thread) with the voice ``en`` (PROMPT_WAV and its transcript) and each of
    ``voices`` (PROMPT_WAV without a transcript); ``gated``: its LLM steps can be held
    (:class:`~helpers.Gated`)."""
    from cosyllama.tts import TTS

    t = TTS(MODEL_DIR, threads=1)
    if gated:
        t = TTS.from_models(dataclasses.replace(t.models, llm=Gated(t.llm)))
    t.add_voice("en", PROMPT_WAV, PROMPT_TEXT)
    for name in voices:
        t.add_voice(name, PROMPT_WAV)
    return t


def wait_until(condition, what: str, timeout: float = WAIT_S) -> None:
    """Poll ``condition`` until it holds; fail saying ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def speech(client, text, **kw):
    """POST /v1/audio/speech of ``text`` in the voice ``en``, greedy."""
    return client.post("/v1/audio/speech", json={"input": text, "voice": "en", "greedy": True, **kw})


def wait_idle(client, timeout=10.0, llm: bool = False) -> dict:
    """/health once no request runs and no sequence is live (``llm``: the backend's own count too)."""
    deadline = time.monotonic() + timeout
    while True:
        h = client.get("/health").json()
        if h["active_sequences"] == 0 and h["requests_running"] == 0 and (not llm or h["llm"]["active_sequences"] == 0):
            return h
        assert time.monotonic() < deadline, f"server did not go idle: {h}"
        time.sleep(0.02)


def json_error(r, status: int, contains: str = "") -> dict:
    """The ``error`` object of the HTTP answer ``r``, checked: status ``status``, a message that holds
    ``contains``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and contains in err["message"], err
    return err


def float_wav(samples, sr: int = 16_000, subtype: str = "FLOAT") -> bytes:
    """``samples`` as the bytes of a WAV file (32-bit float unless ``subtype`` says otherwise)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, np.float32), sr, format="WAV", subtype=subtype)
    return buf.getvalue()


def broken_voice_dir(path: Path, voice) -> Path:
    """A voice directory at ``path`` with an empty ``aaa.pt``, a good ``anna.pt`` (``voice``) and a
    truncated ``trunc.pt``."""
    from cosyllama.voice_directory import VoiceDirectory

    VoiceDirectory(path).add("anna", voice)
    good = (path / "anna.pt").read_bytes()
    (path / "aaa.pt").write_bytes(b"")
    (path / "trunc.pt").write_bytes(good[: len(good) // 3])
    return path


def serving_of(tts, voices=None, **options):
    """A :class:`~cosyllama.server.serving.Serving` over ``tts``'s models (left as they are), speaking with
    ``voices`` (default ``tts.voices``); ``options``: fields of :class:`~cosyllama.server.options.ServingOptions`
    besides the load options. Close it."""
    from cosyllama.server.options import ServingOptions
    from cosyllama.server.serving import prepare

    return prepare(tts.models, ServingOptions(tts.options, **options), voices=tts.voices if voices is None else voices)


def continued_pcm(tts, text: str, voice: str, seed: int = 0, lead: str = " ", **options) -> bytes:
    """The 16-bit pcm a streamed session speaks for a sentence after its utterance's first: ``text`` with the
    whitespace that stood before it (``lead``), streamed, greedy (docs/server.md: a streamed text is spoken
    as the same text sent whole). No HTTP request carries a lead; the Python API does."""
    from cosyllama.audio_out import pcm16
    from cosyllama.request import SynthesisOptions, SynthesisRequest

    opts = SynthesisOptions(greedy=True, seed=seed, stream=True, **options)
    return pcm16(tts.run(SynthesisRequest(text=text, voice=voice, options=opts, lead=lead)).audio())

"""Every command takes relative paths as it takes absolute ones: each is run as a user runs it, in its own
process, from a folder where the tiny model stands under a relative name (``M``), with the GGUF, prompt
clip, output, voices and manifest given relative to that folder (a manifest's own paths: relative to
the manifest). The Python API likewise, after a change of directory."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from cli_run import COSYLLAMA as CLI
from cli_run import Background, free_port, run_cli
from helpers import FIXTURES, MODEL_DIR

PROMPT_WAV = FIXTURES / "wavs" / "prompt_en_16k.wav"
TRANSCRIPT = "Hello, this is my voice."


@pytest.fixture(scope="module")
def gguf(tiny_gguf):
    pytest.importorskip("llama_cpp")
    return tiny_gguf("speech", "F32")


@pytest.fixture
def here(tmp_path, gguf):
    """A user's folder: ``M`` (the model, a link), ``m.gguf``, ``clips/p.wav``; the commands run in it."""
    (tmp_path / "M").symlink_to(MODEL_DIR, target_is_directory=True)
    shutil.copy(gguf, tmp_path / "m.gguf")
    (tmp_path / "clips").mkdir()
    shutil.copy(PROMPT_WAV, tmp_path / "clips" / "p.wav")
    return tmp_path


def _ok(r) -> str:
    assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def test_synth(here):
    (here / "out").mkdir()
    _ok(run_cli("synth", "--model-dir", "M", "--gguf", "m.gguf", "--mode", "cross-lingual", "--prompt-wav",
                "clips/p.wav", "--text", "Hello there.", "--greedy", "--threads", "1", "--out", "out/o.wav",
                "--tokens-out", "out/t.json", cwd=here))
    assert (here / "out" / "o.wav").stat().st_size > 44 and json.loads((here / "out" / "t.json").read_text())


def test_convert(here):
    from cosyllama.config import load_config
    from cosyllama.llm.gguf_read import inspect_gguf

    _ok(run_cli("convert", "--model-dir", "M", "--out", "new.gguf", "--type", "F32", cwd=here))
    assert inspect_gguf(here / "new.gguf", load_config(MODEL_DIR).llm).layout == "speech"


def test_make_model(here):
    _ok(run_cli("make-model", "made", "--size", "tiny", cwd=here))
    from cosyllama.config import check_model_dir

    check_model_dir(here / "made")  # every required file is there


def test_serve_with_a_voice_directory(here):
    """``serve --model-dir M --gguf m.gguf --voices voices``: a registered voice lands in ``./voices``."""
    import httpx

    port = free_port()
    server = Background([*CLI, "serve", "--model-dir", "M", "--gguf", "m.gguf", "--voices", "voices", "--port",
                         str(port), "--threads", "1", "--precision", "fp32"], cwd=here, log=here / "serve.log")
    try:
        server.wait_http(port)
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(f"{url}/v1/voices", files={"audio": ("p.wav", PROMPT_WAV.read_bytes(), "audio/wav")},
                       data={"id": "anna", "text": TRANSCRIPT}, timeout=120)
        assert r.status_code == 200, r.text
        assert (here / "voices" / "anna.pt").is_file()
        r = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hello there.", "voice": "anna", "greedy": True,
                                                              "response_format": "wav"}, timeout=120)
        assert r.status_code == 200 and r.content[:4] == b"RIFF", r.text[:300]
    finally:
        server.stop()


def _voice_file(path) -> None:
    """A voice file as a user writes it (``VoiceStore.save``), at a relative ``path`` of the cwd."""
    import cosyllama

    tts = cosyllama.load(MODEL_DIR, precision="fp32")
    tts.add_voice("anna", PROMPT_WAV, TRANSCRIPT)
    tts.voices.save(path)


def test_wyoming_with_a_voice_file(here, monkeypatch):
    """``wyoming --model-dir M --gguf m.gguf --voices voices.pt``: describes and speaks its voice."""
    pytest.importorskip("wyoming")
    from wyoming.audio import AudioChunk
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info
    from wyoming.tts import Synthesize, SynthesizeVoice

    monkeypatch.chdir(here)
    _voice_file("voices.pt")
    port = free_port()
    server = Background([*CLI, "wyoming", "--model-dir", "M", "--gguf", "m.gguf", "--voices", "voices.pt", "--uri",
                         f"tcp://127.0.0.1:{port}", "--threads", "1", "--precision", "fp32"],
                        cwd=here, log=here / "wyoming.log")

    async def talk():
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Describe().event())
            info = Info.from_event(await asyncio.wait_for(client.read_event(), 120))
            await client.write_event(Synthesize(text="Hello there.", voice=SynthesizeVoice(name="anna")).event())
            audio = b""
            while (event := await asyncio.wait_for(client.read_event(), 120)).type != "audio-stop":
                assert event.type in ("audio-start", "audio-chunk"), event
                if AudioChunk.is_type(event.type):
                    audio += AudioChunk.from_event(event).audio
            return info, audio

    try:
        server.wait_tcp(port)
        info, audio = asyncio.run(talk())
        assert "anna" in [v.name for v in info.tts[0].voices] and audio
    finally:
        server.stop()


def test_batch(here):
    """``batch jobs/lines.jsonl --out audio --model-dir M --gguf m.gguf``; the manifest's ``prompt_wav`` is
    relative to the manifest."""
    (here / "jobs").mkdir()
    row = {"id": "r1", "mode": "zero-shot", "text": "Hello there.", "prompt_wav": "../clips/p.wav",
           "prompt_text": TRANSCRIPT, "greedy": True}
    (here / "jobs" / "lines.jsonl").write_text(json.dumps(row) + "\n")
    _ok(run_cli("batch", "jobs/lines.jsonl", "--out", "audio", "--model-dir", "M", "--gguf", "m.gguf",
                "--threads", "1", "--precision", "fp32", cwd=here))
    results = [json.loads(line) for line in (here / "audio" / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in results] == ["ok"] and (here / "audio" / "r1.wav").is_file()


def test_bench(here):
    out = _ok(run_cli("bench", "--model-dir", "M", "--parts", "vocoder", "--vocoder-precisions", "fp32",
                      "--prompt-seconds", "1", "--output-seconds", "1", "--threads", "1", "--json", "b.json",
                      cwd=here))
    assert (here / "b.json").is_file(), out


def test_python_api(here, monkeypatch):
    """``cosyllama.load("M", gguf="m.gguf")`` from the folder, its prompt and voice file relative too; the
    TTS keeps working after the process changes directory."""
    pytest.importorskip("llama_cpp")
    import cosyllama

    monkeypatch.chdir(here)
    tts = cosyllama.load("M", llm="llamacpp", gguf="m.gguf", precision="fp32", threads=1)
    voice = tts.make_voice("clips/p.wav", TRANSCRIPT)
    tts.add_voice("anna", "clips/p.wav", TRANSCRIPT)
    tts.voices.save("voices.pt")
    monkeypatch.chdir(here / "clips")
    audio = tts.zero_shot("Hello there!", voice=voice, greedy=True).audio()
    assert audio.size and (here / "voices.pt").is_file()

"""The command side: the argparse namespace stops in ``cosyllama.commands`` (the code below takes typed
options), ``LoadOptions`` checks every choice once against its one vocabulary, the two servers share one
start-up, and audio is written by one module, with the bytes it always had."""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cosyllama.errors import InputError
from cosyllama.options import LoadOptions
from helpers import MODEL_DIR

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cosyllama"

# ----------------------------------------------------------------------------------------------
# The namespace stops in commands/


def test_no_argparse_namespace_below_the_commands():
    """Only ``cosyllama.commands`` and ``cosyllama.cli`` read parsed arguments; everything else takes
    typed options (LoadOptions, ServingOptions, ServeOptions, BenchOptions, ...)."""
    pattern = re.compile(r"\bargs\.[a-z_]|getattr\(args\b|hasattr\(args\b")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("commands/") or rel == "cli.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "parsed arguments read outside cosyllama.commands:\n" + "\n".join(found)


def test_load_options_from_args_lives_in_commands():
    assert not hasattr(LoadOptions, "from_args")
    from cosyllama.limits import RequestLimits
    from cosyllama.server.conn import ConnectionLimits

    assert not hasattr(RequestLimits, "from_args") and not hasattr(ConnectionLimits, "from_args")


# ----------------------------------------------------------------------------------------------
# LoadOptions: complete and checked once


@pytest.mark.parametrize("kw, message", [
    ({"device": "tpu"}, "device must be one of cpu, cuda or cuda:N, got 'tpu'"),
    ({"device": "cuda:x"}, "device must be one of cpu, cuda or cuda:N"),
    ({"precision": "fp16"}, "precision 'fp16' is not supported; use one of fp32, bf16, int8, auto"),
    ({"precision": "int8", "device": "cuda"}, "precision int8 runs on the CPU only"),
    ({"llm_precision": "int8"}, "LLM precision must be one of fp32, bf16, fp16"),
    ({"llm": None, "gguf": "x.gguf", "llm_precision": "bf16"}, "a llama.cpp LLM computes in its GGUF's type"),
])
def test_load_options_refuse_bad_choices_on_construction(kw, message):
    with pytest.raises(InputError, match=re.escape(message)):
        LoadOptions("m", **kw)
    with pytest.raises(InputError, match=re.escape(message)):
        LoadOptions("m").replace(**kw)  # a changed copy is checked again


def test_the_issues_example_is_refused():
    with pytest.raises(InputError, match="device must be"):
        LoadOptions("x", precision="fp16", device="tpu")


def test_load_options_take_every_spelling_they_took():
    import torch

    for device in ("cpu", "cuda", "cuda:1", torch.device("cpu")):
        LoadOptions("m", device=device)
    for precision in ("auto", "fp32", "bf16", "int8", "BF16", "float32", "bfloat16", torch.bfloat16):
        LoadOptions("m", precision=precision)


def test_one_vocabulary_per_choice():
    """The flags take their choices from cosyllama.defaults, where LoadOptions checks them."""
    from cosyllama import defaults, precision
    from cosyllama.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in ("synth", "batch", "serve", "wyoming"):
        actions = {a.dest: a for a in commands[name]._actions}
        assert set(actions["precision"].choices) == set(defaults.PRECISIONS)
        assert tuple(actions["llm_precision"].choices) == defaults.LLM_PRECISIONS
    assert precision.PRECISIONS is defaults.PRECISIONS
    assert tuple(commands["synth"]._option_string_actions["--llm"].choices) == defaults.LLM_CHOICES


def test_a_bad_precision_is_refused_before_any_weights_load(monkeypatch):
    import cosyllama
    from cosyllama import models as models_module
    from cosyllama import weights

    def loaded(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(weights, "load_llm_weights", loaded)
    monkeypatch.setattr(models_module, "make_llm", loaded)
    monkeypatch.setattr(models_module, "load_config", loaded)
    for kw in ({"precision": "fp16"}, {"device": "tpu"}, {"precision": "int8", "device": "cuda:0"}):
        with pytest.raises(InputError):
            cosyllama.load(MODEL_DIR, **kw)


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "--device must be one of cpu, cuda or cuda:N, got 'tpu'"),
    (["--llm", "llamacpp"], "--llm llamacpp needs --gguf FILE"),
    (["--llm", "torch", "--gguf", "g.gguf"], "--gguf is for --llm llamacpp"),
    (["--llm-precision", "bf16", "--gguf", "g.gguf"], "GGUF's type"),
])
def test_errors_at_the_command_line_name_the_flags(argv, message):
    from cosyllama.cli import build_parser
    from cosyllama.commands.options import load_options

    args = build_parser().parse_args(["synth", "--model-dir", "m", "--text", "t", "--out", "o.wav", *argv])
    with pytest.raises(InputError, match=re.escape(message)):
        load_options(args)


def test_the_factory_asserts_what_load_options_checked():
    """choose_llm and make_llm do not check the LLM choice or precision again with messages of their own."""
    import inspect

    from cosyllama.llm import factory

    source = inspect.getsource(factory.choose_llm) + inspect.getsource(factory.make_llm)
    assert "must be one of" not in source and "GGUF's type" not in source


# ----------------------------------------------------------------------------------------------
# One start-up for both servers


class _Stop(Exception):
    pass


@pytest.fixture
def start_up_log(monkeypatch):
    """Every step of a server's start-up, recorded; the model is never loaded, nothing listens."""
    from cosyllama import memory
    from cosyllama.server import serving, startup
    from cosyllama.voices import VoiceStore

    log = []
    monkeypatch.setattr(memory, "bound_onednn_cache", lambda: log.append("bound_onednn_cache"))
    monkeypatch.setattr(startup, "check_can_listen", lambda *a: log.append("check_address"))

    def open_voice_store(path):
        log.append("voices")
        return VoiceStore()

    def load_models(options):
        log.append(("load", options.parallel, options.max_seq_tokens, options.precision))
        return SimpleNamespace(llm=SimpleNamespace(name="torch"))

    def prepare(models, options, voices=None):
        log.append("prepare")
        return SimpleNamespace(models=models, tts=None, options=options, close=lambda: None)

    monkeypatch.setattr(startup, "open_voice_store", open_voice_store)
    monkeypatch.setattr(startup, "load_models", load_models)
    monkeypatch.setattr(startup, "warm_voices", lambda tts, voices=None, low_latency=False: log.append("warm"))
    monkeypatch.setattr(startup, "openmp_hint", lambda llm: log.append("openmp_hint"))
    monkeypatch.setattr(serving, "prepare", prepare)
    return log


def test_both_servers_share_one_start_up_and_bound_the_onednn_cache_once(start_up_log, monkeypatch):
    pytest.importorskip("fastapi")
    import uvicorn

    from cosyllama.cli import main
    from cosyllama.defaults import MAX_SEQ_TOKENS, SERVE_PARALLEL
    from cosyllama.server import app, serving, wyoming_server

    monkeypatch.setattr(app, "check_can_listen", lambda *a: start_up_log.append("check_address"))
    monkeypatch.setattr(app, "prepare", serving.prepare)  # the fixture's
    monkeypatch.setattr(app, "create_app", lambda serving, options: object())
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: start_up_log.append("run"))
    assert main(["serve", "--model-dir", str(MODEL_DIR), "--precision", "fp32"]) == 0
    served = list(start_up_log)

    start_up_log.clear()

    async def start_wyoming(*a, **kw):
        raise _Stop

    monkeypatch.setattr(wyoming_server, "start_wyoming", start_wyoming)
    with pytest.raises(_Stop):
        main(["wyoming", "--model-dir", str(MODEL_DIR), "--precision", "fp32", "--uri", "tcp://127.0.0.1:0"])
    steps = ["bound_onednn_cache", "check_address", "voices", ("load", SERVE_PARALLEL, MAX_SEQ_TOKENS, "fp32"),
             "prepare", "warm", "openmp_hint"]
    assert served == [*steps, "run"]
    assert start_up_log == steps


def test_bad_serve_options_are_refused_before_the_start_up(start_up_log):
    pytest.importorskip("fastapi")
    from cosyllama.cli import main

    base = ["serve", "--model-dir", str(MODEL_DIR)]
    for extra in (["--prefill-chunk", "0"], ["--max-voices", "0"], ["--device", "tpu"], ["--precision", "int8",
                                                                                            "--device", "cuda"]):
        assert main([*base, *extra]) == 2
    assert start_up_log == []


# ----------------------------------------------------------------------------------------------
# One audio-output module, the bytes unchanged

SR = 24000
X = (np.sin(np.arange(4800, dtype=np.float32) * 0.05) * 1.2).astype(np.float32)  # clips at +-1
# sha256 of what the code before the audio-output module wrote for X (server/serving.pcm16 and
# server/wire.encode / StreamEncoder at commit 2319eb7); numpy only, so the same on every machine
GOLDEN = {
    "pcm16": "75c61f608e6d14411edd4defc203acaf3f46f1b4e205ee2cc377d191521ddc23",
    "wav": "7c41dcc207d72ad05975cc0a52d4761df2572c77188de7d5da2e4a834dd58a6a",
    "wav-stream": "f452248155e5de46398cc96f65a17f1404382528baef51e9ac1f5e695b65f598",
}


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _stream(fmt: str) -> bytes:
    from cosyllama.audio_out import StreamEncoder

    enc = StreamEncoder(fmt, SR)
    return b"".join([enc.write(c) for c in np.array_split(X, 5)] + [enc.close()])


def test_the_16_bit_bodies_are_the_bytes_they_were():
    from cosyllama.audio_out import encode, pcm16

    assert _sha(pcm16(X)) == GOLDEN["pcm16"]
    assert _sha(encode(X, SR, "pcm")) == _sha(_stream("pcm")) == GOLDEN["pcm16"]
    assert _sha(encode(X, SR, "wav")) == GOLDEN["wav"]
    assert _sha(_stream("wav")) == GOLDEN["wav-stream"]


def test_the_libsndfile_formats_are_written_as_before():
    """flac and mp3 bodies, synth's WAVs and batch's files: the soundfile calls the four writers made
    before (the same arguments on the same samples)."""
    sf = pytest.importorskip("soundfile")
    from cosyllama.audio_out import encode, pcm16

    def old(samples, **kw):
        buf = io.BytesIO()
        sf.write(buf, samples, SR, **kw)
        return buf.getvalue()

    assert encode(X, SR, "flac") == old(np.frombuffer(pcm16(X), "<i2"), format="FLAC", subtype="PCM_16")
    assert encode(X, SR, "flac") == _stream("flac")
    assert encode(X, SR, "mp3") == old(np.clip(X, -1.0, 1.0), format="MP3", subtype="MPEG_LAYER_III",
                                       bitrate_mode="CONSTANT", compression_level=0.5)
    opus = sf.read(io.BytesIO(encode(X, SR, "opus")), dtype="float32")[0]  # Ogg's serial number is random
    assert np.array_equal(opus, sf.read(io.BytesIO(_stream("opus")), dtype="float32")[0]) and opus.size


def test_synth_and_batch_files_are_written_as_before(tmp_path):
    sf = pytest.importorskip("soundfile")
    from cosyllama.audio_out import write_wav
    from cosyllama.batch.output import write_audio

    write_wav(tmp_path / "a.wav", X, SR)
    sf.write(tmp_path / "old.wav", X, SR, subtype="PCM_16")  # cosyllama synth before
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "old.wav").read_bytes()
    write_wav(tmp_path / "f.wav", X, SR, "float")
    assert np.array_equal(sf.read(tmp_path / "f.wav", dtype="float32")[0], X)  # float WAVs carry a timestamp
    assert write_audio(tmp_path, "r", X, SR, "wav") == (tmp_path / "old.wav").stat().st_size
    assert (tmp_path / "r.wav").read_bytes() == (tmp_path / "old.wav").read_bytes()
    write_audio(tmp_path, "r", X, SR, "flac")
    wav16 = sf.read(tmp_path / "old.wav", dtype="int16")[0]  # batch's flac: the WAV's 16-bit samples
    buf = io.BytesIO()
    sf.write(buf, wav16, SR, subtype="PCM_16", format="FLAC")
    assert (tmp_path / "r.flac").read_bytes() == buf.getvalue()
    with pytest.raises(InputError, match="cannot write"):
        write_wav(tmp_path / "missing" / "a.wav", X, SR)


def test_the_audio_module_has_no_server_dependencies():
    import ast

    tree = ast.parse((PACKAGE / "audio_out.py").read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.split(".")[0] in ("fastapi", "starlette", "uvicorn", "anyio", "server") for m in names)
    top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert "soundfile" not in top and "av" not in top  # heavy libraries: lazily

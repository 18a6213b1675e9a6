"""LoadOptions: the one way a TTS is built. Checked once, on construction; a command's flags become
options in one place (``cosyllama.commands.options.load_options``), with errors naming the flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from cosyllama.cli import build_parser
from cosyllama.commands.options import load_options
from cosyllama.defaults import LLM_PRECISION, LLM_WEIGHTS, MAX_SEQ_TOKENS, N_SEQ_MAX, PRECISION, SERVE_PARALLEL
from cosyllama.errors import InputError
from cosyllama.options import LoadOptions
from helpers import MODEL_DIR


def test_defaults_are_the_apis():
    o = LoadOptions("m")
    assert (o.llm, o.gguf, o.llm_weights, o.precision, o.llm_precision, o.parallel) == (
        "torch", None, LLM_WEIGHTS, PRECISION, LLM_PRECISION, N_SEQ_MAX)
    assert LoadOptions("m", llm=None, gguf="x.gguf").llm == "llamacpp" and LoadOptions("m", llm=None).llm == "torch"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.threads = 2


def test_paths_are_held_absolute(tmp_path, monkeypatch):
    """Relative paths are taken from the current directory once, at construction: a later change of
    directory (or a Ray actor elsewhere) finds the same files; ``~`` is expanded, absolute paths kept."""
    monkeypatch.chdir(tmp_path)
    o = LoadOptions("M", llm=None, gguf="sub/m.gguf")
    assert (o.model_dir, o.gguf) == (tmp_path / "M", tmp_path / "sub" / "m.gguf")
    monkeypatch.chdir("/")
    assert o.replace(threads=1).model_dir == tmp_path / "M"
    assert LoadOptions(MODEL_DIR).model_dir == MODEL_DIR
    monkeypatch.setenv("HOME", str(tmp_path))
    assert LoadOptions("~/M").model_dir == tmp_path / "M"


@pytest.mark.parametrize("kw, message", [
    ({"llm": "onnx"}, "llm must be one of torch, llamacpp"),
    ({"gguf": "x.gguf"}, "a GGUF file was given but llm='torch'"),
    ({"llm_precision": "int4"}, "LLM precision must be one of"),
    ({"threads": 0}, "threads must be >= 1, got 0"),
    ({"parallel": 0}, "parallel must be >= 1, got 0"),
    ({"stream_cache_mb": -1.0}, "stream_cache_mb must be >= 0"),
    ({"prompt_cache_mb": float("nan")}, "prompt_cache_mb must be >= 0"),
])
def test_bad_options_are_refused_on_construction(kw, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        LoadOptions("m", **kw)
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        LoadOptions("m").replace(**kw)  # a changed copy is checked again


def _args(argv):
    return build_parser().parse_args(argv)


def test_each_command_turns_its_flags_into_options():
    synth = _args(["synth", "--model-dir", "m", "--text", "t", "--out", "o.wav", "--gguf", "g.gguf", "--threads", "3",
                   "--precision", "bf16", "--llm-weights", "llm.rl.pt"])
    o = load_options(synth)
    assert (o.model_dir, o.llm, o.gguf, o.threads, o.precision, o.llm_weights) == (
        Path.cwd() / "m", "llamacpp", Path.cwd() / "g.gguf", 3, "bf16", "llm.rl.pt")
    serve = _args(["serve", "--model-dir", "m", "--parallel", "5", "--max-seq-tokens", "1000",
                   "--stream-cache-mb", "64", "--prompt-cache-mb", "0"])
    o = load_options(serve)
    assert (o.llm, o.parallel, o.max_seq_tokens, o.stream_cache_mb, o.prompt_cache_mb) == ("torch", 5, 1000, 64, 0)
    assert load_options(_args(["serve", "--model-dir", "m"])).parallel == SERVE_PARALLEL
    assert load_options(_args(["serve", "--model-dir", "m"])).max_seq_tokens == MAX_SEQ_TOKENS
    # a command without a flag of a field: the defaults given, else LoadOptions' own
    o = load_options(SimpleNamespace(model_dir="m"), defaults={"parallel": 7})
    assert (o.parallel, o.threads, o.precision) == (7, None, PRECISION)
    assert load_options(SimpleNamespace(model_dir="m", parallel=2), defaults={"parallel": 7}).parallel == 2


@pytest.mark.parametrize("argv, message", [
    (["synth", "--llm", "llamacpp"], "--llm llamacpp needs --gguf FILE"),
    (["synth", "--llm", "torch", "--gguf", "g.gguf"], "--gguf is for --llm llamacpp"),
    (["synth", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["serve", "--prompt-cache-mb", "-1"], "--prompt-cache-mb must be >= 0"),
])
def test_errors_from_flags_name_the_flags(argv, message):
    extra = ["--text", "t", "--out", "o.wav"] if argv[0] == "synth" else []
    with pytest.raises(InputError, match=message):
        load_options(_args([argv[0], "--model-dir", "m", *extra, *argv[1:]]))


def test_a_tts_is_built_from_its_options():
    import cosyllama
    from cosyllama.tts import TTS

    opts = cosyllama.LoadOptions(MODEL_DIR, precision="fp32", threads=1, stream_cache_mb=32.0)
    tts = cosyllama.load(opts)
    assert tts.options is opts and tts.token2wav.new_stream_cache().max_mb == 32
    assert TTS(MODEL_DIR, precision="fp32", threads=1, stream_cache_mb=32.0).options == opts  # the keyword form
    assert LoadOptions.of(opts, stream_cache_mb=16.0).stream_cache_mb == 16.0  # TTS(opts, **changes)
    with pytest.raises(TypeError):
        TTS(MODEL_DIR, nonsense=1)

"""The `cosyllama serve` and `cosyllama wyoming` commands before they serve: bad flags are one line and
exit 2 before the model loads, a taken port is a clear error, the flags reach uvicorn and the Wyoming
listener, the cache and memory bounds are set, and a llama.cpp build threaded with OpenMP is pointed out."""

from __future__ import annotations

import importlib.util
import os

import pytest

from helpers import MODEL_DIR

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import uvicorn  # noqa: E402

# Imported before a test fakes `llamacpp_lib.import_llama_cpp`: a module first imported under the fake
# would bind it for good (`from .llamacpp_lib import import_llama_cpp`) and break every later LlamaCppLLM.
from cosyllama.llm import llamacpp_backend  # noqa: E402,F401
from cosyllama.server.conn import ConnectionLimits  # noqa: E402

needs_wyoming = pytest.mark.skipif(importlib.util.find_spec("wyoming") is None, reason="needs the wyoming extra")


@pytest.mark.parametrize("info, hinted", [(b"CPU : AVX2 = 1 | OPENMP = 1 | REPACK = 1 |", True),
                                          (b"CPU : AVX2 = 1 | REPACK = 1 |", False)])
def test_serve_advises_a_build_without_openmp(monkeypatch, caplog, info, hinted):
    """`cosyllama serve` with a llama.cpp LLM says once, at start, when that build threads with
    OpenMP (it shares libgomp with PyTorch and decodes slower beside flow work)."""
    from types import SimpleNamespace

    from cosyllama.llm import llamacpp_lib as LB
    from cosyllama.options import LoadOptions
    from cosyllama.server import app as server
    from cosyllama.server import startup
    from cosyllama.server.options import ServeOptions, ServingOptions

    fake_lc = SimpleNamespace(llama_print_system_info=lambda: info)
    monkeypatch.setattr(LB, "import_llama_cpp", lambda: fake_lc)
    models = SimpleNamespace(llm=SimpleNamespace(name="llamacpp"))
    monkeypatch.setattr(startup, "load_models", lambda options: models)
    monkeypatch.setattr(startup, "warm_voices", lambda tts, **kw: None)
    monkeypatch.setattr(server, "prepare", lambda models, options, voices: SimpleNamespace(
        models=models, tts=None, options=options, close=lambda: None))
    monkeypatch.setattr(server, "check_can_listen", lambda *a: None)  # the port need not be free
    monkeypatch.setattr(server, "create_app", lambda serving, options: object())
    ran = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: ran.append(self.config))
    options = ServeOptions(ServingOptions(LoadOptions(MODEL_DIR)), host="127.0.0.1", port=8000)
    with caplog.at_level("WARNING", logger="cosyllama.server"):
        server.serve(options)
    assert ran and ran[0].host == "127.0.0.1"
    said = [r.getMessage() for r in caplog.records if "OpenMP" in r.getMessage()]
    assert len(said) == (1 if hinted else 0)
    if hinted:
        assert '-DGGML_OPENMP=OFF' in said[0] and "pip install" in said[0]


def test_serve_passes_the_cache_bounds_and_refuses_bad_ones(capsys):
    from cosyllama.cli import build_parser, main
    from cosyllama.commands.options import serving_options
    from cosyllama.server.startup import load_models

    base = ["serve", "--model-dir", str(MODEL_DIR), "--precision", "bf16"]
    args = build_parser().parse_args([*base, "--stream-cache-mb", "64", "--prompt-cache-mb", "0"])
    t2w = load_models(serving_options(args).load).token2wav
    assert t2w.new_stream_cache().max_mb == 64 and t2w._prompt_cache_bytes() == 0
    t2w = load_models(serving_options(build_parser().parse_args(base)).load).token2wav
    assert t2w.new_stream_cache().max_mb == 2048 and t2w._prompt_cache_bytes() == 512 * 2**20
    assert main(["serve", "--model-dir", str(MODEL_DIR), "--prompt-cache-mb", "-1"]) == 2
    assert "--prompt-cache-mb must be >= 0" in capsys.readouterr().err


def test_serve_takes_the_limits_from_its_flags(capsys, monkeypatch):
    """`serve --help` lists the connection limits; bad values are refused before the model loads;
    given ones reach uvicorn as its HTTP protocol."""
    from types import SimpleNamespace

    import uvicorn

    from cosyllama.cli import build_parser, main
    from cosyllama.server import app as server
    from cosyllama.server import startup
    from helpers import MODEL_DIR

    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--header-timeout S", "--body-timeout S", "--max-connections N", "--max-voices N"):
        assert flag in text
    monkeypatch.setattr(startup, "load_models", lambda options: pytest.fail("the model was loaded"))
    base = ["serve", "--model-dir", str(MODEL_DIR)]
    assert main([*base, "--header-timeout", "0"]) == 2
    assert "--header-timeout must be a number > 0" in capsys.readouterr().err
    assert main([*base, "--max-voices", "0"]) == 2
    assert "--max-voices must be >= 1" in capsys.readouterr().err
    models = SimpleNamespace(llm=SimpleNamespace(name="torch"))
    monkeypatch.setattr(startup, "load_models", lambda options: models)
    monkeypatch.setattr(startup, "warm_voices", lambda tts, **kw: None)
    monkeypatch.setattr(server, "prepare", lambda models, options, voices: SimpleNamespace(
        models=models, tts=None, options=options, close=lambda: None))
    monkeypatch.setattr(server, "create_app", lambda serving, options: object())
    ran = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: ran.append(self.config))
    assert main([*base, "--body-timeout", "7", "--max-connections", "9"]) == 0
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    protocol = ran[0].http
    assert issubclass(protocol, AutoHTTPProtocol) and protocol.__name__.startswith("Guarded")
    assert protocol.limits == ConnectionLimits(body_timeout=7.0, max_connections=9)


def test_serve_refuses_bad_options_before_loading_the_model(capsys, monkeypatch, tmp_path):
    from cosyllama.cli import main
    from cosyllama.server import startup

    monkeypatch.setattr(startup, "load_models", lambda options: pytest.fail("the model was loaded"))
    base = ["serve", "--model-dir", str(MODEL_DIR)]
    assert main([*base, "--voices", str(tmp_path / "missing.pt")]) == 2
    assert "missing.pt' does not exist" in capsys.readouterr().err
    assert main([*base, "--voices", str(tmp_path / "no" / "dir")]) == 2
    assert "cannot make voice directory" in capsys.readouterr().err
    assert main([*base, "--allow-origin", "*"]) == 2
    assert "--allow-origin: '*' is not an origin" in capsys.readouterr().err
    assert main([*base, "--allow-origin", "https://x.example/path"]) == 2
    assert main([*base, "--api-key", " "]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    monkeypatch.setenv("COSYLLAMA_API_KEY", "")
    assert main(base) == 2
    assert "$COSYLLAMA_API_KEY is empty" in capsys.readouterr().err
    monkeypatch.delenv("COSYLLAMA_API_KEY")
    assert main([*base, "--max-transcript-chars", "0"]) == 2
    assert "--max-transcript-chars must be an integer >= 1" in capsys.readouterr().err


def test_serve_checks_the_voice_flags_before_loading(capsys):
    """A bad --voice-alias or --default-voice is one line and exit 2, before any model is loaded;
    --help says what they do over HTTP."""
    from cosyllama.cli import main

    for flags, says in ((["--voice-alias", "alloy"], "is not NAME=ID"),
                        (["--voice-alias", "alloy=../x"], "voice id '../x' is not allowed"),
                        (["--default-voice", "a b"], "voice id 'a b' is not allowed")):
        assert main(["serve", "--model-dir", "/nonexistent", *flags]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--voice-alias NAME=ID" in out and "OpenAI's voice names" in out


@needs_wyoming
def test_wyoming_command_refuses_bad_options_before_loading(capsys, monkeypatch, tmp_path):
    from cosyllama.cli import main
    from cosyllama.server import startup

    monkeypatch.setattr(startup, "load_models", lambda options: pytest.fail("the model was loaded"))
    base = ["wyoming", "--model-dir", str(MODEL_DIR)]
    assert main([*base, "--uri", "tcp://127.0.0.1"]) == 2
    assert "needs a host and a port" in capsys.readouterr().err
    assert main([*base, "--uri", "http://x:1"]) == 2
    assert "is not tcp://HOST:PORT or unix://PATH" in capsys.readouterr().err
    assert main([*base, "--default-voice", "a b"]) == 2
    assert "voice id 'a b' is not allowed" in capsys.readouterr().err
    assert main([*base, "--voices", str(tmp_path / "missing.pt")]) == 2
    assert main([*base, "--max-input-chars", "0"]) == 2
    assert main(["serve", "--model-dir", str(MODEL_DIR), "--wyoming", "tcp://nohost"]) == 2
    assert "needs a host and a port" in capsys.readouterr().err


@needs_wyoming
@pytest.mark.parametrize("command", ["serve", "serve --wyoming", "wyoming"])
def test_a_taken_port_stops_the_command_with_one_line(command, capsys):
    """`serve --port`, `serve --wyoming URI` and `wyoming --uri URI` at a taken port: exit 2 and one
    line, before the model loads (the model directory here does not even exist); serve printed
    uvicorn's start-up traceback (Wyoming) or its bind error after loading the model (HTTP) before."""
    import socket

    from cosyllama.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        uri = f"tcp://127.0.0.1:{port}"
        flags, says = {"serve": (["serve", "--port", str(port)], f"cannot listen at 127.0.0.1:{port}"),
                       "serve --wyoming": (["serve", "--port", "0", "--wyoming", uri], f"cannot listen at {uri}"),
                       "wyoming": (["wyoming", "--uri", uri], f"cannot listen at {uri}")}[command]
        assert main([*flags, "--model-dir", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "nonexistent" not in err


@needs_wyoming
def test_serve_and_wyoming_give_the_wyoming_port_their_connection_flags(capsys):
    """`serve --wyoming` and `wyoming` hand their connection flags to the Wyoming listener; `wyoming --help`
    shows each with its default."""
    from cosyllama.cli import build_parser
    from cosyllama.commands.options import serving_options

    parser = build_parser()
    flags = ["--write-timeout", "5", "--idle-timeout", "7", "--header-timeout", "3", "--max-connections", "9"]
    for argv in (["serve", "--model-dir", "m", "--wyoming", "tcp://127.0.0.1:1", *flags], ["wyoming", "--model-dir",
                                                                                          "m", *flags]):
        limits = serving_options(parser.parse_args(argv)).connection_limits
        assert limits == ConnectionLimits(header_timeout=3, write_timeout=5, idle_timeout=7, max_connections=9)
    assert serving_options(parser.parse_args(["wyoming", "--model-dir", "m"])).connection_limits == ConnectionLimits()
    with pytest.raises(SystemExit):
        parser.parse_args(["wyoming", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--write-timeout", 60), ("--idle-timeout", 30), ("--header-timeout", 10),
                          ("--max-connections", 256)):
        assert flag in out and f"(default {default})" in out
    assert "Wyoming an error event" in out


def test_memory_helpers(monkeypatch):
    """serve's memory bounds: the two cache sizes go into the environment unless already set;
    trimming the heap works on glibc (this machine)."""
    from cosyllama import memory

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # so that teardown restores the original
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    memory.bound_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(memory.ONEDNN_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"  # the operator's value wins
    assert memory.trim_heap() is True

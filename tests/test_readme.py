"""The README's examples run as written, on the fixture model: its Python blocks, and its
``cosyllama convert`` / ``synth`` command lines (model, GGUF and audio file names swapped for the
fixture's)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers import FIXTURES, MODEL_DIR

README = Path(__file__).resolve().parents[1] / "README.md"
PROMPT_WAV = FIXTURES / "wavs" / "prompt_en_16k.wav"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def _local(text: str, gguf: Path) -> str:
    """README file names -> the fixture model's files (as Python string literals or shell words)."""
    for name in ("cv3-speech-q8_0.gguf", "q8.gguf"):
        text = text.replace(name, str(gguf))
    return (text.replace("Fun-CosyVoice3-0.5B", str(MODEL_DIR)).replace("source.wav", str(PROMPT_WAV))
            .replace("prompt.wav", str(PROMPT_WAV)))


@pytest.fixture(scope="module")
def gguf(tiny_gguf):
    pytest.importorskip("llama_cpp")
    return tiny_gguf("speech", "Q8_0")


SERVER_URL = "http://localhost:8000/v1"  # blocks talking to `cosyllama serve` run in test_server_openai.py


def test_python_examples_run(gguf, tmp_path, monkeypatch):
    blocks = [b for b in _blocks("python") if SERVER_URL not in b]
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)  # out.wav, voices.pt land here
    for code in blocks:
        scope = {"play": lambda samples: None, "text": "Hello there!", "prompt_text": "Hello, this is my voice."}
        exec(compile(_local(code, gguf), "README.md", "exec"), scope)
    assert (tmp_path / "out.wav").is_file() and (tmp_path / "voices.pt").is_file()


def test_command_examples_run(gguf, tmp_path, monkeypatch):
    from cosyllama.cli import main

    monkeypatch.chdir(tmp_path)
    lines = []
    for block in _blocks("bash"):
        text = block.replace("\\\n", " ").replace("$M", str(MODEL_DIR))
        lines += [ln.strip() for ln in text.splitlines() if ln.strip().startswith("cosyllama ")]
    commands = [shlex.split(_local(ln, gguf))[1:] for ln in lines]
    commands = [c for c in commands if c[0] in ("convert", "synth")]
    assert [c[0] for c in commands].count("synth") >= 3
    for argv in commands:
        if argv[0] == "convert":
            argv[argv.index("--out") + 1] = str(tmp_path / "converted.gguf")
        assert main(argv) == 0, argv
    assert (tmp_path / "out.wav").is_file()

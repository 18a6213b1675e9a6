"""The docs run: the README's shell and Python blocks, and those of docs/usage.md, server.md, wyoming.md,
batch.md and captions.md, run as written (servers included, each started in the background, its clients run against
it, then stopped), each document in a fresh folder where the tiny fixture model stands under the
README's names. How it runs and how to mark a block: ``tests/docs_run.py``, docs/development.md."""

from __future__ import annotations

import shutil

import pytest

from docs_run import ROOT, SERVE_PORT, STAND_INS, WYOMING_PORT, DocsError, Session, blocks
from helpers import FIXTURES, MODEL_DIR

DOCS = ["README.md", "docs/usage.md", "docs/server.md", "docs/wyoming.md", "docs/batch.md", "docs/captions.md",
        "docs/dialogue.md"]
# The README runs in the default suite; the other documents' runs (a minute or more together) are slow.
RUNS = [pytest.param(doc, marks=[] if doc == "README.md" else [pytest.mark.slow]) for doc in DOCS]

# What a reader has and the test cannot: the official model (the tiny fixture stands in, under its name)
# and their own clips. Every document starts with these in its folder.
READER_FILES = {
    "Fun-CosyVoice3-0.5B": MODEL_DIR,
    "prompt.wav": FIXTURES / "wavs" / "prompt_en_16k.wav",
    "anna.wav": FIXTURES / "wavs" / "prompt_en_16k.wav",
    "source.wav": FIXTURES / "wavs" / "prompt_ru_24k.wav",
}
# docs/*.md are read after the README's usage section: they start with what it made and set.
README_GGUF = "cv3-speech-q8_0.gguf"
README_VARIABLES = {"M": "Fun-CosyVoice3-0.5B"}


def _runnable(doc: str):
    return [b for b in blocks(doc) if b.kind is not None]


def test_every_block_is_understood_and_each_skip_says_why():
    """Markers parse (a skip names its reason); the README has its commands, API and server examples to run;
    and what docs/*.md take from the README is what the README makes."""
    found = {doc: blocks(doc) for doc in DOCS}
    readme = [b for b in found["README.md"] if b.kind]
    assert sum(b.kind == "shell" for b in readme) >= 2 and sum(b.kind == "python" for b in readme) >= 3
    assert all(b.skip for bs in found.values() for b in bs if b.skip is not None)
    text = "".join(b.text for b in readme)
    assert f"--out {README_GGUF}" in text and all(f"{k}={v}" in text for k, v in README_VARIABLES.items())
    assert set(STAND_INS) >= {"cosyllama", "pip", "aplay", "curl"}
    from cosyllama.cli import build_parser
    from cosyllama.defaults import WYOMING_URI

    assert build_parser().parse_args(["serve", "--model-dir", "m"]).port == SERVE_PORT
    assert WYOMING_URI.endswith(f":{WYOMING_PORT}")  # the ports a document's servers get moved off


@pytest.fixture
def folder(tmp_path):
    """A reader's folder with their files (:data:`READER_FILES`)."""
    d = tmp_path / "reader"
    d.mkdir()
    for name, src in READER_FILES.items():
        if src.is_dir():
            shutil.copytree(src, d / name)
        else:
            shutil.copy(src, d / name)
    return d


@pytest.fixture(scope="module")
def readme_gguf(tiny_gguf):
    pytest.importorskip("llama_cpp")
    return tiny_gguf("speech", "Q8_0")


@pytest.mark.parametrize("doc", RUNS)
def test_docs_run(doc, folder, tmp_path, readme_gguf):
    pytest.importorskip("fastapi")
    if doc == "README.md":
        session = Session(folder, tmp_path / "run")
    else:
        shutil.copy(readme_gguf, folder / README_GGUF)
        session = Session(folder, tmp_path / "run", variables=dict(README_VARIABLES))
    session.run(blocks(doc))
    assert session.ran or not _runnable(doc)


def test_servers_listen_on_loopback_at_free_ports_and_clients_follow(folder, tmp_path):
    session = Session(folder, tmp_path / "run")
    http, wyo = session.ports[8000], session.ports[10200]
    line, waits = session.server_line("serve", "cosyllama serve --model-dir $M --wyoming tcp://0.0.0.0:10200  # :8000")
    assert line == f"cosyllama serve --port {http} --model-dir $M --wyoming tcp://127.0.0.1:{wyo}  # :8000"
    assert waits == [("http", str(http)), ("tcp", str(wyo))]
    line, waits = session.server_line("serve", "cosyllama serve --host 0.0.0.0 --port 9000")
    nine = session.ports[9000]
    assert line == f"cosyllama serve --host 127.0.0.1 --port {nine}" and waits == [("http", str(nine))]
    line, waits = session.server_line("wyoming", "cosyllama wyoming --model-dir $M")
    assert line == f"cosyllama wyoming --uri tcp://127.0.0.1:{wyo} --model-dir $M" and waits == [("tcp", str(wyo))]
    assert session.localize("curl localhost:8000/v1 http://127.0.0.1:9000/ 0.0.0.0:10200 example.com:8000") == (
        f"curl localhost:{http}/v1 http://127.0.0.1:{nine}/ 127.0.0.1:{wyo} example.com:8000")
    assert len({http, wyo, nine}) == 3


# ----------------------------------------------------------------------------------------------
# The run can fail: a broken command, a server that does not come up, a failing Python block


def _broken_readme(tmp_path, old: str, new: str) -> list:
    """The README's blocks with ``old`` replaced by ``new`` in the first block holding it (which must exist)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert old in text
    return [b for b in blocks("README.md", text.replace(old, new, 1)) if b.kind]


def test_a_renamed_flag_in_the_readme_fails_the_run(folder, tmp_path):
    readme = _broken_readme(tmp_path, "--out cv3-speech-q8_0.gguf", "--output cv3-speech-q8_0.gguf")
    broken = next(b for b in readme if "--output" in b.text)
    with pytest.raises(DocsError, match=rf"README.md:{broken.line} \(bash block\) stopped with exit status 2(.|\n)*"
                                        r"cosyllama convert: error: the following arguments are required: --out"):
        Session(folder, tmp_path / "run").run([broken])


def test_a_server_that_does_not_come_up_fails_the_run(folder, tmp_path):
    doc = "Run it:\n\n```bash\nM=nowhere\ncosyllama serve --model-dir $M\ncurl localhost:8000/health\n```\n"
    with pytest.raises(DocsError, match=r"x.md:3 \(bash block\) started a server that did not come up"
                                        r"(.|\n)*ended with rc 2(.|\n)*model directory"):
        Session(folder, tmp_path / "run").run(blocks("x.md", doc))


@pytest.mark.parametrize("body, message", [
    ("```python\nimport cosyllama\ncosyllama.nope()\n```\n", r"x.md:1 \(python block\) stopped(.|\n)*line 3"),
    ("```bash\necho $UNSET_IN_THE_DOCS\n```\n", r"x.md:1 \(bash block\) stopped(.|\n)*line 2: UNSET_IN_THE_DOCS"),
    ("```bash\nfalse | cat\necho not reached\n```\n", r"x.md:1 \(bash block\) stopped with exit status 1"),
    ("```bash\npip install -e \".[server,nope]\"\n```\n", r"x.md:1 \(bash block\) stopped(.|\n)*no extra nope"),
    ("<!-- docs-run: skip -->\n```bash\nfalse\n```\n", r"x.md:1: `docs-run: skip` needs its reason"),
    ("<!-- docs-run: skipp (typo) -->\n```bash\nfalse\n```\n", r"x.md:1: unknown marker"),
    ("<!-- docs-run: skip (no block) -->\ntext\n", r"x.md:1: a marker not followed by a block"),
])
def test_a_failing_block_or_bad_marker_fails_the_run(body, message, folder, tmp_path):
    with pytest.raises(DocsError, match=message):
        Session(folder, tmp_path / "run").run(blocks("x.md", body))


def test_marked_blocks_are_skipped_or_written_and_variables_carry(folder, tmp_path):
    doc = ("<!-- docs-run: skip (needs a GPU) -->\n```bash\nfalse\n```\n"
           "<!-- docs-run: file in/rows.jsonl -->\n```json\n{\"id\": 1}\n```\n"
           "```bash\nN=rows\nexport K=2 L=3\nCMAKE_ARGS=x true\n```\n"
           "```bash\ntest \"$N $K $L\" = 'rows 2 3' && test -s in/$N.jsonl\n```\n")
    session = Session(folder, tmp_path / "run")
    session.run(blocks("x.md", doc))
    assert session.ran == ["x.md:6", "x.md:9", "x.md:14"]


def test_a_block_that_hangs_is_stopped_with_its_commands(folder, tmp_path, monkeypatch):
    import os
    import time

    import docs_run

    monkeypatch.setattr(docs_run, "BLOCK_TIMEOUT", 2)
    doc = "```bash\nsleep 300 &\necho $! > sleep.pid\nwait\n```\n"
    with pytest.raises(DocsError, match=r"x.md:1 \(bash block\) did not end within 2 s"):
        Session(folder, tmp_path / "run").run(blocks("x.md", doc))
    pid = int((folder / "sleep.pid").read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the block's sleep {pid} is still running")

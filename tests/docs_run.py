"""The docs run's machinery: the fenced blocks of a markdown file and their markers, and a reader's
session that runs them as written (``tests/test_docs_run.py`` drives it; docs/development.md says how
it works for those who write the docs).

A document runs in its own folder, top to bottom, as a reader at a terminal runs it:

* ``bash``/``sh``/``shell`` blocks run in bash with ``set -euo pipefail`` (a failing command, a failing
  stage of a pipe or an unset variable stops the block, and that fails the run); variables a block
  assigns at its top level carry to the document's later blocks. ``python`` blocks run as scripts.
  Other blocks are illustrations and are not run, unless marked ``file NAME``.
* A line that starts a server (``cosyllama serve``, ``cosyllama wyoming``) runs in the background, as
  in a second terminal; the rest of its block and the later blocks run once it answers (``/health``,
  or its Wyoming port), and it is stopped when the document ends, or before a server that would
  listen where it does starts (the doc's alternative to it).
* Markers, an HTML comment on the line(s) before a block, change that: ``<!-- docs-run: skip (why) -->``
  does not run it (the reason is required, and shows to whoever edits the page);
  ``<!-- docs-run: file NAME -->`` writes the block to NAME in the folder (a manifest, a config).

Only what a reader has and the test cannot are stood in for, each listed in :data:`STAND_INS`,
:data:`PYTHON_PRELUDE` and by :meth:`Session.localize` (servers on free loopback ports).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cli_run import Background, cli_env, free_port

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = {"bash", "sh", "shell"}
PYTHON_LANGS = {"python", "py"}
BLOCK_TIMEOUT = 600  # seconds for one block: generous, only a hang reaches it (tiny model: seconds)

# Commands put first on PATH, each for something a reader has and the test cannot (or must not) use.
STAND_INS = {
    "cosyllama": "this checkout's cosyllama, run by the interpreter running the tests",
    "python": "the interpreter running the tests",
    "python3": "the interpreter running the tests",
    "pip": "installs nothing (no download; the extras are installed already), and fails if an extra it names "
           "is not in pyproject.toml",
    "aplay": "the reader's speakers: reads the audio and drops it",
    "play": "the reader's speakers: reads the audio and drops it",
    "curl": "the system's curl with --fail-with-body, so an HTTP error fails the block (a reader reads the error)",
}
# Run before every Python block: the names a block uses for what the reader has (their audio player).
PYTHON_PRELUDE = "import builtins; builtins.play = lambda *args, **kwargs: None  # the reader's audio player"

# `cosyllama serve` and `cosyllama wyoming` listen on 127.0.0.1 (never 0.0.0.0) and on free ports: each
# port a document names (the defaults too, written or not) is swapped for a free one in every block.
SERVE_PORT, WYOMING_PORT = 8000, 10200
_HOST_PORT = re.compile(r"\b(localhost|127\.0\.0\.1|0\.0\.0\.0):(\d+)\b")
_MARKER = re.compile(r"^\s*<!--\s*docs-run:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")


class DocsError(AssertionError):
    """A document that does not run as written, or a marker the run does not understand."""


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repository
    line: int  # the line of the opening fence (1-based)
    lang: str
    text: str
    skip: str | None = None  # the reason, for `docs-run: skip (...)`
    file: str | None = None  # for `docs-run: file NAME`

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def kind(self) -> str | None:
        """``"shell"``, ``"python"``, ``"file"``, or None (an illustration, not run); skipped: None."""
        if self.skip is not None:
            return None
        if self.file is not None:
            return "file"
        return "shell" if self.lang in SHELL_LANGS else "python" if self.lang in PYTHON_LANGS else None


def _directive(text: str, where: str) -> dict:
    if m := re.fullmatch(r"skip(?:\s*\((.*)\))?", text):
        if not (m.group(1) or "").strip():
            raise DocsError(f"{where}: `docs-run: skip` needs its reason in parentheses, e.g. skip (needs a GPU)")
        return {"skip": m.group(1).strip()}
    if m := re.fullmatch(r"file\s+(\S+)", text):
        name = m.group(1)
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise DocsError(f"{where}: `docs-run: file` takes a name inside the folder, got {name!r}")
        return {"file": name}
    raise DocsError(f"{where}: unknown marker `docs-run: {text}` (known: skip (REASON), file NAME)")


def blocks(doc: str | Path, text: str | None = None, root: Path = ROOT) -> list[Block]:
    """The fenced blocks of ``doc`` (``text``: its contents, else read from ``root``), with their markers;
    a marker that is not understood, or not followed by a block, is a :class:`DocsError`."""
    name = str(doc)
    lines = (text if text is not None else (root / doc).read_text(encoding="utf-8")).splitlines()
    out: list[Block] = []
    pending: tuple[int, dict] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := _MARKER.match(line):
            if pending:
                raise DocsError(f"{name}:{pending[0]}: a marker not followed by a block")
            pending = (i + 1, _directive(m.group(1), f"{name}:{i + 1}"))
        elif m := _FENCE.match(line):
            indent, start = len(m.group(1)), i
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
                i += 1
            if i == len(lines):
                raise DocsError(f"{name}:{start + 1}: a block that is never closed")
            out.append(Block(name, start + 1, m.group(2).lower(), "\n".join(body) + "\n",
                             **(pending[1] if pending else {})))
            pending = None
        elif line.strip() and pending:
            raise DocsError(f"{name}:{pending[0]}: a marker not followed by a block")
        i += 1
    if pending:
        raise DocsError(f"{name}:{pending[0]}: a marker not followed by a block")
    return out


def logical_lines(text: str) -> list[tuple[int, str]]:
    """``(first line index, text)`` of each shell line, a ``\\``-continued line joined with its next."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        start, parts = i, [lines[i]]
        while parts[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            parts.append(lines[i])
        out.append((start, "\n".join(parts)))
        i += 1
    return out


def assigned(line: str) -> list[str]:
    """The variables a shell line sets for the session (``M=dir``, ``export M=dir``), none for a command
    that only gets them in its environment (``CMAKE_ARGS=... pip install``)."""
    try:
        words = shlex.split(line.replace("\\\n", " "), comments=True)
    except ValueError:
        return []
    words = words[1:] if words[:1] == ["export"] else words
    if words and all(_ASSIGNMENT.match(w) for w in words):
        return [w.split("=", 1)[0] for w in words]
    return []


def server_kind(line: str) -> str | None:
    """``"serve"`` or ``"wyoming"`` for a line that starts one of the servers, else None."""
    try:
        words = shlex.split(line.replace("\\\n", " "), comments=True)
    except ValueError:
        return None
    if len(words) >= 2 and words[0] == "cosyllama" and words[1] in ("serve", "wyoming"):
        return None if {"-h", "--help"} & set(words) else words[1]
    return None


_PIP = '''import re, sys, tomllib
extras = set(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"])
wanted = [e.strip() for arg in sys.argv[2:] for m in re.finditer(r"^(?:\\.|cosyllama)\\[([^\\]]*)\\]$", arg)
          for e in m.group(1).split(",")]
missing = [e for e in wanted if e not in extras]
if missing:
    sys.exit(f"pip (docs run): no extra {', '.join(missing)} in pyproject.toml (extras: {', '.join(sorted(extras))})")
'''


def make_stand_ins(bin_dir: Path) -> None:
    """Write the :data:`STAND_INS` into ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    curl = shutil.which("curl")
    py = shlex.quote(sys.executable)
    scripts = {
        "cosyllama": f'exec {py} -m cosyllama.cli "$@"',
        "python": f'exec {py} "$@"',
        "python3": f'exec {py} "$@"',
        "pip": f'exec {py} -c {shlex.quote(_PIP)} {shlex.quote(str(ROOT / "pyproject.toml"))} "$@"',
        "aplay": "cat > /dev/null",
        "play": "cat > /dev/null",
        "curl": f'exec {shlex.quote(curl)} --fail-with-body "$@"' if curl else
                'echo "curl (docs run): curl is not installed" >&2; exit 127',
    }
    assert set(scripts) == set(STAND_INS)
    for name, body in scripts.items():
        p = bin_dir / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)


@dataclass
class Session:
    """One document's run in ``folder``; ``variables``: shell variables it starts with."""

    folder: Path
    work: Path  # the run's own files (scripts, logs, stand-ins), outside the reader's folder
    variables: dict[str, str] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)
    servers: list[tuple[Background, list]] = field(default_factory=list)  # and where each listens
    ran: list[str] = field(default_factory=list)  # where each block that ran is
    seconds: dict[str, float] = field(default_factory=dict)  # and how long it took (its servers' start too)

    def __post_init__(self):
        self.work.mkdir(parents=True, exist_ok=True)
        make_stand_ins(self.work / "bin")
        self.env = cli_env(PATH=os.pathsep.join([str(self.work / "bin"), os.environ.get("PATH", "")]))
        self.vars_file = self.work / "vars.sh"
        self.vars_file.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in self.variables.items()))
        self.ports.setdefault(SERVE_PORT, free_port())
        self.ports.setdefault(WYOMING_PORT, free_port())
        self._n = 0

    # -- what is stood in for

    def port(self, written: int) -> int:
        if written not in self.ports:
            self.ports[written] = free_port()
        return self.ports[written]

    def localize(self, text: str) -> str:
        """Servers the run starts listen on 127.0.0.1 and free ports: ``HOST:PORT`` for a port of
        :attr:`ports` (the servers' defaults, and any a server line names) becomes its free port."""
        def swap(m: re.Match) -> str:
            port = int(m.group(2))
            if port not in self.ports:
                return m.group(0)
            return f"{'127.0.0.1' if m.group(1) == '0.0.0.0' else m.group(1)}:{self.ports[port]}"

        return _HOST_PORT.sub(swap, text)

    def server_line(self, kind: str, line: str) -> tuple[str, list[tuple[str, str]]]:
        """The server line as the run starts it, and what to wait for: ``("http", port)`` (its
        ``/health``), ``("tcp", port)`` or ``("unix", path)`` (a Wyoming listener)."""
        for m in re.finditer(r"tcp://[^\s:/]+:(\d+)", line):
            self.port(int(m.group(1)))
        line = re.sub(r"(--host[ =])0\.0\.0\.0\b", r"\g<1>127.0.0.1", line)
        waits = []
        if kind == "serve":
            m = re.search(r"--port[ =](\d+)", line)
            port = self.port(int(m.group(1)) if m else SERVE_PORT)
            line = (line[:m.start()] + f"--port {port}" + line[m.end():] if m else
                    line.replace("cosyllama serve", f"cosyllama serve --port {port}", 1))
            waits.append(("http", str(port)))
        elif "--uri" not in line:
            uri = f"tcp://127.0.0.1:{self.port(WYOMING_PORT)}"
            line = line.replace("cosyllama wyoming", f"cosyllama wyoming --uri {uri}", 1)
        line = self.localize(line)
        for m in re.finditer(r"--(?:uri|wyoming)[ =](tcp://[^\s:/]+:(\d+)|unix://(\S+))", line):
            waits.append(("tcp", m.group(2)) if m.group(2) else ("unix", m.group(3)))
        return line, waits

    # -- running

    def _log(self, block: Block, what: str) -> Path:
        self._n += 1
        return self.work / f"{self._n:02d}-{Path(block.doc).name}-L{block.line}-{what}.log"

    def _fail(self, block: Block, what: str, script: str, output: str) -> DocsError:
        return DocsError(f"{block.where} ({block.lang} block) {what}\n--- as run (line numbers are the "
                         f"document's) ---\n{script.strip()}\n--- output ---\n{output[-6000:]}")

    def _shell(self, block: Block, first: int, text: str) -> None:
        """Run lines of ``block`` (``first``: index of the first in the block) in bash."""
        if not text.strip():
            return
        names = [n for _, ln in logical_lines(text) for n in assigned(ln)]
        pad = block.line + first - 1  # the block's lines sit at their lines in the document
        script = (f"set -euo pipefail; source {shlex.quote(str(self.vars_file))}\n" + "\n" * pad + text
                  + (f"\ndeclare -p {' '.join(dict.fromkeys(names))} >> {shlex.quote(str(self.vars_file))}\n"
                     if names else ""))
        self._run(block, ["bash", "-c", script], text, "shell")

    def _server(self, block: Block, kind: str, line: str) -> None:
        line, waits = self.server_line(kind, line)
        for old in [s for s in self.servers if set(s[1]) & set(waits)]:
            old[0].stop()  # a server in the way of this one (an alternative to it): the reader stops it first
            self.servers.remove(old)
        script = f"set -u; source {shlex.quote(str(self.vars_file))}\nexec {line}"
        server = Background(["bash", "-c", script], cwd=self.folder, log=self._log(block, kind), env=self.env)
        self.servers.append((server, waits))
        try:
            for how, where in waits:
                if how == "http":
                    server.wait_http(int(where))
                elif how == "tcp":
                    server.wait_tcp(int(where))
                else:
                    server.wait_until((self.folder / where).exists, f"the socket {where}")
        except AssertionError as e:
            raise self._fail(block, f"started a server that did not come up: {e}", line, server.output()) from None

    def _python(self, block: Block) -> None:
        path = self.work / f"{Path(block.doc).name}-L{block.line}.py"
        code = self.localize(block.text)
        path.write_text(PYTHON_PRELUDE + "\n" * block.line + code)  # line numbers are the document's
        self._run(block, [sys.executable, str(path)], code, "python")

    def _run(self, block: Block, argv: list[str], text: str, what: str) -> None:
        """``argv`` in the folder, to its end; on a timeout its whole process group is killed (a block's
        commands too, not only its shell)."""
        proc = Background(argv, cwd=self.folder, log=self._log(block, what), env=self.env)
        try:
            rc = proc.proc.wait(BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.stop(timeout=10)
            raise self._fail(block, f"did not end within {BLOCK_TIMEOUT} s", text, proc.output()) from None
        proc.stop()
        if rc != 0:
            raise self._fail(block, f"stopped with exit status {rc}", text, proc.output())

    def run_block(self, block: Block) -> None:
        kind = block.kind
        if kind is None:
            return
        self.ran.append(block.where)
        t0 = time.monotonic()
        try:
            self._run_block(block, kind)
        finally:
            self.seconds[block.where] = time.monotonic() - t0

    def _run_block(self, block: Block, kind: str) -> None:
        if kind == "file":
            (self.folder / block.file).parent.mkdir(parents=True, exist_ok=True)
            (self.folder / block.file).write_text(block.text)
        elif kind == "python":
            self._python(block)
        else:
            pending: list[tuple[int, str]] = []  # lines up to a server line run first, then the server
            for index, line in logical_lines(block.text):
                if (server := server_kind(line)) is None:
                    pending.append((index, line))
                    continue
                self._lines(block, pending)
                self._server(block, server, line)
                pending = []
            self._lines(block, pending)

    def _lines(self, block: Block, lines: list[tuple[int, str]]) -> None:
        if lines:
            self._shell(block, lines[0][0], self.localize("\n".join(line for _, line in lines)))

    def run(self, doc_blocks: list[Block]) -> None:
        """Every block in order; the servers started are stopped at the end, whatever happens."""
        try:
            for block in doc_blocks:
                self.run_block(block)
        finally:
            self.close()
            print("docs run:", ", ".join(f"{w} {t:.1f} s" for w, t in self.seconds.items()))

    def close(self) -> None:
        while self.servers:
            self.servers.pop()[0].stop()

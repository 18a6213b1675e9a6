"""Session fixtures shared by the test modules (helpers they import are in ``helpers.py``)."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from helpers import MODEL_DIR

# `--precision auto` times its candidates on the CPU and keeps the fastest; which one wins on the tiny fixture
# model depends on the machine, so the suite (and the CLIs it starts) use the class rule for reproducible paths.
# tests/test_auto_timing.py measures, with the timings mocked where a choice is asserted.
os.environ.setdefault("COSYLLAMA_AUTO", "rule")
# Likewise the flow's bf16 attention: the kernel wherever it can run (a CPU with AVX512-BF16 and a C++ compiler),
# not a timing that may go either way on the fixture's small heads; PyTorch's elsewhere. Tests of PyTorch's
# attention path set COSYLLAMA_ATTENTION=pytorch themselves.
os.environ.setdefault("COSYLLAMA_ATTENTION", "kernel")

# Every process the suite starts, and every process those start, inherits this mark; at the end of the
# session none of them may be left (a server's helper process outliving it, a test's subprocess not
# stopped). Read from /proc (Linux); elsewhere the check is skipped.
SESSION_MARK = "COSYLLAMA_TEST_SESSION"
os.environ[SESSION_MARK] = f"{os.getpid()}-{time.time_ns()}"
LEFTOVER_GRACE_S = 15.0  # processes that end on their own (their parent gone) have this long


def marked_processes(mark: str | None = None) -> dict[int, str]:
    """pid -> command line of the live processes (not this one) whose environment holds the session mark."""
    entry = f"{SESSION_MARK}={mark or os.environ[SESSION_MARK]}".encode()
    found = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture(autouse=True, scope="module")
def _cosyllama_logger_restored():
    """A test that runs ``serve`` or ``wyoming`` in-process leaves their stderr handler on the ``cosyllama`` logger
    (``server.startup.configure_logging``); it goes with its module, so later modules' servers print no log
    lines into the run's progress."""
    logger = logging.getLogger("cosyllama")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when a process it started is still running at its end."""
    gc.collect()  # helper processes of objects nobody holds any more stop with them
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := marked_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{len(left)} process(es) started by the tests are still running:"]
        lines += [f"  pid {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items())]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return MODEL_DIR


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``tiny_gguf(layout, type) -> Path``: the fixture model converted to GGUF, once per session
    for each (layout, type); later calls return the same file."""
    root = tmp_path_factory.getbasetemp() / "gguf"
    made: dict[tuple[str, str], Path] = {}
    lock = threading.Lock()

    def make(layout: str, type: str) -> Path:
        from cosyllama.llm.gguf import convert

        with lock:
            if (layout, type) not in made:
                root.mkdir(parents=True, exist_ok=True)
                made[layout, type] = convert(MODEL_DIR, root / f"tiny-{layout}-{type}.gguf", layout=layout, type=type)
            return made[layout, type]

    return make


# -- the server tests' model ----------------------------------------------------------------------
# A module that serves another model (llama.cpp, a held-back LLM) defines its own ``tts``.


@pytest.fixture(scope="module")
def tts():
    """The tiny model with the PyTorch LLM (fp32, one thread), one per test module."""
    from server_helpers import tiny_tts

    return tiny_tts()


@pytest.fixture(scope="module")
def voice(tts):
    """The prompt clip and its transcript as a voice of ``tts``."""
    from server_helpers import PROMPT_TEXT, PROMPT_WAV

    return tts.make_voice(PROMPT_WAV, PROMPT_TEXT)

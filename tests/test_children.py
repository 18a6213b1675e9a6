"""Processes the package starts die with their parent, whatever kills it: `cosyllama serve` killed with
SIGKILL leaves no process of it behind; stopped with SIGTERM it exits cleanly, without multiprocessing's
resource-tracker warnings; the text worker gives wetext's own result and stops with its owner."""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import MODEL_DIR

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")

SRC = str(Path(__import__("cosyllama").__file__).resolve().parents[1])


def _children() -> dict[int, list[int]]:
    """ppid -> pids of the live processes (zombies are dead)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            state, ppid = stat.rpartition(")")[2].split()[:2]
            if state != "Z":
                tree.setdefault(int(ppid), []).append(int(name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, out, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), ()):
            out.add(child)
            todo.append(child)
    return out


def _alive(pids) -> set[int]:
    live = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] != "Z":
                    live.add(pid)
        except OSError:
            pass
    return live


def _wait_until(pred, limit_s: float, what: str):
    deadline = time.monotonic() + limit_s
    while not (out := pred()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return out


class _Serve:
    """`python -m cosyllama.cli serve` on a free loopback port (this checkout's package), its log collected."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        env.pop("COSYLLAMA_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cosyllama.cli", "serve", "--model-dir", str(MODEL_DIR), "--port", "0",
             "--threads", "1", "--precision", "fp32"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            if re.search(r"Uvicorn running on http://127\.0\.0\.1:\d+", line):
                self._ready.set()
        self._ready.set()

    def wait_ready(self):
        assert self._ready.wait(180) and self.proc.poll() is None, "serve did not start:\n" + "".join(self.log[-30:])

    def stderr(self) -> str:
        self._reader.join(30)
        return "".join(self.log)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def serve():
    s = _Serve()
    yield s
    s.stop()


def test_a_killed_server_leaves_no_process_behind(serve):
    """kill -9 of `cosyllama serve` (an OOM kill or a crash does the same): its text worker, and any
    other process it started, ends on its own within seconds."""
    serve.wait_ready()
    children = _wait_until(lambda: _descendants(serve.proc.pid), 60, "serve started no text worker")
    serve.proc.send_signal(signal.SIGKILL)
    serve.proc.wait(30)
    deadline = time.monotonic() + 20
    while left := _alive(children):
        assert time.monotonic() < deadline, f"processes of the killed server still run: {sorted(left)}"
        time.sleep(0.1)


def test_sigterm_stops_the_server_and_its_children_without_warnings(serve):
    serve.wait_ready()
    children = _wait_until(lambda: _descendants(serve.proc.pid), 60, "serve started no text worker")
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn raises the signal again once it has shut down
    err = serve.stderr()
    assert "Application shutdown complete" in err, err[-2000:]
    assert "leaked semaphore" not in err and "resource_tracker" not in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert not _alive(children)


# -- the text worker itself -------------------------------------------------------------------------


def test_the_text_worker_normalizes_as_wetext_does_and_stops_with_its_owner(caplog):
    from cosyllama.text.worker import WetextWorker, make_wetext_normalizers

    wetext = make_wetext_normalizers()
    worker = WetextWorker(min_chars=10)
    try:
        text = "On 12/05/2024 I paid $15.50 for 3 apples and 2kg of rice. " * 4
        assert worker.normalize("en", text) == wetext["en"].normalize(text)
        zh = "我有3个苹果，花了15元。" * 2
        assert worker.normalize("zh", zh) == wetext["zh"].normalize(zh)
        assert worker.normalize("en", "short") is None  # in place: cheaper than sending
        with pytest.raises(AssertionError):  # wetext's own failure on this text, raised again here
            worker.normalize("en", "It costs 10¢ or so. " * 2)
        pid = worker.pid
        os.kill(pid, signal.SIGKILL)  # the child dies: the caller normalizes in place, told once
        with caplog.at_level(logging.WARNING, logger="cosyllama.text"):
            assert worker.normalize("en", text) is None
        assert "normalizing in this process" in caplog.text and worker.pid is None
    finally:
        worker.close()
    dropped = WetextWorker()
    pid = dropped.pid
    del dropped  # never closed: its child stops when it is collected
    gc.collect()
    _wait_until(lambda: not _alive([pid]), 20, "the child of a dropped worker still runs")


def test_the_text_worker_dies_with_a_killed_parent(tmp_path):
    """The Python API's worker in a process killed with SIGKILL: the child notices and exits."""
    script = ("import sys, time; from cosyllama.text.worker import WetextWorker; w = WetextWorker(); "
              "print(w.pid, flush=True); time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(parent.stdout.readline())
        assert _alive([child])
        parent.kill()
        parent.wait(30)
        _wait_until(lambda: not _alive([child]), 20, "the worker outlived its killed parent")
    finally:
        parent.kill()
        parent.wait(30)
        parent.stdout.close()

"""wetext normalization in a helper process, for servers.

wetext runs its FSTs through ``kaldifst``, whose calls hold Python's GIL for their whole length:
about 1 s (up to 4 s on a busy 2-core machine) for a 4,000-character text. In a server every
other thread (the event loop, the LLM scheduler, the other requests' flow and vocoder) stops for
that long. :class:`WetextWorker` runs such texts in one child process instead (same wetext, same
output); short texts are cheaper to normalize in place than to send.

The child is ``python -m cosyllama.text.worker``, talking over its stdin and stdout (one JSON line
per text, one per answer). It dies with its parent, whatever kills the parent (``kill -9`` or an
out-of-memory kill included): it exits when its stdin reaches its end (the parent's end of the pipe
is closed with the parent) or when its parent process changes (it was adopted). Nothing of
:mod:`multiprocessing` is used, so there are no semaphores and no resource-tracker process to leave
behind. Light on purpose: the child imports only this module and wetext.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import subprocess
import sys
import threading
import weakref

log = logging.getLogger("cosyllama.text")

WORKER_MIN_CHARS = 200  # texts at least this long go to the helper process (about 50 ms of wetext)
PARENT_POLL_S = 1.0  # how often the child checks that its parent is still the one that started it


def make_wetext_normalizers() -> dict:
    """The reference's two wetext normalizers: ``"zh"`` (keeps erhua) and ``"en"``."""
    from wetext import Normalizer

    return {"zh": Normalizer(lang="auto", operator="tn", remove_erhua=False),
            "en": Normalizer(lang="auto", operator="tn")}


class WorkerError(RuntimeError):
    """wetext failed in the child with an exception that is not one of Python's built-in ones."""


def _child_error(reply: dict) -> Exception:
    """The exception the child reported, rebuilt: a built-in type by its name, else :class:`WorkerError`."""
    name, message = str(reply.get("error")), str(reply.get("message", ""))
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # a built-in exception with another signature
            pass
    return WorkerError(f"{name}: {message}")


class WetextWorker:
    """One child process (started at once; it loads its FSTs in the background) normalizing texts
    of at least ``min_chars``; :meth:`normalize` returns None for the others, or when the child has
    died (then it is not restarted: the caller normalizes in place, with the same result). One text
    is in the child at a time; other callers wait their turn."""

    def __init__(self, min_chars: int = WORKER_MIN_CHARS):
        self.min_chars = min_chars
        self._lock = threading.Lock()  # guards _proc
        self._io = threading.Lock()  # one text in flight
        # the child imports this very package, wherever it came from
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": package_root if not path else package_root + os.pathsep + path}
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "cosyllama.text.worker", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=env)
        self._finalizer = weakref.finalize(self, _reap, self._proc)  # a worker dropped unclosed stops its child

    @property
    def pid(self) -> int | None:
        """The child's process id (None once closed)."""
        proc = self._proc
        return None if proc is None else proc.pid

    def normalize(self, kind: str, text: str) -> str | None:
        """wetext's ``kind`` (``"en"``/``"zh"``) normalization of ``text`` from the child, or None.
        Raises what wetext raised in the child."""
        if len(text) < self.min_chars:
            return None
        with self._io:
            with self._lock:
                proc = self._proc
            if proc is None:
                return None
            try:
                proc.stdin.write(json.dumps({"kind": kind, "text": text}).encode() + b"\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (OSError, ValueError):  # the child is gone, or close() ran meanwhile
                line = b""
        if not line:
            if self._proc is proc:  # not closed by us
                log.warning("the text normalization process is gone (exit status %s); normalizing in this "
                            "process", proc.poll())
                self.close()
            return None
        reply = json.loads(line)
        if "text" in reply:
            return reply["text"]
        raise _child_error(reply)

    def close(self) -> None:
        """Stop the child (idempotent; returns once it has exited)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        self._finalizer.detach()
        proc.kill()  # its work is nobody's now; a text in progress is dropped
        proc.wait()
        with self._io:  # a caller reading from it has seen its end by now
            _close_pipes(proc)


def _close_pipes(proc: subprocess.Popen) -> None:
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def _reap(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    _close_pipes(proc)


__all__ = ["WORKER_MIN_CHARS", "WetextWorker", "WorkerError", "make_wetext_normalizers"]


# ----------------------------------------------------------------------------------------------
# The child


def _watch_parent(parent: int) -> None:
    """Exit this process as soon as its parent is not ``parent`` any more (it died; this one was adopted)."""
    import time

    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(PARENT_POLL_S)


def _serve(parent: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    # the answers go out on a private copy of stdout; whatever a library prints goes to stderr
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    normalizers = make_wetext_normalizers()
    for line in sys.stdin.buffer:
        ask = json.loads(line)
        try:
            reply = {"text": normalizers[ask["kind"]].normalize(ask["text"])}
        except Exception as e:  # the parent raises it again (an input error naming the text)
            reply = {"error": type(e).__name__, "message": str(e)}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    try:
        _serve(int(sys.argv[1]))
    except (BrokenPipeError, KeyboardInterrupt):  # the parent is gone
        pass


"""wetext normalization in a helper process, for servers.

wetext runs its FSTs through ``kaldifst``, whose calls hold Python's GIL for their whole length:
about 1 s (up to 4 s on a busy 2-core machine) for a 4,000-character text. In a server every
other thread (the event loop, the LLM scheduler, the other requests' flow and vocoder) stops for
that long. :class:`WetextWorker` runs such texts in one child process instead (same wetext, same
output); short texts are cheaper to normalize in place than to send.

Light on purpose: the child imports only this module and wetext.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

log = logging.getLogger("cosyllama.text")

WORKER_MIN_CHARS = 200  # texts at least this long go to the helper process (about 50 ms of wetext)

_normalizers: dict | None = None  # the child's own wetext normalizers


def make_wetext_normalizers() -> dict:
    """The reference's two wetext normalizers: ``"zh"`` (keeps erhua) and ``"en"``."""
    from wetext import Normalizer

    return {"zh": Normalizer(lang="auto", operator="tn", remove_erhua=False),
            "en": Normalizer(lang="auto", operator="tn")}


def _normalize_in_child(kind: str, text: str) -> str:
    global _normalizers
    if _normalizers is None:
        _normalizers = make_wetext_normalizers()
    return _normalizers[kind].normalize(text)


class WetextWorker:
    """One child process (started at once, in the background) normalizing texts of at least
    ``min_chars``; :meth:`normalize` returns None for the others, or when the child has died
    (then it is not restarted: the caller normalizes in place, with the same result)."""

    def __init__(self, min_chars: int = WORKER_MIN_CHARS):
        self.min_chars = min_chars
        self._lock = threading.Lock()
        # spawn, not fork: the parent runs llama.cpp, torch and uvicorn threads
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self._pool.submit(_normalize_in_child, "en", "Warm up.")  # loads the FSTs before the first request

    def normalize(self, kind: str, text: str) -> str | None:
        """wetext's ``kind`` (``"en"``/``"zh"``) normalization of ``text`` from the child, or None."""
        with self._lock:
            pool = self._pool
        if pool is None or len(text) < self.min_chars:
            return None
        try:
            future = pool.submit(_normalize_in_child, kind, text)
        except RuntimeError:  # closed meanwhile
            return None
        try:
            return future.result()
        except BrokenProcessPool as e:
            log.warning("the text normalization process is gone (%s); normalizing in this process", e)
            self.close()
            return None

    def close(self) -> None:
        """Stop the child (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["WORKER_MIN_CHARS", "WetextWorker", "make_wetext_normalizers"]

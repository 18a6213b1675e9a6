"""One synthesis as a server runs it: :class:`SynthesisJob`, advanced chunk by chunk from a thread
pool while the event loop stays free (``POST /v1/audio/speech``, ``/v1/audio/speech/stream`` and
Wyoming share it)."""

from __future__ import annotations

import logging
import threading

import numpy as np

from ..engine import AudioChunk
from ..llm.decode import CancelToken
from ..memory import trim_heap
from ..request import SynthesisRequest

log = logging.getLogger("cosyllama.server")


class SynthesisJob:
    """The synthesis of ``request`` on ``tts`` (the server's pipeline), opened, advanced and closed
    from worker threads.

    ``lock`` keeps :meth:`close` from running while a chunk is being made in another thread;
    ``token`` (a :class:`~cosyllama.llm.decode.CancelToken` passed to ``tts.run``) lets the event
    loop free the LLM sequence at once, without waiting for that chunk."""

    def __init__(self, tts, request: SynthesisRequest):
        self.tts, self.request = tts, request
        self.token = CancelToken()
        self.lock = threading.Lock()
        self.syn = None  # the Synthesis, once opened
        self._takes_logged = 0  # caught takes already in the log

    def open(self) -> None:
        """Start the synthesis (the frontend runs here; the LLM at the first chunk)."""
        with self.lock:
            self.syn = self.tts.run(self.request, cancel=self.token)
            self._opened()

    def _opened(self) -> None:
        """Called under the lock once the synthesis exists (a subclass adds what it sends with)."""

    def next_chunk(self) -> AudioChunk | None:
        """The next chunk, or None at the end; call with :attr:`lock` held. Each caught take (docs/retries.md)
        goes to the server log as its segment ends."""
        chunk = next(self.syn, None) if self.syn is not None else None
        if self.syn is not None:
            caught = self.syn.timings.retries
            for r in caught[self._takes_logged:]:
                log.warning("bad take: %s", r.describe())
            self._takes_logged = len(caught)
        return chunk

    def next(self) -> np.ndarray | None:
        """The next chunk's float32 samples, or None at the end."""
        with self.lock:
            chunk = self.next_chunk()
        return None if chunk is None else chunk.samples

    def output(self):
        """What a streamed session sends next (:mod:`cosyllama.server.session`): here the next chunk's
        float32 samples, or None at the end."""
        return self.next()

    def close(self) -> None:
        """Stop the synthesis; its LLM sequence is free when this returns. Gives the heap's free
        pages back to the OS (see :mod:`cosyllama.memory`)."""
        self.token.cancel()
        with self.lock:
            if self.syn is not None:
                self.syn.close()
            self._closed()
        trim_heap()

    def _closed(self) -> None:
        """Called under the lock when the job closes (a subclass ends what it sends with)."""


__all__ = ["SynthesisJob"]

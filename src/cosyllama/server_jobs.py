"""The server's admission gate and its per-request synthesis job (kept out of :mod:`cosyllama.server`
so the routes stay readable).

:class:`Gate` lets a fixed number of requests run and a fixed number wait; :class:`SynthesisJob`
advances one speech request chunk by chunk from the thread pool and can be stopped from the event
loop; :func:`cancel_on_disconnect` cancels a job when its client goes away.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np

from .heap import trim_heap
from .scheduler import CancelToken

# ----------------------------------------------------------------------------------------------
# Admission


class Gate:
    """At most ``limit`` requests run; up to ``queue`` more wait (FIFO); the rest are refused with
    ``on_full(message)``, the exception to raise (the server's 503)."""

    def __init__(self, limit: int, queue: int, on_full: Callable[[str], Exception]):
        self.limit, self.queue, self.on_full = limit, queue, on_full
        self.running = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(limit)

    async def acquire(self) -> None:
        if self._sem.locked() and self.waiting >= self.queue:
            raise self.on_full(f"the server is busy ({self.running} requests running, {self.waiting} waiting)")
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._sem.release()


# ----------------------------------------------------------------------------------------------
# One synthesis


class SynthesisJob:
    """One speech request's synthesis, advanced chunk by chunk from the thread pool.

    ``req`` is the request body (``input``, ``voice``, ``instructions``, ``stream``, ``speed``,
    ``greedy``, ``seed``). ``lock`` keeps ``close`` from running while a chunk is being made in
    another thread; the cancel token lets the event loop free the LLM sequence without waiting for
    that chunk.
    """

    def __init__(self, tts, req):
        self.tts, self.req = tts, req
        self.token = CancelToken()
        self.lock = threading.Lock()
        self.syn = None

    def open(self) -> None:
        from .tts import SynthesisOptions

        r, tts = self.req, self.tts
        opts = SynthesisOptions(stream=r.stream, speed=r.speed, greedy=r.greedy, seed=r.seed)
        with self.lock, self.token.bound():
            self.syn = tts.synthesize(r.input, instruction=r.instructions, voice=r.voice, options=opts)

    def next(self) -> np.ndarray | None:
        """The next chunk's samples (float32), or None at the end."""
        with self.lock, self.token.bound():
            chunk = next(self.syn, None)
        return None if chunk is None else chunk.samples

    def close(self) -> None:
        """Stop the synthesis; its LLM sequence is free when this returns. Gives the heap's free
        pages back to the OS (see :mod:`cosyllama.heap`)."""
        self.token.cancel()
        with self.lock:
            if self.syn is not None:
                self.syn.close()
        trim_heap()


async def cancel_on_disconnect(request, token: CancelToken) -> None:
    """Wait for the client (an ASGI ``request``) to go away, then cancel ``token``."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            token.cancel()
            return


__all__ = ["Gate", "SynthesisJob", "cancel_on_disconnect"]

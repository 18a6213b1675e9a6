"""Who runs now: :class:`Admission`, the one gate of a serving process. So many requests run, so many
more wait (FIFO), the rest are refused with :class:`ServerBusyError` (HTTP 503 with ``Retry-After``,
WebSocket close 1013, Wyoming ``busy``: :mod:`cosyllama.server.errors`). An HTTP request holds a slot
from its start to its last byte; a streamed utterance (WebSocket or Wyoming) from its first sentence
to its end (:mod:`cosyllama.server.session`)."""

from __future__ import annotations

import asyncio

from ..errors import CosyllamaError


class ServerBusyError(CosyllamaError, RuntimeError):
    """Every running slot of the server is taken and its queue is full; retry later."""


class Admission:
    """At most ``limit`` requests run; up to ``queue`` more wait (FIFO); the rest are refused with
    :class:`ServerBusyError`. Made inside the event loop that uses it."""

    def __init__(self, limit: int, queue: int):
        self.limit, self.queue = limit, queue
        self.running = 0
        self.waiting = 0
        self.closed: str | None = None  # why nothing is admitted any more (close())
        self._sem = asyncio.Semaphore(limit)
        self._closing = asyncio.Event()

    def close(self, why: str) -> None:
        """Admit nothing from now: the requests waiting and those to come get :class:`ServerBusyError` ``why``."""
        self.closed = why
        self._closing.set()

    async def admit(self, gone: asyncio.Future | None = None) -> bool:
        """Wait for a running slot (True); :class:`ServerBusyError` when none is free and the queue
        is full, or the gate is closed. ``gone``: a future (e.g. the task that waits for the client to leave)
        whose end takes the request out of the queue at once: False then, and no slot is held."""
        if self.closed is not None:
            raise ServerBusyError(self.closed)
        if self._sem.locked() and self.waiting >= self.queue:
            raise ServerBusyError(f"the server is busy ({self.running} requests running, {self.waiting} waiting)")
        if gone is not None and gone.done():
            return False
        self.waiting += 1
        try:
            if not self._sem.locked():
                await self._sem.acquire()
            elif not await self._acquire_unless(gone):
                return False
        finally:
            self.waiting -= 1
        self.running += 1
        return True

    async def _acquire_unless(self, gone: asyncio.Future | None) -> bool:
        """The semaphore (True), unless ``gone`` ends first (False, nothing held) or the gate closes
        (:class:`ServerBusyError`, nothing held)."""
        take = asyncio.ensure_future(self._sem.acquire())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({take, closing} | ({gone} if gone is not None else set()),
                               return_when=asyncio.FIRST_COMPLETED)
            if take.done():
                return True
            take.cancel()
            await asyncio.wait({take})
        except BaseException:  # this request was cancelled meanwhile: a slot taken after all goes back
            take.add_done_callback(self._give_back)
            take.cancel()
            raise
        finally:
            closing.cancel()
        self._give_back(take)
        if self.closed is not None:
            raise ServerBusyError(self.closed)
        return False

    def _give_back(self, take: asyncio.Future) -> None:
        if not take.cancelled() and take.exception() is None:
            self._sem.release()

    def release(self) -> None:
        self.running -= 1
        self._sem.release()


__all__ = ["Admission", "ServerBusyError"]

"""What the server's route modules share: :class:`ApiError` (answered as a JSON error body by the
handlers ``create_app`` installs, see :mod:`cosyllama.server_errors`), :func:`error_body` and the
admission gate, one per app on ``app.state.gate``. Needs the ``server`` extra."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

RETRY_AFTER_S = 1  # seconds, sent with 503


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``param`` is the request field at fault, ``code`` a short
    machine-readable reason (either may be None)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ApiError(Exception):
    """An error answered as :func:`error_body` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type, headers
        self.param, self.code = param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def busy(message: str) -> ApiError:
    return ApiError(503, message, "server_busy", {"Retry-After": str(RETRY_AFTER_S)})


class Gate:
    """At most ``limit`` requests run; up to ``queue`` more wait (FIFO); the rest get 503."""

    def __init__(self, limit: int, queue: int):
        self.limit, self.queue = limit, queue
        self.running = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(limit)

    async def acquire(self) -> None:
        if self._sem.locked() and self.waiting >= self.queue:
            raise busy(f"the server is busy ({self.running} requests running, {self.waiting} waiting); "
                       f"retry in {RETRY_AFTER_S} s")
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._sem.release()


def gate(app: FastAPI) -> Gate:
    """The app's gate (``app.state.limits``' max_concurrent and max_queue), made on first use."""
    if app.state.gate is None:  # created inside the running loop
        app.state.gate = Gate(app.state.limits.max_concurrent, app.state.limits.max_queue)
    return app.state.gate

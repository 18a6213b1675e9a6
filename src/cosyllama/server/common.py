"""What the server's route modules share: :class:`ApiError` (answered as a JSON error body by the
handlers ``create_app`` installs, see :mod:`cosyllama.server.errors`), :func:`error_body` and the
admission gate, one per app on ``app.state.gate``. Needs the ``server`` extra."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from ..defaults import RETRY_AFTER_S
from .serving import Admission as _Admission
from .serving import ServerBusyError


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


class Admission(_Admission):
    """The app's :class:`~cosyllama.server.serving.Admission`: a refusal is answered 503 with ``Retry-After``."""

    async def acquire(self, gone: asyncio.Future | None = None) -> bool:
        """A running slot (True), or False when ``gone`` (the task waiting for the client to leave)
        ended first; see :meth:`~cosyllama.server.serving.Admission.admit`."""
        try:
            return await self.admit(gone)
        except ServerBusyError as e:
            raise busy(f"{e}; retry in {RETRY_AFTER_S} s") from None


async def client_gone(request: Request) -> None:
    """Returns when the client of ``request`` has gone away (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def admission(app: FastAPI) -> Admission:
    """The app's gate (``app.state.limits``' max_concurrent and max_queue), made on first use."""
    if app.state.gate is None:  # created inside the running loop
        app.state.gate = Admission(app.state.limits.max_concurrent, app.state.limits.max_queue)
    return app.state.gate

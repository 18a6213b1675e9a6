"""What the HTTP app's routes share: its typed state (:class:`AppState`, :func:`state_of`), the admission
of a request (:func:`admit`: 503 when the server is busy) and :func:`client_gone`. Needs the ``server`` extra."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import FastAPI, Request

from ..limits import RequestLimits
from .admission import Admission
from .options import ServeOptions
from .serving import Serving


@dataclass
class AppState:
    """Everything the routes read, set once by :func:`~cosyllama.server.app.create_app`: the
    :class:`~cosyllama.server.serving.Serving` (pipeline, scheduler, gate, request limits), the HTTP
    server's own options, how voice names map to voices, and the Wyoming server while the app runs
    (``serve --wyoming``)."""

    serving: Serving
    options: ServeOptions
    voice_names: object  # a cosyllama.server.voice_names.VoiceNames
    owns_serving: bool  # create_app prepared it (closed with the app)
    wyoming: object | None = None  # the WyomingServer while the app runs

    @property
    def tts(self):
        return self.serving.tts

    @property
    def limits(self) -> RequestLimits:
        return self.serving.limits


def state_of(app: FastAPI) -> AppState:
    return app.state.server


async def admit(gate: Admission, gone: asyncio.Future | None = None) -> bool:
    """A running slot of ``gate`` (True), or False when ``gone`` (the task waiting for the client to
    leave) ended first; a full server raises :class:`~cosyllama.server.admission.ServerBusyError` (the app
    answers 503 with ``Retry-After``)."""
    return await gate.admit(gone)


async def client_gone(request: Request) -> None:
    """Returns when the client of ``request`` has gone away (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


__all__ = ["AppState", "admit", "client_gone", "state_of"]

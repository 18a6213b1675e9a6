"""Stopping a server: :class:`Shutdown`. ``cosyllama serve`` and ``cosyllama wyoming`` stop the same way on
SIGTERM (systemd, ``docker stop``, Kubernetes) or SIGINT (Ctrl+C):

1. At once, every door stops taking work: the listeners close (a new connection is refused); the admission gate
   admits nothing more (an HTTP request waiting for a slot or sent on an open connection gets 503, a streamed
   utterance waiting for one the busy error); a streamed session (WebSocket, Wyoming) takes no new utterance (its
   client is told ``server_stopping`` once what it sent before is spoken) and one with nothing to do ends now.
2. What runs drains, for at most :data:`DRAIN_S` seconds: HTTP responses, the utterances being spoken.
3. Then what is left is cut: each session's client is told ``server_stopping`` (WebSocket: close 1001), with
   :data:`FAREWELL_S` for it to leave, then every connection still open is aborted (an HTTP response cut short,
   a client that reads nothing): its work is cancelled, its slot freed.
4. The process exits with status 0. A second signal cuts at once.

:data:`DRAIN_S` + :data:`FAREWELL_S` (9 s) is within the 10 s a container manager waits by default before it
sends SIGKILL. ``serve`` runs uvicorn through :func:`draining_server`, whose signal handler begins this drain
instead of uvicorn's own stop (which closes every WebSocket at once, waits for HTTP responses without a bound,
and then raises the signal again, so the process ended with -15).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

log = logging.getLogger("cosyllama.server")

DRAIN_S = 8.0  # seconds the work running at a stop signal has to finish
FAREWELL_S = 1.0  # seconds a cut connection's last words have to leave before it is aborted
LOOK_S = 0.1  # how often the drain looks whether work is left


class StoppingDoor(Protocol):
    """What :class:`Shutdown` asks of a door beyond the serving core's sessions and gate (the HTTP listener and
    its connections, the Wyoming listener)."""

    def stop_taking_work(self) -> None:
        """Refuse new connections (and new work on open ones, where the door knows it)."""

    def busy(self) -> bool:
        """Work of this door runs."""

    def cut(self) -> None:
        """Abort every connection still open."""


class Shutdown:
    """The stop of a process serving ``serving`` (a :class:`~cosyllama.server.serving.Serving`) through
    ``doors`` (:class:`StoppingDoor`), as the module docstring says. Made in the serving's event loop;
    :meth:`ask` is the signal handler; :meth:`asked` waits for it and :meth:`drain` does the rest."""

    def __init__(self, serving, doors=(), drain_s: float = DRAIN_S):
        self.serving, self.doors, self.drain_s = serving, list(doors), drain_s
        self.loop = asyncio.get_running_loop()
        self._asked = asyncio.Event()
        self._cut = asyncio.Event()

    def ask(self) -> None:
        """A stop signal (safe in a signal handler and from any thread): the first begins the drain, the next
        cuts at once."""
        self.loop.call_soon_threadsafe(self._ask)

    def _ask(self) -> None:
        (self._cut if self._asked.is_set() else self._asked).set()

    async def asked(self) -> None:
        await self._asked.wait()

    def _busy(self) -> bool:
        return self.serving.busy() or any(door.busy() for door in self.doors)

    async def _until(self, done, seconds: float) -> None:
        """Return when ``done()`` holds, a second signal came, or ``seconds`` passed."""
        deadline = self.loop.time() + seconds
        while not done() and not self._cut.is_set() and (left := deadline - self.loop.time()) > 0:
            try:
                await asyncio.wait_for(self._cut.wait(), min(LOOK_S, left))
            except TimeoutError:
                pass

    async def drain(self) -> None:
        """Steps 1-3 of the module docstring; returns once nothing is left to wait for."""
        log.info("stopping: no new work is taken; what runs has %g s to finish (a second signal cuts it now)",
                 self.drain_s)
        for door in self.doors:
            door.stop_taking_work()
        self.serving.stop_taking_work()
        started = self.loop.time()
        await self._until(lambda: not self._busy(), self.drain_s)
        if not self._busy():
            log.info("stopping: the work that ran is done (%.1f s)", self.loop.time() - started)
            return
        log.info("stopping: cutting what still runs after %.1f s", self.loop.time() - started)
        self.serving.cut()
        self._cut.clear()
        await self._until(lambda: not self.serving.sessions, FAREWELL_S)
        for door in self.doors:
            door.cut()


def draining_server(config, app, guard):
    """A ``uvicorn.Server`` for ``config`` (a ``uvicorn.Config`` of ``app``, made by
    :func:`~cosyllama.server.app.create_app`; ``guard``: its connection guard,
    :func:`cosyllama.server.conn.guarded_protocol`) that stops as :class:`Shutdown` says, then exits normally
    (status 0). It is the HTTP door of its shutdown: its listeners, the guard's connections."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drainer: Shutdown | None = None

        def handle_exit(self, sig, frame) -> None:  # uvicorn's signal handler (SIGTERM, SIGINT)
            if self.drainer is None:  # not serving yet: nothing runs to drain
                self.should_exit = True
            else:
                self.drainer.ask()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)  # the app's lifespan (a Wyoming server) first, then the listeners
            state = app.state.server
            doors = [self] + ([state.wyoming] if state.wyoming is not None else [])
            self.drainer = Shutdown(state.serving, doors)
            self._stopping = asyncio.create_task(self._stop_when_asked())

        async def _stop_when_asked(self) -> None:
            await self.drainer.asked()
            await self.drainer.drain()
            self.should_exit = True  # uvicorn's own stop: what is left is closed within timeout_graceful_shutdown

        def stop_taking_work(self) -> None:
            for server in getattr(self, "servers", ()):
                server.close()

        def busy(self) -> bool:
            return guard.busy()

        def cut(self) -> None:
            guard.cut()

    return DrainingServer(config)


__all__ = ["DRAIN_S", "FAREWELL_S", "Shutdown", "StoppingDoor", "draining_server"]

"""The Wyoming server: listening at a URI, accepting connections within ``--max-connections``, running and
stopping (``cosyllama wyoming``: :func:`run_wyoming`; ``cosyllama serve --wyoming URI``: :func:`start_wyoming` in
the HTTP app's loop). Each connection is :mod:`cosyllama.server.wyoming`'s codec over a
:class:`~cosyllama.server.session.Session`. Needs the ``wyoming`` extra.

The protocol has no authentication, so everything a client controls is bounded
(:class:`~cosyllama.server.conn.ConnectionLimits`, the flags ``serve`` has too, and
:func:`~cosyllama.server.wyoming_wire.event_caps`): events are read by the codec, not by the `wyoming` package
(which buffers whatever a header announces): a header line and its data at most so many bytes for the event's
type, checked before they are read; an event complete within ``header_timeout`` of its first byte; no event for
``idle_timeout`` while nothing is being spoken closes the connection; a connection whose writes make no
progress for ``write_timeout`` (the one write bound of every door, :class:`~cosyllama.server.conn.WriteWatch`)
is aborted, which frees its session's sequence, flow work and slot; at most ``max_connections`` open at once.
On SIGTERM the server stops as :mod:`cosyllama.server.shutdown` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from urllib.parse import urlparse

from ..errors import InputError
from .conn import WriteWatch, bound_send_buffer
from .wyoming import Connection, Error, event_bytes
from .wyoming_service import WyomingService

log = logging.getLogger("cosyllama.wyoming")


def check_uri(uri: str) -> str:
    """``tcp://HOST:PORT`` or ``unix://PATH``, else an :class:`InputError` saying so."""
    u = urlparse(uri)
    if u.scheme == "tcp":
        try:
            port = u.port
        except ValueError:
            port = None
        if not u.hostname or port is None:
            raise InputError(f"Wyoming URI {uri!r} needs a host and a port, e.g. tcp://127.0.0.1:10200")
    elif u.scheme != "unix" or not u.path:
        raise InputError(f"Wyoming URI {uri!r} is not tcp://HOST:PORT or unix://PATH")
    return uri


def check_listen(uri: str) -> None:
    """Refuse, before a model is loaded, a ``tcp://`` address this process cannot listen at (the
    port is taken, the host is not ours): an :class:`InputError`, so ``serve --wyoming`` and
    ``wyoming`` stop with one line instead of failing in the server's start-up later."""
    from .startup import check_can_listen

    u = urlparse(check_uri(uri))
    if u.scheme == "tcp":
        check_can_listen(u.hostname, u.port, uri)


class WyomingServer:
    """A running Wyoming server (from :func:`start_wyoming`); ``address`` is where it listens. A stopping process
    (:class:`~cosyllama.server.shutdown.Shutdown`) calls :meth:`stop_taking_work`, :meth:`busy` and :meth:`cut`
    (the sessions' own stop is the serving's); :meth:`stop` ends it."""

    def __init__(self, server: asyncio.AbstractServer, service: WyomingService, address, unix_path: str | None):
        self.server, self.service, self.address, self.unix_path = server, service, address, unix_path

    def stop_taking_work(self) -> None:
        """Stop listening: a new connection is refused."""
        self.server.close()

    def busy(self) -> bool:
        return bool(self.service.connections)

    def cut(self) -> None:
        """Abort every connection still open (its last words did not go out in time)."""
        for conn in list(self.service.connections.values()):
            conn.abort()

    async def stop(self) -> None:
        """Stop listening and end every connection now: its session ends telling the client the server stops;
        a connection whose last words did not leave within :data:`~cosyllama.server.shutdown.FAREWELL_S` is
        aborted."""
        from .shutdown import FAREWELL_S

        self.stop_taking_work()
        connections = dict(self.service.connections)
        for conn in connections.values():
            conn.session.cut()
        if connections:
            _, stuck = await asyncio.wait(list(connections), timeout=FAREWELL_S)
            for task in stuck:  # a client that reads nothing: drop what it was sent
                connections[task].abort()
            if stuck:
                await asyncio.wait(stuck)
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)


async def _accept(service: WyomingService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A new connection: served, or refused with ``busy`` past ``max_connections``."""
    task = asyncio.current_task()
    limit = service.limits.max_connections
    if len(service.connections) >= limit:
        service.warn("refused a Wyoming connection: %d open, --max-connections %d", limit, limit)
        refusal = event_bytes(Error(text=f"the server has {limit} connections open, its limit (--max-connections); "
                                         "retry in a moment", code="busy").event())
        with contextlib.suppress(Exception):
            watch = WriteWatch(writer.transport, service.limits.write_timeout, lambda: "a refused Wyoming client")
            writer.write(refusal)
            watch.wrote(len(refusal))
            writer.transport.close()
        return
    bound_send_buffer(writer.transport)  # the kernel holds at most 128 KiB a client has not read (else up to MBs)
    conn = Connection(service, reader, writer)
    service.connections[task] = conn
    try:
        await conn.run()
    finally:
        service.connections.pop(task, None)
        conn.close()


async def start_wyoming(uri: str, serving) -> WyomingServer:
    """Listen at ``uri`` in the running event loop and answer the Wyoming protocol from ``serving``
    (a :class:`~cosyllama.server.serving.Serving`: its pipeline, admission gate, default voice, the
    synthesis options of every request (always streaming) and the connection limits). A TCP port 0
    listens on a free port (see ``address``)."""
    check_uri(uri)
    service = WyomingService(serving)
    u = urlparse(uri)
    line_cap = max(service.caps.values())  # the reader buffers at most about this much of a header line

    async def accept(reader, writer):
        await _accept(service, reader, writer)

    unix_path = None
    try:
        if u.scheme == "unix":
            unix_path = u.path
            with contextlib.suppress(FileNotFoundError):
                os.unlink(unix_path)
            server = await asyncio.start_unix_server(accept, path=unix_path, limit=line_cap)
        else:
            server = await asyncio.start_server(accept, host=u.hostname, port=u.port, limit=line_cap)
    except OSError as e:  # e.g. the port is taken
        raise InputError(f"cannot listen at {uri}: {e.strerror or e}") from e
    sockets = server.sockets or ()
    address = sockets[0].getsockname() if sockets else uri
    return WyomingServer(server, service, address, unix_path)


def run_wyoming(options, uri: str) -> None:
    """Run ``cosyllama wyoming`` at ``uri`` until interrupted; ``options``: a
    :class:`~cosyllama.server.startup.ServingOptions` (the start-up is the one ``serve`` has)."""
    from .serving import prepare
    from .shutdown import Shutdown
    from .startup import log_start, ready, start

    uri = check_uri(uri)
    models, voices = start(options, lambda: check_listen(uri))
    serving = prepare(models, options, voices=voices)
    ready(serving)  # after prepare: the store has its encoder by then, so voice folders warm too

    async def main():
        server = await start_wyoming(uri, serving)
        log_start(options.load, voices, uri)
        shutdown = Shutdown(serving, [server])
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # systemd, docker stop, Ctrl+C: drain, then stop
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, shutdown.ask)
        try:
            await shutdown.asked()
            await shutdown.drain()
        finally:
            await server.stop()
        log.info("Wyoming server stopped")

    try:
        asyncio.run(main())
    finally:
        serving.close()


__all__ = ["WyomingServer", "check_listen", "check_uri", "run_wyoming", "start_wyoming"]

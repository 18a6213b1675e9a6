"""Slow clients and open connections: the limits uvicorn lacks, as its HTTP protocol class.

uvicorn waits for ever for a request's headers and body, for a client to read its response, and
never refuses a connection: clients trickling a byte a second, or reading nothing, hold a
descriptor (and a request's slot) each for as long as they like. :func:`guarded_protocol` makes
uvicorn's own protocol class (h11's, or httptools' when that is installed) with these bounds
(:class:`ConnectionLimits`):

* the headers of a request must be complete within ``header_timeout`` seconds of its first byte
  (of the connection, for its first request);
* its body within ``body_timeout`` seconds of its headers (whatever the rate: a trickle cannot
  stretch it by sending a byte now and then);
* the one write bound of every door (:class:`WriteWatch`): a connection whose bytes wait to be sent
  (the client reads nothing) for ``write_timeout`` seconds without one more of them leaving is
  aborted: the connection is dropped and the route or session sees the client gone (its synthesis
  is cancelled, its slot freed). A slow reader is never cut as long as it reads something now and
  then; no write has a deadline of its own. The socket's send buffer is :data:`SEND_BUFFER_BYTES`,
  so the writes stall soon after the client stops reading; the watch covers an upgraded connection
  (a WebSocket) too, and the Wyoming server watches its connections with the same class;
* a connection with no request in progress is closed after ``idle_timeout`` seconds (uvicorn's
  keep-alive timeout, set from it);
* at most ``max_connections`` connections are open; one more gets 503 with ``Retry-After`` at once
  and is closed once the client has read it (or after :data:`REFUSED_LINGER_S`); what it sent is
  read and dropped first, so that closing does not reset the connection under the 503.

A request over the header or body timeout gets 408 when no response to it has started, and its
connection is closed; the route reading the body sees the client gone. uvicorn's WebSocket keepalive
pings are off (:func:`uvicorn_options`): a ping waits behind the audio a client has not read yet, so its
pong came too late from a slow reader that was still reading, and uvicorn closed it (1011); a client that
is gone is found by the write bound while audio is sent and by ``--idle-timeout`` otherwise. For a
server's stop, the guard's class knows its connections with a request in progress and aborts what is
left at the end of the drain (:meth:`GuardedProtocol.busy`, :meth:`GuardedProtocol.cut`,
:mod:`cosyllama.server.shutdown`). Needs the ``server`` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields

from ..defaults import RETRY_AFTER_S
from ..errors import InputError

log = logging.getLogger("cosyllama.server")

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0  # a 10 MB prompt upload at 1.5 Mbit/s
MAX_CONNECTIONS = 256
WRITE_TIMEOUT_S = 60.0  # a response that makes no progress this long is aborted (a slow link still drains)
IDLE_TIMEOUT_S = 30.0  # a connection with no request (HTTP keep-alive, Wyoming between events) this long is closed
REFUSED_LINGER_S = 1.0  # a connection refused at the cap is closed this long after its 503 at the latest
# a connection's kernel send buffer (SO_SNDBUF; Linux doubles it for its own bookkeeping): what a
# client has not read waits there, so a client that stops reading stalls the server's writes once
# this much (2.7 s of 24 kHz 16-bit pcm) and the transport's own buffer wait, not after the megabytes
# an unbounded buffer takes (on loopback ~4 MB, 90 s of pcm). Every door sets it: HTTP and the
# WebSocket here (an upgraded connection keeps its socket), Wyoming on accepting.
SEND_BUFFER_BYTES = 128 * 1024

# what each bound means, for `serve --help` (the flag is --<name with dashes>)
CONNECTION_HELP = {
    "header_timeout": "seconds a client may take to send a request's headers (from its first byte)",
    "body_timeout": "seconds a client may take to send a request's body (from its headers), whatever "
                    "its rate",
    "max_connections": "open connections; one more is refused at once (HTTP: 503 with Retry-After)",
    "write_timeout": "seconds a response may make no progress (the client reads nothing) before it is aborted "
                     "and its request's work and slot are freed",
    "idle_timeout": "seconds a connection may stay open with no request in progress before it is closed",
}


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds on what a client may hold open; see the module docstring."""

    header_timeout: float = HEADER_TIMEOUT_S
    body_timeout: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    write_timeout: float = WRITE_TIMEOUT_S
    idle_timeout: float = IDLE_TIMEOUT_S

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
                raise InputError(f"--{f.name.replace('_', '-')} must be a number > 0, got {v!r}")
        if not isinstance(self.max_connections, int):
            raise InputError(f"--max-connections must be an integer, got {self.max_connections!r}")


def _raw_response(status: int, reason: str, message: str, type: str, code: str,
                  headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 answer, written before (or instead of) the app's, with the app's error body."""
    from .errors import error_body  # here: the options import this module, and errors.py what requests need

    body = json.dumps(error_body(message, type, code=code)).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n{extra}"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


class WriteWatch:
    """The write bound of every door, on progress: once bytes written to ``transport`` wait to leave (its
    buffer is not empty), it is looked at every second at most; when none of them has left for
    ``write_timeout`` seconds (the client reads nothing), the connection is aborted and one line says so
    (``who()``: the client, e.g. ``HTTP 127.0.0.1:5000``). A client that reads, however slowly, is never
    cut. The door tells it what it writes (:meth:`wrote`; :meth:`arm` after a close, whose bytes must leave
    too) and :meth:`stop` when the connection is lost."""

    def __init__(self, transport, write_timeout: float, who: Callable[[], str],
                 loop: asyncio.AbstractEventLoop | None = None):
        self.transport, self.write_timeout, self.who = transport, write_timeout, who
        self.loop = loop or asyncio.get_running_loop()
        self.check_s = min(1.0, write_timeout / 4)  # a stalled connection is aborted at most this late
        self.written = 0
        self._look = None  # the next look, while bytes wait
        self._mark = self._since = 0
        self._stopped = False

    def wrote(self, n: int) -> None:
        self.written += n
        self.arm()

    def sent(self) -> int:
        """Bytes that have left (reached the kernel): those written less those still buffered."""
        return self.written - self.transport.get_write_buffer_size()

    def arm(self) -> None:
        """Watch the bytes waiting now, if any (the next write that has to wait starts it again)."""
        if self._look is None and not self._stopped and self.transport.get_write_buffer_size():
            self._mark, self._since = self.sent(), self.loop.time()
            self._look = self.loop.call_later(self.check_s, self._check)

    def stop(self) -> None:
        self._stopped = True
        if self._look is not None:
            self._look.cancel()
            self._look = None

    def _check(self) -> None:
        self._look = None
        if self._stopped or not self.transport.get_write_buffer_size():
            return
        now, sent = self.loop.time(), self.sent()
        if sent != self._mark:
            self._mark, self._since = sent, now
        elif now - self._since >= self.write_timeout:
            log.info("aborted the connection of %s: it read nothing for %g s (--write-timeout)", self.who(),
                     self.write_timeout)
            self.stop()
            self.transport.abort()  # the door sees the connection lost; the route or session, its client gone
            return
        self._look = self.loop.call_later(self.check_s, self._check)


class _CountedTransport:
    """A transport that tells its :class:`WriteWatch` what is written to it and when it is closed; the rest
    is the transport's."""

    def __init__(self, transport, watch: WriteWatch, on_close=None):
        self._transport = transport
        self._watch = watch
        self._on_close = on_close  # returns True when it closes the transport itself, later

    def write(self, data) -> None:
        self._transport.write(data)
        self._watch.wrote(len(data))

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def close(self) -> None:
        if self._on_close is None or not self._on_close():
            self._transport.close()
        self._watch.arm()  # what is still buffered must leave within the write timeout too

    def __getattr__(self, name):
        return getattr(self._transport, name)


def bound_send_buffer(transport) -> None:
    """Set the kernel send buffer of ``transport``'s socket to :data:`SEND_BUFFER_BYTES` (a transport
    without a socket, or a socket that refuses, is left as it is)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


def guarded_protocol(limits: ConnectionLimits, base: type | None = None) -> type:
    """``base`` (default: the HTTP protocol uvicorn's ``http="auto"`` picks) with ``limits``; give
    it to uvicorn as ``http=``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    full = _raw_response(503, "Service Unavailable", f"the server has {limits.max_connections} connections open, "
                         f"its limit (--max-connections); retry in {RETRY_AFTER_S} s", "server_busy",
                         "too_many_connections", {"retry-after": str(RETRY_AFTER_S)})
    lingering = set()  # refused connections waiting for their client to read the 503 and close
    live = weakref.WeakSet()  # every connection (an upgraded one lives as long as its WebSocket)

    class GuardedProtocol(base):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.timeout_keep_alive = limits.idle_timeout  # uvicorn's keep-alive timer, on both protocols

        def connection_made(self, transport) -> None:
            bound_send_buffer(transport)
            self._timer = None  # the running deadline, if any
            self._timer_kind = None
            self._seen = None  # the request whose headers were complete last
            self._lost = self._dropping = False  # _dropping: what the client sends is read and dropped
            self._watch = WriteWatch(transport, limits.write_timeout, self._who, self.loop)
            self._counted = _CountedTransport(transport, self._watch, self._close_after_the_body)
            super().connection_made(self._counted)
            live.add(self)
            if len(self.connections) > limits.max_connections:
                self._refuse()
                return
            self._arm("header")

        def data_received(self, data: bytes) -> None:
            if self._dropping:
                return  # read and dropped: closing with unread bytes would reset the connection
            if self._timer is None and self._between_requests():
                self._arm("header")  # the first bytes of a next request on a kept-alive connection
            super().data_received(data)
            self._track()

        def eof_received(self):
            if self._dropping:
                self.transport.close()
                return None
            return super().eof_received()

        def connection_lost(self, exc) -> None:
            self._lost = True
            self._disarm()
            self._watch.stop()
            lingering.discard(self)
            super().connection_lost(exc)

        def handle_websocket_upgrade(self, *args) -> None:
            self._disarm()  # the connection is a WebSocket's now: its protocol bounds it (not an HTTP request's)
            super().handle_websocket_upgrade(*args)

        def _close_after_the_body(self) -> bool:
            """uvicorn closes the connection while the request's body is still coming (a 413 answered
            by its Content-Length, before reading it): closing now, with unread bytes, would reset the
            connection, and a client still sending its body would never read the answer. Instead our
            side is shut (the answer leaves first), what the client sends is read and dropped, and the
            connection closes when the client closes or after REFUSED_LINGER_S. True: closing is ours."""
            c = self.cycle
            if self._lost or self._dropping or c is None or not c.more_body:
                return False
            raw = self._counted._transport
            if raw.is_closing() or not raw.can_write_eof():
                return False
            self._dropping = True
            self._disarm()
            raw.resume_reading()  # uvicorn may have paused reading the body it did not want
            self._linger(raw)
            return True

        def _linger(self, raw) -> None:
            """Shut our side (what was written leaves first) and close when the client closes or after
            REFUSED_LINGER_S, reading and dropping what it sends meanwhile (``_dropping``)."""
            raw.write_eof()
            self._timer = self.loop.call_later(REFUSED_LINGER_S, raw.close)

        # -- refusing a connection past the cap ------------------------------------------------

        def _refuse(self) -> None:
            self._dropping = True  # no request of this connection is served
            log.warning("refused a connection: %d open, --max-connections %d", len(self.connections) - 1,
                        limits.max_connections)
            self.transport.write(full)
            if len(lingering) >= limits.max_connections:  # a flood: no time for each to read its answer
                self.transport.close()
                return
            lingering.add(self)
            if self.transport.can_write_eof():
                self._linger(self._counted._transport)  # the client reads the 503, then its end of the stream
            else:
                self._timer = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

        # -- the write bound and the server's stop ------------------------------------------

        def _upgraded(self) -> bool:
            return self._counted.get_protocol() is not self

        def _who(self) -> str:
            client = "%s:%d" % self.client if self.client else "a client"
            return f"{'WebSocket' if self._upgraded() else 'HTTP'} {client}"

        @classmethod
        def busy(cls) -> bool:
            """An HTTP request is in progress on some connection (a WebSocket's work is its session's)."""
            return any(not p._lost and not p._upgraded() and p.cycle is not None and not p.cycle.response_complete
                       for p in list(live))

        @classmethod
        def cut(cls) -> None:
            """Abort every connection still open (the end of a server's drain: a response still being sent, a
            WebSocket whose last words did not go out)."""
            for p in list(live):
                if not p._lost and not p._counted.is_closing():
                    p._counted.abort()

        # -- the header and body timeouts --------------------------------------------------------

        def _between_requests(self) -> bool:
            c = self.cycle
            return c is None or (c is self._seen and c.response_complete and not c.more_body)

        def _track(self) -> None:
            if self._counted.get_protocol() is not self:  # upgraded (a WebSocket): its protocol has the connection
                self._disarm()
                return
            c = self.cycle
            if c is not None and c is not self._seen:  # a request's headers are complete
                self._seen = c
                self._disarm()
                if c.more_body:
                    self._arm("body")
            elif c is not None and self._timer_kind == "body" and not c.more_body:
                self._disarm()

        def _arm(self, kind: str) -> None:
            self._disarm()
            seconds = limits.header_timeout if kind == "header" else limits.body_timeout
            self._timer = self.loop.call_later(seconds, self._expire, kind, seconds)
            self._timer_kind = kind

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._timer_kind = None

        def _expire(self, kind: str, seconds: float) -> None:
            self._timer = self._timer_kind = None
            if self.transport.is_closing():
                return
            client = "%s:%d" % self.client if self.client else "a client"
            log.info("closed the connection of %s: its request %s took more than %g s (--%s-timeout)", client,
                     "headers" if kind == "header" else "body", seconds, kind)
            c = self.cycle
            if kind == "header" or c is None or not c.response_started:
                flag = f"--{kind}-timeout"
                self.transport.write(_raw_response(
                    408, "Request Timeout", f"the request's {'headers' if kind == 'header' else 'body'} did not "
                    f"arrive within {seconds:g} s ({flag})", "invalid_request_error", "request_timeout"))
            self.transport.close()

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    GuardedProtocol.limits = limits
    return GuardedProtocol


def uvicorn_options(limits: ConnectionLimits) -> dict:
    """The ``uvicorn.run`` / ``uvicorn.Config`` arguments that apply ``limits``: the guarded protocol, and no
    WebSocket keepalive pings (the module docstring says why)."""
    return {"http": guarded_protocol(limits), "ws_ping_interval": None, "ws_ping_timeout": None}


__all__ = ["CONNECTION_HELP", "SEND_BUFFER_BYTES", "ConnectionLimits", "WriteWatch", "bound_send_buffer",
           "guarded_protocol", "uvicorn_options"]

"""Slow clients and open connections: the limits uvicorn lacks, as its HTTP protocol class.

uvicorn drops an idle keep-alive connection (``timeout_keep_alive``) but waits for ever for a
request's headers and body, and never refuses a connection: clients trickling a byte a second
hold a descriptor each for as long as they like. :func:`guarded_protocol` makes uvicorn's own
protocol class (h11's, or httptools' when that is installed) with three bounds
(:class:`ConnectionLimits`):

* the headers of a request must be complete within ``header_timeout`` seconds of its first byte
  (of the connection, for its first request);
* its body within ``body_timeout`` seconds of its headers (whatever the rate: a trickle cannot
  stretch it by sending a byte now and then);
* at most ``max_connections`` connections are open; one more gets 503 at once and is closed.

A request over a timeout gets 408 when no response to it has started, and its connection is
closed; the route reading the body sees the client gone. Needs the ``server`` extra.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields

from ..errors import InputError

log = logging.getLogger("cosyllama.server")

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0  # a 10 MB prompt upload at 1.5 Mbit/s
MAX_CONNECTIONS = 256
WRITE_TIMEOUT_S = 60.0  # a response that makes no progress this long is aborted (a slow link still drains)
IDLE_TIMEOUT_S = 30.0  # a connection with no request (HTTP keep-alive, Wyoming between events) this long is closed

# what each bound means, for `serve --help` (the flag is --<name with dashes>)
CONNECTION_HELP = {
    "header_timeout": "seconds a client may take to send a request's headers (from its first byte)",
    "body_timeout": "seconds a client may take to send a request's body (from its headers), whatever "
                    "its rate",
    "max_connections": "open connections; one more is answered 503 and closed",
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

    @classmethod
    def from_args(cls, args) -> ConnectionLimits:
        given = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        return cls(**{k: v for k, v in given.items() if v is not None})


def _raw_response(status: int, reason: str, message: str, type: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode("ascii") + body


def guarded_protocol(limits: ConnectionLimits, base: type | None = None) -> type:
    """``base`` (default: the HTTP protocol uvicorn's ``http="auto"`` picks) with ``limits``; give
    it to uvicorn as ``http=``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    full = _raw_response(503, "Service Unavailable", f"the server has {limits.max_connections} connections open, "
                         "its limit (--max-connections); retry in a moment", "server_busy", "too_many_connections")

    class GuardedProtocol(base):
        def connection_made(self, transport) -> None:
            self._timer = None  # the running deadline, if any
            self._timer_kind = None
            self._seen = None  # the request whose headers were complete last
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.warning("refused a connection: %d open, --max-connections %d", len(self.connections) - 1,
                            limits.max_connections)
                transport.write(full)
                transport.close()
                return
            self._arm("header")

        def data_received(self, data: bytes) -> None:
            if self._timer is None and self._between_requests():
                self._arm("header")  # the first bytes of a next request on a kept-alive connection
            super().data_received(data)
            self._track()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_websocket_upgrade(self, *args) -> None:
            self._disarm()  # the connection is a WebSocket's now: its protocol bounds it (not an HTTP request's)
            super().handle_websocket_upgrade(*args)

        def _between_requests(self) -> bool:
            c = self.cycle
            return c is None or (c is self._seen and c.response_complete and not c.more_body)

        def _track(self) -> None:
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
            log.info("closed the connection of %s: its request %s took more than %g s", client,
                     "headers" if kind == "header" else "body", seconds)
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
    """The ``uvicorn.run`` / ``uvicorn.Config`` arguments that apply ``limits``."""
    return {"http": guarded_protocol(limits)}


__all__ = ["CONNECTION_HELP", "ConnectionLimits", "guarded_protocol", "uvicorn_options"]

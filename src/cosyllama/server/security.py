"""Who may call the server: an ASGI middleware that refuses cross-origin state changes and, when
an API key is set, requests without it. Both answers come before the request body is read.

* **Origin**: a browser sends ``Origin`` with every cross-origin POST, also the "simple" ones (a
  multipart form) that need no CORS preflight, so any web page the operator opens could register
  or replace a voice on a server it can reach. A ``POST``, ``PUT``, ``PATCH`` or ``DELETE``
  carrying an ``Origin`` that is not one of ``allow_origins`` gets 403; requests without one
  (curl, SDKs, other servers) pass. With origins allowed, ``create_app`` also answers their CORS
  preflights (Starlette's ``CORSMiddleware``), so a web app at one of them can call the API.
  The server's own origin passes too (its web page, ``/docs``): an ``Origin`` whose host is the
  request's ``Host``, when that host is an IP address or ``localhost`` (a DNS name could be an
  attacker's, rebound to this server's address: give it with ``allow_origins``) or when an API
  key is set (a rebound page does not have it).
* **API key**: with ``api_key`` set, every request but ``GET /health`` (load balancers probe it
  without credentials) and the static web page needs ``Authorization: Bearer <key>``, the header
  the OpenAI SDK sends for its ``api_key``; else 401. The key is compared in constant time.
* **WebSockets** (``/v1/audio/speech/stream``): the handshake is checked like a state-changing
  request (a browser sends ``Origin`` with it and no CORS check applies) and needs the key too;
  a refusal is answered with the same status and JSON body before the socket opens.

Needs the ``server`` extra.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
from collections.abc import Iterable

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from ..defaults import API_KEY_ENV
from ..errors import InputError
from .client_json import clip_param
from .errors import error_body, log_refusal

OPEN_PATHS = frozenset({"/health"})  # answered without the API key
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
WEBSOCKET = "WebSocket"  # what a WebSocket handshake is called in the refusals (it is a GET)
ORIGIN_CHECKED = STATE_CHANGING | {WEBSOCKET}
_ORIGIN_RE = re.compile(r"^(https?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:\d{1,5})?$")


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` in lower case, the form browsers send; refuses anything else
    (a path, a wildcard, a missing scheme) with :class:`ValueError`."""
    o = origin.strip().rstrip("/").lower()
    if not _ORIGIN_RE.match(o):
        raise ValueError(f"{origin!r} is not an origin; give scheme://host[:port], "
                         "e.g. https://app.example.com or http://localhost:3000 (no path, no wildcard)")
    return o


def _error(status: int, message: str, type: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, code=code), status_code=status, headers=headers)


class RequestGuard:
    """ASGI middleware: the origin and API-key checks described in the module docstring."""

    def __init__(self, app, api_key: str | None = None, allow_origins: Iterable[str] = (),
                 open_paths: Iterable[str] = ()):
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key is empty")
        self.app = app
        self._key = None if api_key is None else api_key.strip().encode()
        self.allow_origins = frozenset(normalize_origin(o) for o in allow_origins)
        self.open_paths = OPEN_PATHS | frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":  # a WebSocket is used, not read: checked like a state-changing request
            refusal = self._check(WEBSOCKET, scope["path"], Headers(scope=scope))
            if refusal is not None:
                _log(WEBSOCKET, scope, refusal)
                return await _refuse_websocket(refusal, scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = self._check(scope["method"], scope["path"], headers)
        if refusal is not None:
            _log(scope["method"], scope, refusal)
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)

    def _check(self, method: str, path: str, headers: Headers) -> JSONResponse | None:
        origin = headers.get("origin")
        if (method in ORIGIN_CHECKED and origin is not None and origin.lower() not in self.allow_origins
                and not self._same_origin(origin, headers.get("host"))):
            allowed = ", ".join(sorted(self.allow_origins)) or "none"
            return _error(403, f"cross-origin {method} from {origin!r} refused: this server takes "
                               f"state-changing requests only from the origins given to --allow-origin "
                               f"({allowed}), from its own origin when addressed by IP address or localhost "
                               f"(or with an API key), or from clients that send no Origin header",
                          "permission_error", "origin_not_allowed")
        if self._key is None or (path in self.open_paths and method in ("GET", "HEAD")):
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _error(401, "no API key: send it as the header 'Authorization: Bearer <key>' "
                               "(the OpenAI SDK does this for its api_key)",
                          "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), self._key):
            return _error(401, "incorrect API key", "invalid_request_error", "invalid_api_key",
                          {"WWW-Authenticate": "Bearer"})
        return None


    def _same_origin(self, origin: str, host: str | None) -> bool:
        """Whether ``origin`` is this server as the client addressed it (``Host``), by a name no
        one else's page can have (see the module docstring)."""
        if not host:
            return False
        scheme, sep, netloc = origin.lower().partition("://")
        if not sep or scheme not in ("http", "https") or netloc != host.lower():
            return False
        if self._key is not None:
            return True
        name = netloc.rsplit(":", 1)[0] if not netloc.endswith("]") else netloc
        if name == "localhost":
            return True
        try:
            ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            return False
        return True


def _log(method: str, scope, refusal: JSONResponse) -> None:
    """The operator's line for a refused request: its status and code, not its message (which quotes the
    client's Origin header whole)."""
    client = scope.get("client")
    code = json.loads(refusal.body)["error"]["code"]
    log_refusal(f"{method} {clip_param(scope['path'])}", f"{client[0]}:{client[1]}" if client else "a client",
                f"{refusal.status_code} {code}")


def has_api_key(headers, api_key: str | None) -> bool:
    """Whether a request carries ``api_key`` (``Authorization: Bearer <key>``, compared in constant
    time); True when no key is set (every caller may see everything)."""
    if api_key is None:
        return True
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.strip().encode())


async def _refuse_websocket(refusal: JSONResponse, scope, receive, send) -> None:
    """Answer a WebSocket handshake with ``refusal`` (its status and JSON body) where the server
    can (ASGI's denial-response extension, uvicorn's), else close it unaccepted (HTTP 403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        await refusal(scope, receive, send)  # Starlette sends a response's messages with the websocket. prefix
    else:
        await send({"type": "websocket.close", "code": 1008})


def add_guard(app, api_key: str | None, allow_origins: Iterable[str], open_paths: Iterable[str] = ()) -> None:
    """Install the guard on a FastAPI ``app`` (call it after the other middleware: it must run
    first), and, with origins allowed, CORS answers for them in front of it. ``open_paths``: paths
    that ``GET`` without the API key too (the static web page)."""
    origins = sorted({normalize_origin(o) for o in allow_origins})
    if api_key is not None and not api_key.strip():  # the middleware is built at the first request
        raise ValueError("the API key is empty")
    app.add_middleware(RequestGuard, api_key=api_key, allow_origins=origins, open_paths=tuple(open_paths))
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
                           expose_headers=["X-Request-ID"], max_age=600)


def guard_options(api_key: str | None, allow_origin=()) -> tuple[str | None, list[str]]:
    """``cosyllama serve``'s API key (``api_key``: ``--api-key``, else ``$COSYLLAMA_API_KEY``, else None)
    and allowed origins (``allow_origin``: ``--allow-origin``, repeatable), checked."""
    key = api_key
    where = "--api-key"
    if key is None:
        key, where = os.environ.get(API_KEY_ENV), f"${API_KEY_ENV}"
    if key is not None and not key.strip():
        raise InputError(f"{where} is empty; give a key (e.g. `openssl rand -hex 32`) or leave it unset")
    try:
        origins = [normalize_origin(o) for o in allow_origin or ()]
    except ValueError as e:
        raise InputError(f"--allow-origin: {e}") from None
    return key, origins

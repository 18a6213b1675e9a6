"""One mapping from the project's exceptions to what each door answers (no door's dependencies).

A route, a codec or a check just raises the project's exceptions (a door's own rule is a :class:`Refusal`);
the HTTP app's handlers, the WebSocket codec and the Wyoming codec all answer them through :func:`api_error`.

:func:`api_error` classifies an exception once, as an HTTP status and OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``, :func:`error_body`); the streamed doors derive
their answer from it: :func:`websocket_error` (an ``error`` message and the close code after it) and
:func:`wyoming_error` (an ``error`` event's text and code). A failure that is the server's is logged
with its traceback and answered :data:`INTERNAL_ERROR`, which names nothing of the server's files,
libraries or exceptions. A client's own strings quoted back in a message are cut to 64 characters
(:func:`cosyllama.server.client_json.clip`).

How a field is named depends on the door (``input`` over HTTP, ``text`` in a WebSocket's
``input.text`` or a Wyoming event): the ``names`` tables of :mod:`cosyllama.request`.

=================================  ==========  =============================  =========  ==================
exception                          HTTP        code                           WebSocket  Wyoming code
=================================  ==========  =============================  =========  ==================
:class:`Refusal` (a door's rule)   its status  its code                       its close  its code
                                                                              (1008)
:class:`ServerBusyError`, a full   503         ``server_busy``                1013       ``busy``
scheduler or backend
:class:`LimitExceeded`             413         ``string_above_max_length``,   1008       ``limit_exceeded``
                                               ``context_length_exceeded``
:class:`RequestError`              422         its code                       1008       ``invalid_input``,
                                                                                         ``empty_text``
:class:`UnknownVoiceError`         404         ``voice_not_found``            1008       ``voice_not_found``
other :class:`InputError`          422         (none)                         1008       ``invalid_input``
other :class:`CosyllamaError`      400         (none)                         1008       ``invalid_request``
anything else                      500         ``internal_error``             1011       ``internal_error``
=================================  ==========  =============================  =========  ==================

A refusal closes a WebSocket with 1008, but a message too large (1009) and a server that stops (1001,
``server_stopping``, :func:`cosyllama.server.session.stopping_refusal`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..defaults import RETRY_AFTER_S
from ..errors import BackendBusyError, CosyllamaError, InputError
from ..limits import LimitExceeded
from ..llm.scheduler import SchedulerBusyError
from ..request import HTTP_NAMES, RequestError
from ..voices import NAMED_IDS, SHOWN_ID_CHARS, UnknownVoiceError
from .admission import ServerBusyError

log = logging.getLogger("cosyllama.server")

# what a client is told of a failure that is the server's (HTTP 500, WebSocket 1011, Wyoming's
# internal_error): nothing of its files, libraries or exceptions, which go to the log
INTERNAL_ERROR = "internal error; the server's log has the details"

# characters of a refusal's message its log line keeps (the message is what the client was told, its own
# strings in it already cut to 64 characters; this only keeps the line short)
LOGGED_MESSAGE_CHARS = 200

# WebSocket close codes (RFC 6455, 7.4.1): 1001 "going away" is a server that stops
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_REFUSED, CLOSE_TOO_BIG = 1000, 1001, 1008, 1009
CLOSE_FAILED, CLOSE_BUSY = 1011, 1013


# OpenAI's error type of each HTTP status the server answers with (any other: invalid_request_error)
ERROR_TYPES = {403: "permission_error", 404: "not_found_error", 409: "conflict_error", 413: "request_too_large",
               500: "internal_error", 503: "server_busy"}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, the one every answer of the server carries (the app's, the connection guard's
    and the middleware's): ``param`` is the request field at fault, ``code`` a short machine-readable reason
    (either may be None)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Refusal(InputError):
    """A request a door refuses by its own rules (a malformed message, an unknown type, a stream
    without its start, a field a route does not take ...): answered with ``code`` (and HTTP ``status``, a
    WebSocket ``close`` code, the request field ``param``). A route just raises it: the app answers it through
    :func:`api_error`."""

    def __init__(self, message: str, code: str | None, *, status: int = 400, close: int = CLOSE_REFUSED,
                 param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.status, self.close, self.param = message, code, status, close, param


class ApiError(Exception):
    """What :func:`api_error` makes of an exception: an answer of :func:`error_body` with an HTTP status
    (``type``: by default the status's, :data:`ERROR_TYPES`)."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 headers: dict[str, str] | None = None, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.param, self.code = param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def busy(message: str) -> ApiError:
    """503 with ``Retry-After``; its ``code`` is ``server_busy``, as the WebSocket's ``error`` says."""
    return ApiError(503, message, "server_busy", {"Retry-After": str(RETRY_AFTER_S)}, code="server_busy")


def server_failure() -> ApiError:
    """What a client is told of a failure that is the server's: 500 :data:`INTERNAL_ERROR` (the log has what
    failed)."""
    return ApiError(500, INTERNAL_ERROR, "internal_error")


# the request field a limit's refusal points at: a voice's transcript came with the voice
_LIMIT_PARAM = {"input": "input", "instructions": "instructions", "transcript": "voice", "sequence": "input",
                "session": "input"}


def limit_error(e: LimitExceeded, param: str | None = None) -> ApiError:
    """413 for a request over one of its :class:`~cosyllama.limits.RequestLimits`; ``param``
    overrides the field named (e.g. ``text`` for a voice registration's transcript). The code is
    OpenAI's: ``context_length_exceeded`` for the LLM's per-sequence budget, else
    ``string_above_max_length``."""
    code = "context_length_exceeded" if e.field == "sequence" else "string_above_max_length"
    return ApiError(413, str(e), "request_too_large", param=param or _LIMIT_PARAM.get(e.field), code=code)


def api_error(e: BaseException, names: Mapping[str, str] = HTTP_NAMES) -> ApiError:
    """What ``e`` is to a client, as an HTTP answer (see the module's table); ``names``: how the
    door names the request's fields. A failure of the server is logged here."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Refusal):
        return ApiError(e.status, e.message, param=e.param, code=e.code)
    if isinstance(e, ServerBusyError):
        return busy(f"{e}; retry in {RETRY_AFTER_S} s")
    if isinstance(e, (SchedulerBusyError, BackendBusyError)):
        return busy(str(e))
    if isinstance(e, LimitExceeded):
        text_param = names.get("text", "input")
        return limit_error(e, param=text_param if e.field in ("input", "session", "sequence") else None)
    if isinstance(e, RequestError):  # a synthesis rule, said in the door's field names
        return ApiError(422, e.render(names), param=e.name(names), code=e.code)
    if isinstance(e, UnknownVoiceError):  # the one not-found of every door (server/voice_names.py)
        return ApiError(404, str(e), "not_found_error", param="voice", code="voice_not_found")
    if isinstance(e, InputError):
        return ApiError(422, str(e))
    if isinstance(e, CosyllamaError):
        return ApiError(400, str(e))
    log.error("synthesis failed", exc_info=e)  # what failed is for the operator, not the client
    return server_failure()


def websocket_error(e: BaseException, names: Mapping[str, str]) -> tuple[dict, int]:
    """The WebSocket ``error`` message answering ``e`` and the close code after it."""
    if isinstance(e, Refusal):
        return {"type": "error", "message": e.message, "code": e.code, "param": e.param}, e.close
    err = api_error(e, names)
    if err.status >= 500 and err.status != 503:
        return ({"type": "error", "message": "synthesis failed (an error in the server; its log has the details)",
                 "code": "internal_error", "param": None}, CLOSE_FAILED)
    code = err.code or err.type
    return ({"type": "error", "message": err.message, "code": code, "param": err.param},
            CLOSE_BUSY if err.status == 503 else CLOSE_REFUSED)


def wyoming_error(e: BaseException, names: Mapping[str, str]) -> tuple[str, str]:
    """The Wyoming ``error`` event's text (one line) and code answering ``e``."""
    if isinstance(e, Refusal):
        return " ".join(e.message.split()), e.code
    err = api_error(e, names)
    if err.status >= 500 and err.status != 503:
        return INTERNAL_ERROR, "internal_error"
    if err.status == 503:
        code = "busy"
    elif isinstance(e, LimitExceeded):
        code = "limit_exceeded"
    elif isinstance(e, RequestError):
        code = "empty_text" if e.code == "empty_string" and e.field == "text" else "invalid_input"
    elif err.status == 404:
        code = "voice_not_found"
    elif isinstance(e, InputError):
        code = "invalid_input"
    else:
        code = "invalid_request"
    return " ".join(str(e).split()), code


def log_refusal(what: str, client: str, answer: str, message: str | None = None) -> None:
    """The operator's one line for a refusal a door answers: ``what`` was refused (an HTTP request's method
    and path, a session), of which ``client``, with which ``answer`` (the status or close code and the
    error's code), and the ``message`` the client was told, on one line and at most
    :data:`LOGGED_MESSAGE_CHARS` of it (none for a refusal whose message quotes a header unbounded)."""
    if message is None:
        log.info("refused %s of %s: %s", what, client, answer)
        return
    text = " ".join(message.split())
    if len(text) > LOGGED_MESSAGE_CHARS:
        text = text[:LOGGED_MESSAGE_CHARS] + "..."
    log.info("refused %s of %s: %s: %s", what, client, answer, text)


def describe_invalid(errors) -> tuple[str, str | None, str | None]:
    """The message naming the bad fields of pydantic's ``errors`` (a validation error's ``errors()``:
    the first 5, then how many more; a client's field name clipped to 64 characters, so the message
    does not grow with the request), and the ``param`` and ``code`` of the first (pydantic's error
    type, e.g. ``missing``, ``bool_type``, ``less_than_equal``, ``extra_forbidden``, ``json_invalid``)."""
    parts, first = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ())]
        if loc and loc[0] in ("body", "path", "query", "header", "cookie"):
            loc = loc[1:]  # the field's name, as OpenAI's `param` gives it
        if err.get("type") == "json_invalid":
            loc = []  # the location is a character offset, not a field
        where = ".".join(x if len(x) <= SHOWN_ID_CHARS else x[:SHOWN_ID_CHARS] + "..." for x in loc) or None
        parts.append(f"{where or 'body'}: {err.get('msg')}")
        if first is None:
            first = (where, err.get("type"))
    param, code = first or (None, None)
    message = "; ".join(parts[:NAMED_IDS]) + (f"; and {len(parts) - NAMED_IDS} more" if len(parts) > NAMED_IDS else "")
    return message or "invalid request", param, code


__all__ = ["ERROR_TYPES", "INTERNAL_ERROR", "ApiError", "Refusal", "api_error", "busy", "describe_invalid",
           "error_body", "limit_error", "log_refusal", "server_failure", "websocket_error", "wyoming_error"]

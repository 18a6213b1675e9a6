"""The handlers that answer every error the way OpenAI's API does, as JSON ``{"error": {"message":
str, "type": str, "param": str | None, "code": str | None}}`` (:func:`~cosyllama.server.common.error_body`),
and the answer for an exception raised while synthesizing. Needs the ``server`` extra."""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import BackendBusyError, CosyllamaError, InputError
from ..limits import LimitExceeded
from ..llm.scheduler import SchedulerBusyError
from ..request import HTTP_NAMES, RequestError
from ..voices import NAMED_IDS, SHOWN_ID_CHARS, UnknownVoiceError
from .common import ApiError, busy, error_body
from .serving import INTERNAL_ERROR

log = logging.getLogger("cosyllama.server")


def synthesis_error(e: Exception) -> ApiError:
    """The answer for an exception raised while synthesizing."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (SchedulerBusyError, BackendBusyError)):
        return busy(str(e))
    if isinstance(e, LimitExceeded):
        return limit_error(e)
    if isinstance(e, RequestError):  # a synthesis rule, said in the HTTP body's field names
        return ApiError(422, e.render(HTTP_NAMES), param=e.name(HTTP_NAMES), code=e.code)
    if isinstance(e, UnknownVoiceError):  # removed since the request was checked
        return ApiError(404, str(e), "not_found_error", param="voice", code="voice_not_found")
    if isinstance(e, InputError):
        return ApiError(422, str(e))
    if isinstance(e, CosyllamaError):
        return ApiError(400, str(e))
    log.error("synthesis failed", exc_info=e)  # what failed is for the operator, not the client
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


async def _api_error(request, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


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


async def _validation_error(request, e: RequestValidationError):
    """422 naming the bad fields (:func:`describe_invalid`)."""
    message, param, code = describe_invalid(e.errors())
    return JSONResponse(error_body(message, "invalid_request_error", param, code), status_code=422)


async def _http_error(request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


async def _unexpected_error(request, e: Exception):
    """A bug: answer 500 with the JSON error body (the traceback goes to the log)."""
    return JSONResponse(error_body(INTERNAL_ERROR, "internal_error"), status_code=500)


def add_error_handlers(app) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)

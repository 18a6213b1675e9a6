"""The handlers that answer the server's errors as JSON ``{"error": {"message": str, "type": str}}``,
and the answer for an exception raised while synthesizing. Needs the ``server`` extra."""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import BackendBusyError, CosyllamaError, InputError
from .scheduler import SchedulerBusyError
from .server_common import ApiError, busy

log = logging.getLogger("cosyllama.server")


def synthesis_error(e: Exception) -> ApiError:
    """The answer for an exception raised while synthesizing."""
    if isinstance(e, (SchedulerBusyError, BackendBusyError)):
        return busy(str(e))
    if isinstance(e, InputError):
        return ApiError(422, str(e))
    if isinstance(e, CosyllamaError):
        return ApiError(400, str(e))
    log.exception("synthesis failed", exc_info=e)
    return ApiError(500, f"synthesis failed: {type(e).__name__}: {e}", "internal_error")


def _error_response(status: int, message: str, type: str, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type}}, status_code=status, headers=headers)


async def _api_error(request, e: ApiError):
    return _error_response(e.status, e.message, e.type, e.headers)


async def _validation_error(request, e: RequestValidationError):
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {err.get('msg')}")
    return _error_response(422, "; ".join(parts) or "invalid request", "invalid_request_error")


async def _http_error(request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return _error_response(e.status_code, str(e.detail), kind, getattr(e, "headers", None))


def add_error_handlers(app) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)

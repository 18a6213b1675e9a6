"""HTTP server: an OpenAI-style ``/v1/audio/speech`` endpoint, its WebSocket sibling for text as it is
written (``/v1/audio/speech/stream``, :mod:`cosyllama.server.speech_stream`), voice registration and
``/health``.

``create_app(serving, options)`` builds the FastAPI app over a :class:`~cosyllama.server.serving.Serving`
(:func:`~cosyllama.server.serving.prepare`) and the HTTP server's :class:`~cosyllama.server.options.ServeOptions`;
``serve(options)`` runs it with uvicorn (127.0.0.1 by default). Concurrent requests share one LLM
context through a :class:`~cosyllama.llm.scheduler.BatchScheduler`, which advances all their
sequences in one decode step; the routes find the serving core on the app's typed state
(:class:`~cosyllama.server.common.AppState`).

The event loop never runs model code: the frontend, the flow and the vocoder run in the thread
pool, one audio chunk per call. A request that does not fit (``max_concurrent`` running plus
``max_queue`` waiting) gets 503 with ``Retry-After``. Each request's work is bounded
(:class:`~cosyllama.limits.RequestLimits`: characters, text tokens, LLM positions per sequence;
413 naming the limit and its flag). A client that goes away cancels its request at once: its LLM
sequence is released at the next decode step or prefill piece. Errors are OpenAI's JSON
``{"error": {"message", "type", "param", "code"}}`` (see :mod:`cosyllama.server.errors`).
``/`` is a web page to try voices (:mod:`cosyllama.server.page`); ``serve`` closes slow clients
and caps open connections (:mod:`cosyllama.server.conn`).

Needs the ``server`` extra (fastapi, uvicorn, python-multipart).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import replace

from .. import __version__
from ..defaults import LOG_LEVEL
from ..errors import CosyllamaError, MissingDependencyError
from ..llm.scheduler import BatchScheduler
from .options import ServeOptions, ServingOptions
from .serving import Serving, prepare
from .shutdown import FAREWELL_S, draining_server
from .startup import check_can_listen, log_start, ready, start

try:
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the HTTP server needs its extra: pip install 'cosyllama[server]'") from e

from .captioned import router as captioned_router  # noqa: E402
from .captioned_dialogue import router as captioned_dialogue_router  # noqa: E402
from .client_json import clip_param  # noqa: E402
from .common import AppState, state_of  # noqa: E402
from .conn import uvicorn_options  # noqa: E402
from .dialogue import router as dialogue_router  # noqa: E402
from .errors import ApiError, api_error, describe_invalid, error_body, log_refusal, server_failure  # noqa: E402
from .page import PAGE_PATHS, add_page  # noqa: E402
from .security import API_KEY_ENV, add_guard, has_api_key  # noqa: E402
from .speech_route import router as speech_router  # noqa: E402
from .speech_stream import router as speech_stream_router  # noqa: E402
from .speech_stream import uvicorn_ws_options  # noqa: E402
from .voice_names import VoiceNames  # noqa: E402
from .voices import router as voices_router  # noqa: E402
from .wire import BodyLimit, RequestId  # noqa: E402

log = logging.getLogger("cosyllama.server")

BODY_SLACK_BYTES = 64 * 1024  # multipart headers, the other JSON fields


router = APIRouter()


# -- health -----------------------------------------------------------------------------------


@router.get("/health")
@router.head("/health", include_in_schema=False)  # health probes use HEAD too
async def health(request: Request):
    state = state_of(request.app)
    serving = state.serving
    s = serving.scheduler.stats()
    g = serving.admission()
    out = {"status": "ok", "version": __version__, "active_sequences": s["active_sequences"],
           "queue_depth": g.waiting + s["waiting"], "requests_running": g.running,
           "requests_waiting": g.waiting, "sequences_waiting": s["waiting"],
           "max_concurrent": serving.max_concurrent, "max_queue": serving.max_queue,
           "decode_steps": s["steps"], "decoded_tokens": s["tokens"], "max_batch": s["max_batch"],
           "interleave": s.get("interleave", "off")}
    backend_stats = serving.scheduler.backend.stats()
    if backend_stats is not None:
        out["llm"] = backend_stats
    prompt_cache = getattr(getattr(serving.tts, "token2wav", None), "prompt_cache_info", None)
    if callable(prompt_cache):
        out["prompt_cache"] = prompt_cache()
    skipped = await run_in_threadpool(lambda: serving.voices.skipped)  # files that could not be read
    out["voices"] = {"skipped_count": len(skipped)}
    if has_api_key(request.headers, state.options.api_key):  # which and why: only for who holds the key
        out["voices"]["skipped"] = [{"file": name, "error": why} for name, why in skipped.items()]
    return out


# -- errors -----------------------------------------------------------------------------------


def _refused(request, status: int, code: str | None, message: str) -> None:
    """The operator's line for a refused request (:func:`~cosyllama.server.errors.log_refusal`); its path is
    the client's, cut to 64 characters."""
    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    method = getattr(request, "method", "WebSocket")  # a WebSocket's handshake has none
    log_refusal(f"{method} {clip_param(request.url.path)}", client, f"{status} {code or '-'}", message)


async def _api_error(request, e: Exception):
    """The project's exceptions a route raises (a :class:`~cosyllama.server.errors.Refusal`, an unknown voice, a
    limit, the server busy ...), answered as the one mapper says (:func:`~cosyllama.server.errors.api_error`)."""
    err = api_error(e)
    _refused(request, err.status, err.code, err.message)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _validation_error(request, e: RequestValidationError):
    """422 naming the bad fields (:func:`~cosyllama.server.errors.describe_invalid`)."""
    message, param, code = describe_invalid(e.errors())
    _refused(request, 422, code, message)
    return JSONResponse(error_body(message, "invalid_request_error", param, code), status_code=422)


async def _http_error(request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    _refused(request, e.status_code, None, str(e.detail))
    return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


async def _unexpected_error(request, e: Exception):
    """A bug: answer the mapper's 500 (:func:`~cosyllama.server.errors.server_failure`; the ASGI server logs the
    traceback)."""
    err = server_failure()
    return JSONResponse(err.body(), status_code=err.status)


def add_error_handlers(app) -> None:
    """Every error answered as OpenAI's API does: JSON ``{"error": {"message", "type", "param", "code"}}``; the
    project's own exceptions through the one mapper, so a route just raises them."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(CosyllamaError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


# -- the factory ------------------------------------------------------------------------------


def create_app(serving, options: ServeOptions | ServingOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``serving`` (a :class:`~cosyllama.server.serving.Serving`, which the caller
    closes) with the HTTP server's ``options`` (:class:`~cosyllama.server.options.ServeOptions`; its
    ``serving`` field, what ``serving`` was prepared from, is not read again). Every response carries
    ``x-request-id`` (:class:`~cosyllama.server.wire.RequestId`); ``/`` serves the web page
    (:mod:`cosyllama.server.page`). With ``options.wyoming`` the app, while it runs, also answers the Wyoming
    protocol there (:mod:`cosyllama.server.wyoming`) from the same serving core and gate.

    A convenience for tests and scripts: ``create_app(tts, options)`` with a loaded :class:`cosyllama.TTS` (left
    as it is) first prepares a serving core over it (:func:`serving_for`), closed with the app; ``options`` is then
    a :class:`ServeOptions`, or only its :class:`ServingOptions`, or None (the defaults)."""
    if not isinstance(serving, Serving):
        if options is None or isinstance(options, ServingOptions):
            options = ServeOptions(options if options is not None else ServingOptions(serving.options))
        serving = serving_for(serving, options.serving)
        owns = True
    else:
        if isinstance(options, ServingOptions):
            raise TypeError("create_app(serving, options) takes the HTTP server's ServeOptions; the serving core "
                            "was prepared from its ServingOptions already")
        options = options if options is not None else ServeOptions(serving.options)
        owns = False
    limits = serving.limits
    voice_names = VoiceNames(dict(options.voice_aliases), serving.options.default_voice)
    state = AppState(serving, options, voice_names, owns)

    @asynccontextmanager
    async def lifespan(app):
        if options.wyoming is not None:  # the same serving core and gate as the HTTP routes
            from .wyoming_server import start_wyoming

            state.wyoming = await start_wyoming(options.wyoming, serving)
            log.info("Wyoming server listening on %s", options.wyoming)
        try:
            yield
        finally:
            if state.wyoming is not None:
                await state.wyoming.stop()
            if owns:
                await run_in_threadpool(serving.close)
            log.info("stopped serving%s", "" if state.wyoming is None else " (HTTP and Wyoming)")

    app = FastAPI(title="cosyllama", summary="CosyVoice3 text-to-speech", lifespan=lifespan)
    # JSON text is at most 4 bytes per character (UTF-8) or 6 as an escape; prompts are files
    text_bytes = 6 * max(limits.input_chars + limits.instructions_chars, limits.transcript_chars)
    app.add_middleware(BodyLimit, limit=options.max_prompt_bytes + text_bytes + BODY_SLACK_BYTES)
    add_guard(app, options.api_key, options.allow_origins, open_paths=PAGE_PATHS)  # refusals before any body
    app.add_middleware(RequestId)  # outermost: every answer carries x-request-id, refusals too
    app.state.server = state
    add_error_handlers(app)
    app.include_router(router)
    app.include_router(speech_router)
    app.include_router(captioned_router)
    app.include_router(captioned_dialogue_router)
    app.include_router(dialogue_router)
    app.include_router(speech_stream_router)
    app.include_router(voices_router)
    add_page(app)
    return app


def serving_for(tts, options: ServingOptions | None = None) -> Serving:
    """The serving core over a loaded :class:`cosyllama.TTS` (left as it is), as ``create_app(tts, options)``
    makes it: a :class:`~cosyllama.server.serving.Serving` over ``tts.models`` with ``options`` (default:
    ``ServingOptions(tts.options)``; their ``load`` is not read again), speaking with ``tts.voices`` and, when
    ``options`` has no lexicon, ``tts.lexicon``, decoding through ``tts.token_source`` when that is a
    :class:`BatchScheduler` (else through one of its own). The caller closes it."""
    if options is None:
        options = ServingOptions(tts.options)
    if options.lexicon is None and tts.lexicon is not None:
        options = replace(options, lexicon=tts.lexicon)
    scheduler = tts.token_source if isinstance(tts.token_source, BatchScheduler) else None
    return prepare(tts.models, options, voices=tts.voices, scheduler=scheduler)


# ----------------------------------------------------------------------------------------------
# Running it


def serve(options: ServeOptions, log_level: str = LOG_LEVEL) -> None:
    """Run the server until interrupted (``cosyllama serve``): the shared start-up
    (:func:`cosyllama.server.startup.start`), the app, uvicorn (its own lines from ``log_level`` up); a SIGTERM
    or SIGINT drains it (:mod:`cosyllama.server.shutdown`) and it returns."""
    import uvicorn

    s = options.serving

    def check_addresses() -> None:
        check_can_listen(options.host, options.port, f"{options.host}:{options.port} (--host, --port)")
        if options.wyoming is not None:
            from .wyoming_server import check_listen

            check_listen(options.wyoming)  # a taken port is one line before the model loads

    models, voices = start(s, check_addresses)
    serving = prepare(models, s, voices=voices)
    app = create_app(serving, options)
    ready(serving)  # after prepare: voice folders are made by then
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    if AutoWebSocketsProtocol is None:  # uvicorn answers a WebSocket handshake with 400 without one
        log.warning("%s needs a WebSocket implementation for uvicorn: pip install 'cosyllama[server]' "
                    "(websockets)", "/v1/audio/speech/stream")
    if options.host not in ("127.0.0.1", "localhost", "::1") and options.api_key is None:
        log.warning("listening on %s without an API key (--api-key or $%s): anyone who reaches it can use it",
                    options.host, API_KEY_ENV)
    log_start(s.load, voices, f"http://{options.host}:{options.port}")
    connection = uvicorn_options(s.connection_limits)  # the guard, no keepalive pings (cosyllama.server.conn)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=log_level,
                            timeout_graceful_shutdown=FAREWELL_S, **connection, **uvicorn_ws_options(s.limits))
    try:
        draining_server(config, app, connection["http"]).run()  # SIGTERM: drained, then exit 0 (shutdown.py)
    finally:
        serving.close()


__all__ = ["create_app", "serve", "serving_for"]

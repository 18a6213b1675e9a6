"""HTTP server: an OpenAI-style ``/v1/audio/speech`` endpoint, its WebSocket sibling for text as it is
written (``/v1/audio/speech/stream``, :mod:`cosyllama.server.speech_stream`), voice registration and
``/health``.

``create_app(tts)`` builds the FastAPI app; ``serve(options)`` runs it with uvicorn (127.0.0.1 by
default). Concurrent requests share one LLM context through a :class:`~cosyllama.llm.scheduler.BatchScheduler`,
which advances all their sequences in one decode step; the routes find it, the TTS and the limits
on ``app.state``.

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
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ..defaults import MAX_QUEUE, MAX_VOICES
from ..errors import MissingDependencyError
from ..limits import RequestLimits
from ..llm.scheduler import BatchScheduler
from ..voices import VoiceStore
from .serving import check_can_listen, prepare
from .startup import ServeOptions, ready, start

try:
    from fastapi import APIRouter, FastAPI, Request
    from starlette.concurrency import run_in_threadpool
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the HTTP server needs its extra: pip install 'cosyllama[server]'") from e

from .common import admission as _admission  # noqa: E402
from .conn import ConnectionLimits, uvicorn_options  # noqa: E402
from .errors import add_error_handlers  # noqa: E402
from .page import PAGE_PATHS, add_page  # noqa: E402
from .security import API_KEY_ENV, add_guard, has_api_key  # noqa: E402
from .speech import VoiceNames  # noqa: E402
from .speech import router as speech_router  # noqa: E402
from .speech_stream import router as speech_stream_router  # noqa: E402
from .speech_stream import uvicorn_ws_options  # noqa: E402
from .voices import router as voices_router  # noqa: E402
from .wire import BodyLimit, RequestId  # noqa: E402

log = logging.getLogger("cosyllama.server")

DEFAULT_MAX_PROMPT_BYTES = 10 * 1024 * 1024  # bytes of an uploaded prompt file (30 s of audio fits easily)
DEFAULT_MAX_QUEUE = MAX_QUEUE  # requests that may wait for a running slot
DEFAULT_MAX_VOICES = MAX_VOICES
BODY_SLACK_BYTES = 64 * 1024  # multipart headers, the other JSON fields


# ----------------------------------------------------------------------------------------------
# The app
#
# The routes are plain module-level functions; what they share lives on ``app.state`` (set once by
# create_app): ``tts`` (the served pipeline over the given TTS's models, its tokens from the scheduler), ``scheduler``,
# ``limits`` and ``gate`` (made on first use, inside the running event loop).


@dataclass
class ServerLimits:
    max_concurrent: int
    max_queue: int
    max_prompt_bytes: int
    request: RequestLimits  # characters and tokens of the text fields, LLM positions per sequence
    max_voices: int | None = DEFAULT_MAX_VOICES  # registered voices; None: no bound


router = APIRouter()


# -- health -----------------------------------------------------------------------------------


@router.get("/health")
@router.head("/health", include_in_schema=False)  # health probes use HEAD too
async def health(request: Request):
    state = request.app.state
    s = state.scheduler.stats()
    g = _admission(request.app)
    out = {"status": "ok", "active_sequences": s["active_sequences"],
           "queue_depth": g.waiting + s["waiting"], "requests_running": g.running,
           "requests_waiting": g.waiting, "sequences_waiting": s["waiting"],
           "max_concurrent": state.limits.max_concurrent, "max_queue": state.limits.max_queue,
           "decode_steps": s["steps"], "decoded_tokens": s["tokens"], "max_batch": s["max_batch"],
           "interleave": s.get("interleave", "off")}
    backend_stats = state.scheduler.backend.stats()
    if backend_stats is not None:
        out["llm"] = backend_stats
    prompt_cache = getattr(getattr(state.tts, "token2wav", None), "prompt_cache_info", None)
    if callable(prompt_cache):
        out["prompt_cache"] = prompt_cache()
    skipped = await run_in_threadpool(lambda: state.tts.voices.skipped)  # files that could not be read
    out["voices"] = {"skipped_count": len(skipped)}
    if has_api_key(request.headers, state.api_key):  # which and why: only for who holds the key
        out["voices"]["skipped"] = [{"file": name, "error": why} for name, why in skipped.items()]
    return out


# -- the factory ------------------------------------------------------------------------------


def create_app(tts, *, max_concurrent: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES, limits: RequestLimits | None = None,
               scheduler: BatchScheduler | None = None, prefill_chunk: int | None = None,
               api_key: str | None = None, allow_origins: Sequence[str] = (), wyoming: str | None = None,
               wyoming_options: dict | None = None, max_voices: int | None = DEFAULT_MAX_VOICES,
               interleave: str | None = None, default_voice: str | None = None,
               voice_aliases: dict[str, str] | None = None, speech_defaults: dict | None = None,
               connection_limits: ConnectionLimits | None = None, voices: VoiceStore | None = None) -> FastAPI:
    """The FastAPI app serving ``tts`` (a :class:`cosyllama.TTS`), which is left as it is. Every
    response carries ``x-request-id`` (:class:`~cosyllama.server.wire.RequestId`); ``/`` serves the web
    page (:mod:`cosyllama.server.page`). One line per parameter:

    * ``max_concurrent``: requests synthesized at once (default: twice the scheduler's sequence slots,
      so the LLM stays busy while other requests are in the flow/vocoder);
    * ``max_queue``: requests that may wait for one of those; more get 503;
    * ``max_prompt_bytes``: larger uploaded prompt files get 413 (their length in seconds is checked by
      the frontend: 0.1-30 s);
    * ``limits``: characters and tokens of the text fields (input, instructions, a voice's transcript)
      and the LLM positions per sequence (default :class:`RequestLimits`()); a request over one gets 413
      naming it;
    * ``scheduler``: the :class:`BatchScheduler` requests decode through (else ``tts.token_source`` when
      that is one, else one made here over ``tts.llm``, closed when the app shuts down); one passed in
      must let ``max_concurrent`` requests wait for a sequence (the gate is the real limit);
    * ``prefill_chunk``: prompt positions a scheduler made here runs between two decode steps;
    * ``interleave``: how that scheduler pauses for flow work (None: by threads and cores,
      :func:`cosyllama.server.serving.prepare`);
    * ``api_key``, ``allow_origins``: see :mod:`cosyllama.server.security`;
    * ``wyoming``: a URI (``tcp://HOST:PORT``) where the app, while it runs, also answers the Wyoming
      protocol (:mod:`cosyllama.server.wyoming`) from the same TTS, scheduler, voices and admission gate;
    * ``wyoming_options``: the keyword arguments of :func:`~cosyllama.server.wyoming.start_wyoming`;
    * ``voices``: the store voices are read from and registered in (default: ``tts.voices``; ``serve``
      opens it with :func:`cosyllama.server.serving.open_voice_store`);
    * ``max_voices``: voices registered in it; a new id past it gets 409; None: no bound;
    * ``default_voice``: what OpenAI's built-in voice names speak with when not registered (see
      :class:`~cosyllama.server.speech.VoiceNames`);
    * ``voice_aliases``: name -> registered id (see :class:`~cosyllama.server.speech.VoiceNames`);
    * ``speech_defaults``: ``seed`` and ``greedy`` for speech requests that do not give them (e.g.
      reproducible audio for clients that cannot send cosyllama's fields);
    * ``connection_limits``: the idle and write timeouts of a WebSocket session at
      ``/v1/audio/speech/stream`` (:mod:`cosyllama.server.speech_stream`; default :class:`ConnectionLimits`()).
    """
    if max_prompt_bytes < 1 or (max_voices is not None and max_voices < 1):
        raise ValueError("max_prompt_bytes and max_voices must be >= 1")
    serving = prepare(tts, max_concurrent=max_concurrent, max_queue=max_queue, limits=limits, scheduler=scheduler,
                      prefill_chunk=prefill_chunk, interleave=interleave, voices=voices)
    limits = serving.limits
    voice_names = VoiceNames(dict(voice_aliases or {}), default_voice)
    speech_defaults = dict(speech_defaults or {})
    if not set(speech_defaults) <= {"seed", "greedy"}:
        raise ValueError(f"speech_defaults takes seed and greedy, got {sorted(speech_defaults)}")

    @asynccontextmanager
    async def lifespan(app):
        wyoming_server = None
        if wyoming is not None:  # the same TTS view, scheduler and gate as the HTTP routes
            from .wyoming import start_wyoming

            wyoming_server = await start_wyoming(wyoming, serving, gate=_admission(app), **(wyoming_options or {}))
            log.warning("Wyoming server listening on %s", wyoming)
        app.state.wyoming = wyoming_server
        try:
            yield
        finally:
            if wyoming_server is not None:
                await wyoming_server.stop()
            await run_in_threadpool(serving.close)

    app = FastAPI(title="cosyllama", summary="CosyVoice3 text-to-speech", lifespan=lifespan)
    # JSON text is at most 4 bytes per character (UTF-8) or 6 as an escape; prompts are files
    text_bytes = 6 * max(limits.input_chars + limits.instructions_chars, limits.transcript_chars)
    app.add_middleware(BodyLimit, limit=max_prompt_bytes + text_bytes + BODY_SLACK_BYTES)
    add_guard(app, api_key, allow_origins, open_paths=PAGE_PATHS)  # in front: refusals come before any body is read
    app.add_middleware(RequestId)  # outermost: every answer carries x-request-id, refusals too
    app.state.tts = serving.tts
    app.state.scheduler = serving.scheduler
    app.state.limits = ServerLimits(serving.max_concurrent, serving.max_queue, max_prompt_bytes, limits, max_voices)
    app.state.gate = None
    app.state.voice_names = voice_names
    app.state.speech_defaults = speech_defaults
    app.state.api_key = api_key  # /health shows details only with it
    app.state.wyoming = None  # the WyomingServer while the app runs, with ``wyoming``
    app.state.connection_limits = connection_limits or ConnectionLimits()
    add_error_handlers(app)
    app.include_router(router)
    app.include_router(speech_router)
    app.include_router(speech_stream_router)
    app.include_router(voices_router)
    add_page(app)
    return app


# ----------------------------------------------------------------------------------------------
# Running it


def serve(options: ServeOptions) -> None:
    """Run the server until interrupted (``cosyllama serve``): the shared start-up
    (:func:`cosyllama.server.startup.start`), the app, uvicorn."""
    import uvicorn

    s = options.serving

    def check_addresses() -> None:
        check_can_listen(options.host, options.port, f"{options.host}:{options.port} (--host, --port)")
        if options.wyoming is not None:
            from .wyoming import check_listen

            check_listen(options.wyoming)  # a taken port is one line before the model loads

    tts, voices = start(s, check_addresses)
    wyoming_options = None
    if options.wyoming is not None:
        wyoming_options = {"default_voice": s.default_voice, "connection_limits": s.connection_limits}
    app = create_app(tts, max_queue=s.max_queue, limits=s.limits, prefill_chunk=s.prefill_chunk,
                     api_key=options.api_key, allow_origins=options.allow_origins, wyoming=options.wyoming,
                     wyoming_options=wyoming_options, max_voices=options.max_voices, interleave=s.interleave,
                     default_voice=s.default_voice, voice_aliases=dict(options.voice_aliases),
                     connection_limits=s.connection_limits, voices=voices)
    ready(tts, voices)  # after create_app: voice folders are made by then
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    if AutoWebSocketsProtocol is None:  # uvicorn answers a WebSocket handshake with 400 without one
        log.warning("%s needs a WebSocket implementation for uvicorn: pip install 'cosyllama[server]' "
                    "(websockets)", "/v1/audio/speech/stream")
    if options.host not in ("127.0.0.1", "localhost", "::1") and options.api_key is None:
        log.warning("listening on %s without an API key (--api-key or $%s): anyone who reaches it can use it",
                    options.host, API_KEY_ENV)
    uvicorn.run(app, host=options.host, port=options.port, log_level="info", **uvicorn_options(s.connection_limits),
                **uvicorn_ws_options(s.limits))


__all__ = ["create_app", "serve"]

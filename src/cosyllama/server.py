"""HTTP server: an OpenAI-style ``/v1/audio/speech`` endpoint, voice registration and ``/health``.

``create_app(tts)`` builds the FastAPI app; ``serve(args)`` runs it with uvicorn (127.0.0.1 by
default). Concurrent requests share one LLM context through a :class:`~cosyllama.scheduler.BatchScheduler`,
which advances all their sequences in one decode step; the routes find it, the TTS and the limits
on ``app.state``.

The event loop never runs model code: the frontend, the flow and the vocoder run in the thread
pool, one audio chunk per call. A request that does not fit (``max_concurrent`` running plus
``max_queue`` waiting) gets 503 with ``Retry-After``. Each request's work is bounded
(:class:`~cosyllama.limits.RequestLimits`: characters, text tokens, LLM positions per sequence;
413 naming the limit and its flag). A client that goes away cancels its request at once: its LLM
sequence is released at the next decode step or prefill piece. Errors are JSON
``{"error": {"message": str, "type": str}}``.

Needs the ``server`` extra (fastapi, uvicorn, python-multipart).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .defaults import LLM_WEIGHTS, MAX_QUEUE, PRECISION, SERVE_PARALLEL
from .errors import BackendBusyError, CosyllamaError, InputError, MissingDependencyError
from .heap import bound_onednn_cache
from .limits import LimitExceeded, RequestLimits
from .llm.factory import choose_llm, make_token_source
from .scheduler import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_WAITING, BatchScheduler, RequestCancelled, SchedulerBusyError
from .voices import check_voice_id

try:
    import anyio
    from fastapi import APIRouter, BackgroundTasks, FastAPI, File, Form, Request, UploadFile
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the HTTP server needs its extra: pip install 'cosyllama[server]'") from e

from .server_jobs import Gate, SynthesisJob, cancel_on_disconnect  # noqa: E402
from .server_wire import MEDIA_TYPES, AudioStream, BodyLimit, encode, pcm16, wav_header  # noqa: E402

log = logging.getLogger("cosyllama.server")

DEFAULT_MAX_PROMPT_BYTES = 10 * 1024 * 1024  # bytes of an uploaded prompt file (30 s of audio fits easily)
DEFAULT_MAX_QUEUE = MAX_QUEUE  # requests that may wait for a running slot
RETRY_AFTER_S = 1  # seconds, sent with 503
BODY_SLACK_BYTES = 64 * 1024  # multipart headers, the other JSON fields


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type, headers


def _busy(message: str) -> ApiError:
    return ApiError(503, message, "server_busy", {"Retry-After": str(RETRY_AFTER_S)})


# ----------------------------------------------------------------------------------------------
# Request models


class SpeechRequest(BaseModel):
    """Body of ``POST /v1/audio/speech``."""

    model_config = ConfigDict(extra="forbid")

    input: str = Field(description="text to speak")
    voice: str = Field(description="id of a voice registered with POST /v1/voices")
    model: str | None = Field(None, description="accepted for OpenAI compatibility; ignored")
    response_format: Literal["wav", "pcm", "flac"] = "wav"
    speed: float = Field(1.0, ge=0.5, le=2.0, description="time stretch; non-streaming only")
    stream: bool = False
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    greedy: bool = False
    instructions: str | None = Field(None, description="style instruction: selects instruct mode")


# ----------------------------------------------------------------------------------------------
# Errors


def _synthesis_error(e: Exception) -> ApiError:
    if isinstance(e, (SchedulerBusyError, BackendBusyError)):
        return _busy(str(e))
    if isinstance(e, LimitExceeded):
        return ApiError(413, str(e), "request_too_large")
    if isinstance(e, InputError):
        return ApiError(422, str(e))
    if isinstance(e, CosyllamaError):
        return ApiError(400, str(e))
    log.exception("synthesis failed", exc_info=e)
    return ApiError(500, f"synthesis failed: {type(e).__name__}: {e}", "internal_error")


# ----------------------------------------------------------------------------------------------
# The app
#
# The routes are plain module-level functions; what they share lives on ``app.state`` (set once by
# create_app): ``tts`` (a view of the given TTS whose tokens come from the scheduler), ``scheduler``,
# ``limits`` and ``gate`` (made on first use, inside the running event loop).


@dataclass
class ServerLimits:
    max_concurrent: int
    max_queue: int
    max_prompt_bytes: int
    request: RequestLimits  # text fields and the LLM budget per sequence (also on app.state.tts.limits)


def _gate(app: FastAPI) -> Gate:
    if app.state.gate is None:  # created inside the running loop
        app.state.gate = Gate(app.state.limits.max_concurrent, app.state.limits.max_queue,
                              lambda message: _busy(f"{message}; retry in {RETRY_AFTER_S} s"))
    return app.state.gate


router = APIRouter()


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


# -- speech -----------------------------------------------------------------------------------


@router.post("/v1/audio/speech")
async def speech(body: SpeechRequest, request: Request):
    tts, limits = request.app.state.tts, request.app.state.limits
    try:  # before any work; tokens and the LLM budget are checked after the frontend (SynthesisJob.open)
        limits.request.check_chars("input", body.input)
        limits.request.check_chars("instructions", body.instructions)
    except LimitExceeded as e:
        raise _synthesis_error(e) from e
    if not body.input.strip():
        raise ApiError(422, "input is empty; give some text to speak")
    if body.voice not in tts.voices:
        raise ApiError(404, f"unknown voice {body.voice!r}; registered voices: "
                       f"{', '.join(tts.voices.ids()) or 'none'} (add one with POST /v1/voices)",
                       "not_found_error")
    if body.stream and body.response_format == "flac":
        raise ApiError(422, "response_format 'flac' cannot be streamed; use 'wav' or 'pcm' with stream=true")
    if body.stream and body.speed != 1.0:
        raise ApiError(422, f"speed {body.speed} needs stream=false (speed is applied to the finished audio)")
    g = _gate(request.app)
    await g.acquire()
    job = SynthesisJob(tts, body)
    watcher = asyncio.create_task(cancel_on_disconnect(request, job.token))
    done = handed_off = False

    async def cleanup():
        nonlocal done
        if not done:
            done = True
            watcher.cancel()
            try:
                await run_in_threadpool(job.close)
            finally:
                g.release()

    try:
        try:
            await run_in_threadpool(job.open)
            first = await run_in_threadpool(job.next)
        except RequestCancelled:
            return Response(status_code=499)  # the client is gone; nobody reads this
        except Exception as e:
            raise _synthesis_error(e) from e
        sr = tts.sample_rate
        if body.stream:
            handed_off = True  # the response runs cleanup when it ends
            return AudioStream(_stream_body(job, first, sr, body.response_format), cleanup,
                                MEDIA_TYPES[body.response_format])
        parts = [first] if first is not None else []
        try:
            while (samples := await run_in_threadpool(job.next)) is not None:
                parts.append(samples)
        except RequestCancelled:
            return Response(status_code=499)
        except Exception as e:
            raise _synthesis_error(e) from e
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        data = await run_in_threadpool(encode, audio, sr, body.response_format)
        return Response(data, media_type=MEDIA_TYPES[body.response_format])
    finally:
        if not handed_off:
            with anyio.CancelScope(shield=True):
                await cleanup()


async def _stream_body(job: SynthesisJob, first, sample_rate: int, fmt: str):
    if fmt == "wav":
        yield wav_header(sample_rate, None)
    samples = first
    while samples is not None:
        if samples.size:
            yield pcm16(samples)
        try:
            samples = await run_in_threadpool(job.next)
        except RequestCancelled:
            return
        except Exception as e:  # the status line is gone: end the stream early and say why in the log
            log.error("stream ended early: %s", _synthesis_error(e).message)
            return


# -- voices -----------------------------------------------------------------------------------


@router.post("/v1/voices")
async def add_voice(request: Request, background: BackgroundTasks, audio: UploadFile = File(...),
                    text: str | None = Form(None), id: str | None = Form(None)):
    tts, limits = request.app.state.tts, request.app.state.limits
    voice_id = id if id else f"voice-{secrets.token_hex(4)}"
    try:
        check_voice_id(voice_id)
    except InputError as e:
        raise ApiError(422, str(e)) from e
    data = await audio.read(limits.max_prompt_bytes + 1)
    if len(data) > limits.max_prompt_bytes:
        raise ApiError(413, f"the audio file is larger than {limits.max_prompt_bytes} bytes; give a 3-15 s "
                       "clip (at most 30 s)", "request_too_large")
    if not data:
        raise ApiError(400, "the audio file is empty")
    g = _gate(request.app)
    await g.acquire()
    try:
        voice = await run_in_threadpool(tts.make_voice, data, text or None)
    except CosyllamaError as e:
        raise ApiError(400, str(e)) from e
    finally:
        g.release()
    tts.voices.add(voice_id, voice)
    background.add_task(_warm_voice, request.app, voice_id, voice)
    return {"id": voice_id}


async def _warm_voice(app: FastAPI, voice_id: str, voice) -> None:
    """After answering: solve the voice's shared flow blocks, so its first streaming request
    starts after them too. Takes a slot like a request; skipped when the server is busy."""
    g = _gate(app)
    try:
        await g.acquire()
    except ApiError:
        return
    try:
        await run_in_threadpool(app.state.tts.warm_voice, voice)
    except Exception as e:  # a failed warm-up only costs the first request its head start
        log.warning("warming voice %s failed: %s", voice_id, e)
    finally:
        g.release()


@router.get("/v1/voices")
async def list_voices(request: Request):
    tts = request.app.state.tts
    out = []
    for vid in tts.voices.ids():
        try:
            v = tts.voices.get(vid)
        except InputError:  # removed meanwhile
            continue
        out.append({"id": vid, "has_transcript": bool(v.prompt_text), "seconds": round(v.duration, 3)})
    return {"voices": out}


@router.delete("/v1/voices/{voice_id}")
async def delete_voice(voice_id: str, request: Request):
    try:
        request.app.state.tts.voices.remove(voice_id)
    except InputError as e:
        raise ApiError(404, str(e), "not_found_error") from e
    return {"id": voice_id, "deleted": True}


# -- health -----------------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request):
    state = request.app.state
    s = state.scheduler.stats()
    g = _gate(request.app)
    out = {"status": "ok", "active_sequences": s["active_sequences"],
           "queue_depth": g.waiting + s["waiting"], "requests_running": g.running,
           "requests_waiting": g.waiting, "sequences_waiting": s["waiting"],
           "max_concurrent": state.limits.max_concurrent, "max_queue": state.limits.max_queue,
           "decode_steps": s["steps"], "decoded_tokens": s["tokens"], "max_batch": s["max_batch"]}
    backend_stats = getattr(state.scheduler.backend, "stats", None)
    if callable(backend_stats):
        out["llm"] = backend_stats()
    prompt_cache = getattr(getattr(state.tts, "token2wav", None), "prompt_cache_info", None)
    if callable(prompt_cache):
        out["prompt_cache"] = prompt_cache()
    return out


# -- the factory ------------------------------------------------------------------------------


def create_app(tts, *, max_concurrent: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES, limits: RequestLimits | None = None,
               scheduler: BatchScheduler | None = None, prefill_chunk: int | None = None) -> FastAPI:
    """The FastAPI app serving ``tts`` (a :class:`cosyllama.TTS`), which is left as it is.

    Requests decode through ``scheduler`` (a :class:`BatchScheduler`), else ``tts.token_source``
    when that is one, else a scheduler made here over ``tts.llm`` (closed when the app shuts down).
    ``max_concurrent``: requests synthesized at once (default: twice the scheduler's sequence
    slots, so the LLM stays busy while other requests are in the flow/vocoder); ``max_queue``:
    requests that may wait for one of those; more get 503. ``limits``: characters and tokens of
    the text fields and the LLM positions per sequence (default :class:`RequestLimits`()); a
    request over one gets 413 naming it. ``max_prompt_bytes``: larger uploaded prompt files get
    413 (their length in seconds is checked by the frontend: 0.1-30 s). A scheduler passed in
    must let ``max_concurrent`` requests wait for a sequence (the gate is the real limit);
    ``prefill_chunk``: prompt positions a scheduler made here runs between two decode steps.
    """
    limits = RequestLimits() if limits is None else limits
    if scheduler is None and isinstance(tts.token_source, BatchScheduler):
        scheduler = tts.token_source
    owns_scheduler = scheduler is None
    if max_concurrent is None:
        max_concurrent = 2 * (int(getattr(tts.llm, "n_seq_max", DEFAULT_MAX_ACTIVE)) if owns_scheduler
                              else scheduler.max_active)
    if min(max_concurrent, max_prompt_bytes) < 1 or max_queue < 0:
        raise ValueError("max_concurrent and max_prompt_bytes must be >= 1 and max_queue >= 0")
    llm_budget = getattr(tts.llm, "max_seq_tokens", None)
    if llm_budget is not None and llm_budget < limits.seq_tokens:
        raise ValueError(f"the LLM holds {llm_budget} positions per sequence, fewer than limits.seq_tokens "
                         f"({limits.seq_tokens}); lower the limit or load the LLM with max_seq_tokens >= it")
    if owns_scheduler:
        scheduler = make_token_source(tts.llm, batched=True, max_waiting=max(DEFAULT_MAX_WAITING, max_concurrent),
                                      prefill_chunk=prefill_chunk)
    elif scheduler.max_waiting < max_concurrent:
        raise ValueError(f"the scheduler lets {scheduler.max_waiting} requests wait, fewer than max_concurrent "
                         f"({max_concurrent}); make it with max_waiting >= {max_concurrent}")

    @asynccontextmanager
    async def lifespan(app):
        yield
        app.state.tts.frontend.normalizer.close_worker()
        if owns_scheduler:
            await run_in_threadpool(scheduler.close)

    app = FastAPI(title="cosyllama", summary="CosyVoice3 text-to-speech", lifespan=lifespan)
    # JSON text is at most 4 bytes per character (UTF-8) or 6 as an escape; prompts are files
    text_bytes = 6 * max(limits.input_chars + limits.instructions_chars, limits.transcript_chars)
    app.add_middleware(BodyLimit, limit=max_prompt_bytes + text_bytes + BODY_SLACK_BYTES)
    view = tts if tts.token_source is scheduler else tts.with_token_source(scheduler)
    app.state.tts = view.with_limits(limits).with_text_worker()  # long texts normalize beside, not in, the loop
    app.state.scheduler = scheduler
    app.state.limits = ServerLimits(max_concurrent, max_queue, max_prompt_bytes, limits)
    app.state.gate = None
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(router)
    return app


# ----------------------------------------------------------------------------------------------
# Running it


def load_tts(args):
    """The TTS the ``serve`` command asks for (llama.cpp when ``--gguf`` is given); its LLM holds
    ``--parallel`` sequences of ``--max-seq-tokens`` positions."""
    from .tts import TTS

    for name in ("stream_cache_mb", "prompt_cache_mb"):  # before the minutes of loading a model
        v = getattr(args, name, None)
        if v is not None and not v >= 0:
            raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    limits = RequestLimits.from_args(args)
    gguf = getattr(args, "gguf", None)
    return TTS(args.model_dir, llm=choose_llm(None, gguf), gguf=gguf, device=getattr(args, "device", "cpu"),
               threads=getattr(args, "threads", None), n_gpu_layers=getattr(args, "n_gpu_layers", 0),
               precision=getattr(args, "precision", PRECISION), parallel=getattr(args, "parallel", SERVE_PARALLEL),
               llm_weights=getattr(args, "llm_weights", LLM_WEIGHTS),
               stream_cache_mb=getattr(args, "stream_cache_mb", None),
               prompt_cache_mb=getattr(args, "prompt_cache_mb", None), max_seq_tokens=limits.seq_tokens)


def serve(args) -> None:
    """Run the server until interrupted (``cosyllama serve``)."""
    import uvicorn

    bound_onednn_cache()  # effective when torch has not computed anything yet (cosyllama.heap)

    limits = RequestLimits.from_args(args)  # refuses a bad --max-... before loading the model
    chunk = getattr(args, "prefill_chunk", None)
    if chunk is not None and chunk < 1:
        raise InputError(f"--prefill-chunk must be >= 1, got {chunk}")
    tts = load_tts(args)
    voices = getattr(args, "voices", None)
    if voices:
        tts.voices.load(voices)

        def warm_all() -> None:  # beside the first requests: each voice's first stream gets a head start
            for vid in tts.voices.ids():
                try:
                    tts.warm_voice(vid)
                except Exception as e:
                    log.warning("warming voice %s failed: %s", vid, e)

        threading.Thread(target=warm_all, name="cosyllama-warm-voices", daemon=True).start()
    app = create_app(tts, max_queue=getattr(args, "max_queue", DEFAULT_MAX_QUEUE), limits=limits,
                     prefill_chunk=getattr(args, "prefill_chunk", None))
    if getattr(tts.llm, "name", None) == "llamacpp":
        from .llm.llamacpp_backend import openmp_serving_hint

        hint = openmp_serving_hint()
        if hint:
            log.warning("%s", hint)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: the server has no authentication; put it behind a proxy that has", args.host)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


__all__ = ["create_app", "serve", "load_tts", "SpeechRequest", "ApiError", "encode", "pcm16", "wav_header"]

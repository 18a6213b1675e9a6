"""HTTP server: an OpenAI-style ``/v1/audio/speech`` endpoint, voice registration and ``/health``.

``create_app(tts)`` builds the FastAPI app; ``serve(args)`` runs it with uvicorn (127.0.0.1 by
default). Concurrent requests share one LLM context through a :class:`~cosyllama.scheduler.BatchScheduler`
(``tts.token_source``), which advances all their sequences in one decode step.

The event loop never runs model code: the frontend, the flow and the vocoder run in the thread
pool, one audio chunk per call. A request that does not fit (``max_concurrent`` running plus
``max_queue`` waiting) gets 503 with ``Retry-After``. A client that goes away cancels its request
at once: its LLM sequence is released at the next decode step. Errors are JSON
``{"error": {"message": str, "type": str}}``.

Needs the ``server`` extra (fastapi, uvicorn, python-multipart).
"""

from __future__ import annotations

import asyncio
import io
import logging
import secrets
import struct
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import BackendBusyError, CosyllamaError, InputError, MissingDependencyError
from .scheduler import BatchScheduler, CancelToken, RequestCancelled, SchedulerBusyError
from .voices import check_voice_id

try:
    import anyio
    from fastapi import BackgroundTasks, FastAPI, File, Form, Request, UploadFile
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the HTTP server needs its extra: pip install 'cosyllama[server]'") from e

log = logging.getLogger("cosyllama.server")

DEFAULT_MAX_INPUT_CHARS = 4096  # characters of text per request
DEFAULT_MAX_PROMPT_BYTES = 10 * 1024 * 1024  # bytes of an uploaded prompt file (30 s of audio fits easily)
DEFAULT_MAX_QUEUE = 16  # requests that may wait for a running slot
RETRY_AFTER_S = 1  # seconds, sent with 503
BODY_SLACK_BYTES = 64 * 1024  # multipart headers, the other JSON fields
PCM_BYTES = 2  # 16-bit samples on the wire
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}


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
# Audio encoding


def pcm16(samples: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> 16-bit little-endian PCM (clipped)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, n_data_bytes: int | None) -> bytes:
    """44-byte RIFF/WAVE header for 16-bit mono PCM. ``None``: unknown length (streaming), written
    as the largest size, which players read as "until the end of the stream"."""
    data = 0xFFFFFFFF if n_data_bytes is None else n_data_bytes
    riff = 0xFFFFFFFF if n_data_bytes is None else 36 + n_data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * PCM_BYTES, PCM_BYTES, 16)
            + b"data" + struct.pack("<I", data))


def encode(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A whole response body in ``fmt`` (wav | pcm | flac)."""
    if fmt == "flac":
        import soundfile as sf

        buf = io.BytesIO()  # the same 16-bit samples as wav/pcm (soundfile's own float rounding differs)
        sf.write(buf, np.frombuffer(pcm16(samples), "<i2"), sample_rate, format="FLAC", subtype="PCM_16")
        return buf.getvalue()
    body = pcm16(samples)
    return wav_header(sample_rate, len(body)) + body if fmt == "wav" else body


# ----------------------------------------------------------------------------------------------
# Admission


class _Gate:
    """At most ``limit`` requests run; up to ``queue`` more wait (FIFO); the rest get 503."""

    def __init__(self, limit: int, queue: int):
        self.limit, self.queue = limit, queue
        self.running = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(limit)

    async def acquire(self) -> None:
        if self._sem.locked() and self.waiting >= self.queue:
            raise _busy(f"the server is busy ({self.running} requests running, {self.waiting} waiting); "
                        f"retry in {RETRY_AFTER_S} s")
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._sem.release()


# ----------------------------------------------------------------------------------------------
# One synthesis


class _Job:
    """One speech request's synthesis, advanced chunk by chunk from the thread pool.

    ``lock`` keeps ``close`` from running while a chunk is being made in another thread; the
    cancel token lets the event loop free the LLM sequence without waiting for that chunk.
    """

    def __init__(self, tts, req: SpeechRequest):
        self.tts, self.req = tts, req
        self.token = CancelToken()
        self.lock = threading.Lock()
        self.syn = None

    def open(self) -> None:
        from .tts import SynthesisOptions

        r, tts = self.req, self.tts
        opts = SynthesisOptions(stream=r.stream, speed=r.speed, greedy=r.greedy, seed=r.seed)
        with self.lock, self.token.bound():
            if r.instructions is not None:
                self.syn = tts.instruct(r.input, r.instructions, voice=r.voice, options=opts)
            elif tts.voices.get(r.voice).prompt_text:
                self.syn = tts.zero_shot(r.input, voice=r.voice, options=opts)
            else:
                self.syn = tts.cross_lingual(r.input, voice=r.voice, options=opts)

    def next(self) -> np.ndarray | None:
        """The next chunk's samples (float32), or None at the end."""
        with self.lock, self.token.bound():
            chunk = next(self.syn, None)
        return None if chunk is None else chunk.samples

    def close(self) -> None:
        """Stop the synthesis; its LLM sequence is free when this returns."""
        self.token.cancel()
        with self.lock:
            if self.syn is not None:
                self.syn.close()


def _synthesis_error(e: Exception) -> ApiError:
    if isinstance(e, (SchedulerBusyError, BackendBusyError)):
        return _busy(str(e))
    if isinstance(e, InputError):
        return ApiError(422, str(e))
    if isinstance(e, CosyllamaError):
        return ApiError(400, str(e))
    log.exception("synthesis failed", exc_info=e)
    return ApiError(500, f"synthesis failed: {type(e).__name__}: {e}", "internal_error")


async def _cancel_on_disconnect(request: Request, token: CancelToken) -> None:
    """Wait for the client to go away, then cancel the request's generation."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            token.cancel()
            return


class _AudioStream(StreamingResponse):
    """A streaming response that always runs ``cleanup`` when it ends, also when the client left
    before the body started (an async generator that never started would not run its ``finally``)."""

    def __init__(self, content, cleanup, media_type: str):
        super().__init__(content, media_type=media_type)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()


class _BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 (by its Content-Length) or is
    cut off (a chunked body is counted as it arrives), before anything parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            msg = f"the request body is larger than {self.limit} bytes"
            response = JSONResponse({"error": {"message": msg, "type": "request_too_large"}}, status_code=413)
            return await response(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    return {"type": "http.disconnect"}  # stop reading; the request fails as abandoned
            return message

        return await self.app(scope, counted, send)


# ----------------------------------------------------------------------------------------------
# The app


@dataclass
class ServerLimits:
    max_concurrent: int
    max_queue: int
    max_input_chars: int
    max_prompt_bytes: int


def create_app(tts, *, max_concurrent: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_input_chars: int = DEFAULT_MAX_INPUT_CHARS, max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
               scheduler: BatchScheduler | None = None) -> FastAPI:
    """The FastAPI app serving ``tts`` (a :class:`cosyllama.TTS`).

    Sets ``tts.token_source`` to a :class:`BatchScheduler` over ``tts.llm`` (or ``scheduler``).
    ``max_concurrent``: requests synthesized at once (default: twice the scheduler's sequence
    slots, so the LLM stays busy while other requests are in the flow/vocoder); ``max_queue``:
    requests that may wait for one of those; more get 503. ``max_input_chars``: longer text gets
    413. ``max_prompt_bytes``: larger uploaded prompt files get 413 (their length in seconds is
    checked by the frontend: 0.1-30 s).
    """
    owns_scheduler = False
    if scheduler is None:
        if isinstance(tts.token_source, BatchScheduler):
            scheduler = tts.token_source
        else:
            scheduler, owns_scheduler = BatchScheduler(tts.llm), True
    if max_concurrent is None:
        max_concurrent = 2 * scheduler.max_active
    if min(max_concurrent, max_input_chars, max_prompt_bytes) < 1 or max_queue < 0:
        raise ValueError("max_concurrent, max_input_chars and max_prompt_bytes must be >= 1 and max_queue >= 0")
    scheduler.max_waiting = max(scheduler.max_waiting, max_concurrent)  # the gate is the real limit
    tts.token_source = scheduler
    limits = ServerLimits(max_concurrent, max_queue, max_input_chars, max_prompt_bytes)
    gate: _Gate | None = None

    def get_gate() -> _Gate:
        nonlocal gate
        if gate is None:  # created inside the running loop
            gate = _Gate(limits.max_concurrent, limits.max_queue)
        return gate

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        if owns_scheduler:
            await run_in_threadpool(scheduler.close)

    app = FastAPI(title="cosyllama", summary="CosyVoice3 text-to-speech", lifespan=lifespan)
    # JSON text is at most 4 bytes per character (UTF-8) or 6 as an escape; prompts are files
    app.add_middleware(_BodyLimit, limit=max(max_prompt_bytes, 6 * max_input_chars) + BODY_SLACK_BYTES)
    app.state.tts, app.state.scheduler, app.state.limits = tts, scheduler, limits

    # -- errors -----------------------------------------------------------------------------------

    def error_response(status: int, message: str, type: str, headers=None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": type}}, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e.status, e.message, e.type, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        parts = []
        for err in e.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            parts.append(f"{where}: {err.get('msg')}")
        return error_response(422, "; ".join(parts) or "invalid request", "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind, getattr(e, "headers", None))

    # -- speech -----------------------------------------------------------------------------------

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, request: Request):
        if len(body.input) > limits.max_input_chars:
            raise ApiError(413, f"input is {len(body.input)} characters long; at most {limits.max_input_chars} "
                           "are allowed per request: split the text", "request_too_large")
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
        g = get_gate()
        await g.acquire()
        job = _Job(tts, body)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job.token))
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
                return _AudioStream(_stream_body(job, first, sr, body.response_format), cleanup,
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

    async def _stream_body(job: _Job, first, sample_rate: int, fmt: str):
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

    @app.post("/v1/voices")
    async def add_voice(background: BackgroundTasks, audio: UploadFile = File(...), text: str | None = Form(None),
                        id: str | None = Form(None)):
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
        g = get_gate()
        await g.acquire()
        try:
            voice = await run_in_threadpool(tts.make_voice, data, text or None)
        except CosyllamaError as e:
            raise ApiError(400, str(e)) from e
        finally:
            g.release()
        tts.voices.add(voice_id, voice)
        background.add_task(warm_voice, voice_id, voice)
        return {"id": voice_id}

    async def warm_voice(voice_id: str, voice) -> None:
        """After answering: solve the voice's shared flow blocks, so its first streaming request
        starts after them too. Takes a slot like a request; skipped when the server is busy."""
        g = get_gate()
        try:
            await g.acquire()
        except ApiError:
            return
        try:
            await run_in_threadpool(tts.warm_voice, voice)
        except Exception as e:  # a failed warm-up only costs the first request its head start
            log.warning("warming voice %s failed: %s", voice_id, e)
        finally:
            g.release()

    @app.get("/v1/voices")
    async def list_voices():
        out = []
        for vid in tts.voices.ids():
            try:
                v = tts.voices.get(vid)
            except InputError:  # removed meanwhile
                continue
            out.append({"id": vid, "has_transcript": bool(v.prompt_text), "seconds": round(v.duration, 3)})
        return {"voices": out}

    @app.delete("/v1/voices/{voice_id}")
    async def delete_voice(voice_id: str):
        try:
            tts.voices.remove(voice_id)
        except InputError as e:
            raise ApiError(404, str(e), "not_found_error") from e
        return {"id": voice_id, "deleted": True}

    # -- health -----------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        s = scheduler.stats()
        g = get_gate()
        out = {"status": "ok", "active_sequences": s["active_sequences"],
               "queue_depth": g.waiting + s["waiting"], "requests_running": g.running,
               "requests_waiting": g.waiting, "sequences_waiting": s["waiting"],
               "max_concurrent": limits.max_concurrent, "max_queue": limits.max_queue,
               "decode_steps": s["steps"], "decoded_tokens": s["tokens"], "max_batch": s["max_batch"]}
        backend_stats = getattr(scheduler.backend, "stats", None)
        if callable(backend_stats):
            out["llm"] = backend_stats()
        prompt_cache = getattr(getattr(tts, "token2wav", None), "prompt_cache_info", None)
        if callable(prompt_cache):
            out["prompt_cache"] = prompt_cache()
        return out

    return app


# ----------------------------------------------------------------------------------------------
# Running it


def load_tts(args):
    """The TTS the ``serve`` command asks for (llama.cpp when ``--gguf`` is given)."""
    from .tts import TTS

    for name in ("stream_cache_mb", "prompt_cache_mb"):  # before the minutes of loading a model
        v = getattr(args, name, None)
        if v is not None and not v >= 0:
            raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    threads = getattr(args, "threads", None)
    common = dict(device=getattr(args, "device", "cpu"), threads=threads, precision=getattr(args, "precision", "auto"),
                  stream_cache_mb=getattr(args, "stream_cache_mb", None),
                  prompt_cache_mb=getattr(args, "prompt_cache_mb", None))
    if args.gguf:
        from .llm.llamacpp_backend import LlamaCppLLM

        backend = LlamaCppLLM(args.gguf, args.model_dir, n_threads=threads,
                              n_gpu_layers=getattr(args, "n_gpu_layers", 0),
                              n_seq_max=getattr(args, "parallel", 8))
        return TTS(args.model_dir, llm="llamacpp", llm_backend=backend, **common)
    return TTS(args.model_dir, llm="torch", **common)


def serve(args) -> None:
    """Run the server until interrupted (``cosyllama serve``)."""
    import uvicorn

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
    app = create_app(tts, max_queue=getattr(args, "max_queue", DEFAULT_MAX_QUEUE),
                     max_input_chars=getattr(args, "max_input_chars", DEFAULT_MAX_INPUT_CHARS))
    if getattr(tts.llm, "name", None) == "llamacpp":
        from .llm.llamacpp_backend import openmp_serving_hint

        hint = openmp_serving_hint()
        if hint:
            log.warning("%s", hint)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: the server has no authentication; put it behind a proxy that has", args.host)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


__all__ = ["create_app", "serve", "load_tts", "SpeechRequest", "ApiError", "encode", "pcm16", "wav_header"]

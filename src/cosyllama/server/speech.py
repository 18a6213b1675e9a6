"""``POST /v1/audio/speech``: the request body, one synthesis advanced chunk by chunk from the
thread pool, and the audio it answers with: a whole file, a raw audio stream, or Server-Sent Events.
Needs the ``server`` extra.

The route reads what it shares with the rest of the app from ``app.state`` (``tts``, ``limits``,
``gate``; see :func:`cosyllama.server.app.create_app`).

How the body arrives (``stream_format``, as in OpenAI's API; ``stream: true`` is the older way to
ask for ``"audio"``):

* omitted: non-streaming synthesis (full attention over all tokens; any ``speed``), one body;
* ``"audio"``: streaming synthesis, the encoded audio sent as each chunk is made;
* ``"sse"``: the same bytes, base64, in ``speech.audio.delta`` events, then one
  ``speech.audio.done`` event with token usage (an ``error`` event instead if synthesis fails
  after the stream started).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from typing import Literal

import anyio
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ..defaults import SPEED_RANGE
from ..heap import trim_heap
from ..limits import LimitExceeded
from ..llm.scheduler import CancelToken, RequestCancelled
from ..tts import MODES
from ..voices import describe_ids
from .common import ApiError, client_gone, error_body, gate
from .errors import synthesis_error
from .wire import FORMATS, MEDIA_TYPES, STREAMABLE, AudioStream, StreamEncoder, encode

log = logging.getLogger("cosyllama.server")

SSE_MEDIA_TYPE = "text/event-stream"


class SpeechRequest(BaseModel):
    """Body of ``POST /v1/audio/speech``. Strict: no type coercion (``"stream": "yes"`` or
    ``"seed": "5"`` is an error, not true or 5); integers are accepted for ``speed``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: str = Field(description="text to speak")
    voice: str = Field(description="id of a voice registered with POST /v1/voices")
    model: str | None = Field(None, description="accepted for OpenAI compatibility; ignored")
    response_format: Literal[FORMATS] = Field("wav", description="wav and pcm: 16-bit, 24 kHz mono; flac "
                                              "cannot be streamed")
    speed: float = Field(1.0, ge=SPEED_RANGE[0], le=SPEED_RANGE[1], allow_inf_nan=False,
                         description="time stretch of the finished audio; needs non-streaming synthesis")
    stream_format: Literal["audio", "sse"] | None = Field(
        None, description="stream the audio as it is made: raw (audio) or as Server-Sent Events (sse); "
        "omitted: the whole file after synthesis")
    stream: bool = Field(False, description="true: the same as stream_format 'audio' (the older field)")
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    greedy: bool = False
    instructions: str | None = Field(None, description="style instruction: selects instruct mode")
    mode: Literal[MODES] | None = Field(
        None, description="cosyllama's: the synthesis mode; omitted: instruct with instructions, else zero-shot "
        "for a voice registered with its transcript, else cross-lingual")

    def synthesis_mode(self) -> str | None:
        """The mode asked for (None: chosen by ``tts.synthesize``), checked against instructions."""
        if self.mode is None:
            return None
        if (self.mode == "instruct") != (self.instructions is not None):
            need = "needs instructions" if self.mode == "instruct" else "takes no instructions"
            raise ApiError(422, f"mode {self.mode!r} {need}; give instructions with mode 'instruct' only "
                           "(or leave mode out)", param="instructions" if self.mode == "instruct" else "mode",
                           code="conflicting_fields")
        return self.mode

    def streaming(self) -> str | None:
        """How the audio is sent: None (the whole file), "audio" or "sse"."""
        if self.stream_format is not None:
            if "stream" in self.model_fields_set and not self.stream:
                raise ApiError(422, f"stream=false contradicts stream_format {self.stream_format!r}; "
                               "leave stream out", param="stream", code="conflicting_fields")
            return self.stream_format
        return "audio" if self.stream else None


class _Job:
    """One speech request's synthesis, advanced chunk by chunk from the thread pool.

    ``lock`` keeps ``close`` from running while a chunk is being made in another thread; the
    cancel token lets the event loop free the LLM sequence without waiting for that chunk.
    A streamed job also owns the encoder of its response body.
    """

    def __init__(self, tts, req: SpeechRequest, streaming: str | None):
        self.tts, self.req = tts, req
        self.token = CancelToken()
        self.lock = threading.Lock()
        self.syn = None
        self.streaming = streaming
        self.encoder = None

    def open(self) -> None:
        from ..tts import SynthesisOptions

        r, tts = self.req, self.tts
        opts = SynthesisOptions(stream=self.streaming is not None, speed=r.speed, greedy=r.greedy, seed=r.seed)
        with self.lock, self.token.bound():
            self.syn = tts.synthesize(r.input, mode=r.mode, instruction=r.instructions, voice=r.voice, options=opts)
            if self.streaming:
                self.encoder = StreamEncoder(r.response_format, tts.sample_rate)

    def next(self) -> np.ndarray | None:
        """The next chunk's samples (float32), or None at the end."""
        with self.lock, self.token.bound():
            chunk = next(self.syn, None)
        return None if chunk is None else chunk.samples

    def next_bytes(self) -> bytes | None:
        """Streamed: the next piece of the encoded body (maybe empty), or None after the last."""
        with self.lock, self.token.bound():
            if self.encoder is None:
                return None
            chunk = next(self.syn, None)
            if chunk is not None:
                return self.encoder.write(chunk.samples)
            tail = self.encoder.close()
            self.encoder = None
            return tail

    def usage(self) -> dict:
        """Token counts, as OpenAI reports them: ``input_tokens`` counts the text tokens of
        ``input`` and ``instructions`` as given (before normalization), ``output_tokens`` the
        speech tokens the LLM made (after the silent-token filter)."""
        r, tokenize = self.req, self.tts.frontend.tokenize
        n_in = len(tokenize(r.input)) + (len(tokenize(r.instructions)) if r.instructions else 0)
        n_out = sum(len(t) for t in self.syn.timings.tokens)
        return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}

    def close(self) -> None:
        """Stop the synthesis; its LLM sequence is free when this returns. Gives the heap's free
        pages back to the OS (see :mod:`cosyllama.heap`)."""
        self.token.cancel()
        with self.lock:
            if self.syn is not None:
                self.syn.close()
            if self.encoder is not None:
                self.encoder.close()
                self.encoder = None
        trim_heap()


async def _cancel_on_disconnect(request: Request, token: CancelToken) -> None:
    """Wait for the client to go away, then cancel the request's generation."""
    await client_gone(request)
    token.cancel()


router = APIRouter()


@router.post("/v1/audio/speech")
async def speech(body: SpeechRequest, request: Request):
    tts, limits = request.app.state.tts, request.app.state.limits
    try:  # before any work; tokens and the LLM budget are checked after the frontend (in tts.synthesize)
        limits.request.check_chars("input", body.input)
        limits.request.check_chars("instructions", body.instructions)
    except LimitExceeded as e:
        raise synthesis_error(e) from e
    if not body.input.strip():
        raise ApiError(422, "input is empty; give some text to speak", param="input", code="empty_string")
    if body.instructions is not None and not body.instructions.strip():
        raise ApiError(422, "instructions is empty; give a style instruction or leave the field out",
                       param="instructions", code="empty_string")
    body.synthesis_mode()
    if body.voice not in tts.voices:
        ids = await run_in_threadpool(tts.voices.ids)
        raise ApiError(404, f"unknown voice {body.voice!r}; registered voices: {describe_ids(ids)} "
                       "(add one with POST /v1/voices)", "not_found_error", param="voice", code="voice_not_found")
    streaming = body.streaming()
    if streaming and body.response_format not in STREAMABLE:
        raise ApiError(422, f"response_format {body.response_format!r} cannot be streamed (its header is "
                       f"written last); stream {', '.join(STREAMABLE)}, or omit stream_format for a whole file",
                       param="response_format", code="unsupported_for_streaming")
    if streaming and body.speed != 1.0:
        raise ApiError(422, f"speed {body.speed} needs non-streaming synthesis (the time stretch applies to "
                       "the finished audio); omit stream_format and stream, or use speed 1.0",
                       param="speed", code="unsupported_for_streaming")
    g = gate(request.app)
    job = _Job(tts, body, streaming)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job.token))  # also while it waits for a slot
    try:
        admitted = await g.acquire(gone=watcher)
    except BaseException:
        watcher.cancel()
        raise
    if not admitted:  # the client left while the request waited: it leaves the queue at once
        return Response(status_code=499)
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
            # the first chunk before the status line: a failure up to here is an HTTP error
            first = await run_in_threadpool(job.next_bytes if streaming else job.next)
        except RequestCancelled:
            return Response(status_code=499)  # the client is gone; nobody reads this
        except Exception as e:
            raise synthesis_error(e) from e
        if streaming:
            handed_off = True  # the response runs cleanup when it ends
            if streaming == "sse":
                return AudioStream(_sse_body(job, first), cleanup, SSE_MEDIA_TYPE, {"Cache-Control": "no-cache"})
            return AudioStream(_audio_body(job, first), cleanup, MEDIA_TYPES[body.response_format])
        parts = [first] if first is not None else []
        try:
            while (samples := await run_in_threadpool(job.next)) is not None:
                parts.append(samples)
        except RequestCancelled:
            return Response(status_code=499)
        except Exception as e:
            raise synthesis_error(e) from e
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        data = await run_in_threadpool(encode, audio, tts.sample_rate, body.response_format)
        return Response(data, media_type=MEDIA_TYPES[body.response_format])
    finally:
        if not handed_off:
            with anyio.CancelScope(shield=True):
                await cleanup()


async def _pieces(job: _Job, first: bytes | None):
    """The encoded body piece by piece; raises what synthesis raises after the first."""
    data = first
    while data is not None:
        if data:
            yield data
        data = await run_in_threadpool(job.next_bytes)


async def _audio_body(job: _Job, first: bytes | None):
    try:
        async for data in _pieces(job, first):
            yield data
    except RequestCancelled:
        return
    except Exception as e:  # the status line is gone: end the stream early and say why in the log
        log.error("stream ended early: %s", synthesis_error(e).message)


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _sse_body(job: _Job, first: bytes | None):
    try:
        async for data in _pieces(job, first):
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        usage = await run_in_threadpool(job.usage)
    except RequestCancelled:
        return
    except Exception as e:  # the status line is gone: say so in the stream, and in the log
        err = synthesis_error(e)
        log.error("stream ended early: %s", err.message)
        yield _event({"type": "error", **error_body(err.message, err.type, err.param, err.code)})
        return
    yield _event({"type": "speech.audio.done", "usage": usage})

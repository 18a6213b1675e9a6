"""``POST /v1/audio/speech``: the request body, one synthesis advanced chunk by chunk from the
thread pool, and the audio it answers with. Needs the ``server`` extra.

The route reads what it shares with the rest of the app from ``app.state`` (``tts``, ``limits``,
``gate``; see :func:`cosyllama.server.create_app`)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Literal

import anyio
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from .scheduler import CancelToken, RequestCancelled
from .server_common import ApiError, gate
from .server_errors import synthesis_error
from .server_wire import MEDIA_TYPES, AudioStream, encode, pcm16, wav_header

log = logging.getLogger("cosyllama.server")


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
            self.syn = tts.synthesize(r.input, instruction=r.instructions, voice=r.voice, options=opts)

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


async def _cancel_on_disconnect(request: Request, token: CancelToken) -> None:
    """Wait for the client to go away, then cancel the request's generation."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            token.cancel()
            return


router = APIRouter()


@router.post("/v1/audio/speech")
async def speech(body: SpeechRequest, request: Request):
    tts, limits = request.app.state.tts, request.app.state.limits
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
    g = gate(request.app)
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
            raise synthesis_error(e) from e
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
            raise synthesis_error(e) from e
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
            log.error("stream ended early: %s", synthesis_error(e).message)
            return

"""``POST /v1/audio/speech``'s answer: one synthesis job (:class:`~cosyllama.server.job.SpeechJob`) run through
admission and the thread pool, and the audio it answers with: a whole file, a raw audio stream, or Server-Sent
Events. The body and its checks are the OpenAI vocabulary's (:mod:`cosyllama.server.openai_speech`), the route
:mod:`cosyllama.server.speech_route`. Needs the ``server`` extra.

The route reads what it shares with the rest of the app from the app's state
(:class:`~cosyllama.server.common.AppState`: the :class:`~cosyllama.server.serving.Serving`, its gate and
limits; see :func:`cosyllama.server.app.create_app`).

How the body arrives (``stream_format``, as in OpenAI's API; ``stream: true`` is the older way to
ask for ``"audio"``):

* omitted: non-streaming synthesis (full attention over all tokens; any ``speed``), one body;
* ``"audio"``: streaming synthesis, the encoded audio sent as each chunk is made;
* ``"sse"``: the same bytes, base64, in ``speech.audio.delta`` events, then one
  ``speech.audio.done`` event with token usage (an ``error`` event instead if synthesis fails
  after the stream started).

A stream of what streaming synthesis cannot make (``speed`` other than 1: the time stretch applies
to the finished audio; flac: its header is written last) is non-streaming synthesis sent as it is
encoded: the same audio as without ``stream_format``, its first bytes after the first text segment
(flac: after the whole text).

The voice is a registered id, as a string or OpenAI's custom-voice object ``{"id": ...}``. A name in
the ``--voice-alias`` table speaks with the voice it names; one of OpenAI's built-in names that is
not registered speaks with ``--default-voice`` when there is one
(:class:`~cosyllama.server.voice_names.VoiceNames`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging

import anyio
from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..llm.scheduler import CancelToken, RequestCancelled
from ..openmp import gives_team_back
from .common import AppState, admit, client_gone
from .errors import api_error, error_body
from .job import SpeechJob, SynthesisJob
from .wire import MEDIA_TYPES, AudioStream

log = logging.getLogger("cosyllama.server")

SSE_MEDIA_TYPE = "text/event-stream"


RETRIES_HEADER = "X-Cosyllama-Retries"


def retries_header(job: SpeechJob) -> dict[str, str]:
    """``X-Cosyllama-Retries`` for a whole-file answer when a take was caught: one entry per caught take,
    ``, ``-separated, each ``key=value`` pairs (segment, attempt, seed, reason, tokens, action, and period and start
    for a loop); no header when none was."""
    entries = [" ".join(f"{k}={'none' if v is None else v}" for k, v in r.items()) for r in job.retries()]
    return {RETRIES_HEADER: ", ".join(entries)} if entries else {}


async def _cancel_on_disconnect(request: Request, token: CancelToken) -> None:
    """Wait for the client to go away, then cancel the request's generation."""
    await client_gone(request)
    token.cancel()


async def run_speech_job(request: Request, state: AppState, job: SpeechJob) -> Response:
    """:func:`run_job` of a speech job, answered as ``/v1/audio/speech`` answers: the whole file, the raw
    stream, or Server-Sent Events, as the job's ``streaming`` says."""
    streaming, fmt = job.streaming, job.response_format

    def respond(first: bytes | None, cleanup) -> Response:
        headers = loudness_headers(job)
        if streaming == "sse":
            return AudioStream(_sse_body(job, first), cleanup, SSE_MEDIA_TYPE, {"Cache-Control": "no-cache", **headers})
        if streaming:
            return AudioStream(_audio_body(job, first), cleanup, MEDIA_TYPES[fmt], headers)
        return Response(first, media_type=MEDIA_TYPES[fmt], headers={**headers, **retries_header(job)})

    return await run_job(request, state, job, job.next_bytes if streaming else job.whole_file, respond,
                         streams=streaming is not None)


LOUDNESS_HEADER = "X-Loudness-Gain-dB"


def loudness_headers(job: SynthesisJob) -> dict[str, str]:
    """``X-Loudness-Gain-dB``: the gain a request with ``loudness`` got (known before its first byte is sent: a
    stream's is fixed before its first chunk); none without ``loudness``."""
    t = job.syn.timings if job.syn is not None else None
    if t is None or t.loudness_gain_db is None:
        return {}
    return {LOUDNESS_HEADER: f"{t.loudness_gain_db:.2f}"}


async def run_job(request: Request, state: AppState, job: SynthesisJob, first_part, respond, *,
                  streams: bool) -> Response:
    """The life of one HTTP request's synthesis ``job``: admission (503 when busy; a client that leaves while
    waiting leaves the queue), the job opened, ``first_part()`` made in a worker thread before the status
    line (a failure up to here is an HTTP error), then ``respond(first, cleanup)``. A streamed response
    (``streams``) runs ``cleanup`` when its body ends; otherwise the job is closed and its slot freed here.
    A client that goes away cancels the job at once."""
    g = state.serving.admission()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job.token))  # also while it waits for a slot
    try:
        admitted = await admit(g, gone=watcher)
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
            await run_in_threadpool(gives_team_back(job.open))
            first = await run_in_threadpool(gives_team_back(first_part))
        except RequestCancelled:
            return Response(status_code=499)  # the client is gone; nobody reads this
        except Exception as e:
            raise api_error(e) from e
        response = respond(first, cleanup)
        handed_off = streams  # the response runs cleanup when it ends
        return response
    finally:
        if not handed_off:
            with anyio.CancelScope(shield=True):
                await cleanup()


async def _pieces(job: SpeechJob, first: bytes | None):
    """The encoded body piece by piece; raises what synthesis raises after the first."""
    data = first
    while data is not None:
        if data:
            yield data
        data = await run_in_threadpool(gives_team_back(job.next_bytes))


async def _audio_body(job: SpeechJob, first: bytes | None):
    try:
        async for data in _pieces(job, first):
            yield data
    except RequestCancelled:
        return
    except Exception as e:  # the status line is gone: end the stream early and say why in the log
        log.error("stream ended early: %s", api_error(e).message)


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _sse_body(job: SpeechJob, first: bytes | None):
    try:
        async for data in _pieces(job, first):
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        usage = await run_in_threadpool(job.usage)
        retries = job.retries()
    except RequestCancelled:
        return
    except Exception as e:  # the status line is gone: say so in the stream, and in the log
        err = api_error(e)
        log.error("stream ended early: %s", err.message)
        yield _event({"type": "error", **error_body(err.message, err.type, err.param, err.code)})
        return
    yield _event({"type": "speech.audio.done", "usage": usage, **({"retries": retries} if retries else {})})

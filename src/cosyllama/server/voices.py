"""The server's voice routes: ``POST /v1/voices`` (register a clip), ``GET /v1/voices``,
``DELETE /v1/voices/{id}``. ``create_app`` includes :data:`router`; the routes read the TTS, its
voice store (``tts.voices``: in memory, a read-only file, or a shared directory, see
:mod:`cosyllama.voices`) and the limits from the app's state (:func:`~cosyllama.server.common.state_of`).
Needs the ``server`` extra."""

from __future__ import annotations

import asyncio
import logging
import secrets

from fastapi import APIRouter, BackgroundTasks, FastAPI, File, Form, Request, Response, UploadFile
from starlette.concurrency import run_in_threadpool

from ..errors import CosyllamaError
from ..limits import LimitExceeded, RequestLimits
from ..text.normalize import text_problem
from ..voices import ReadOnlyVoicesError, UnknownVoiceError, VoiceExistsError, check_voice_id
from .admission import ServerBusyError
from .common import admit, client_gone, state_of
from .errors import Refusal, limit_error

log = logging.getLogger("cosyllama.server")

router = APIRouter()


def _writable(tts) -> None:
    if tts.voices.read_only:
        raise Refusal("this server's voices are read-only (it was started with --voices FILE); start it with "
                      "--voices DIR to register and delete voices that are kept", None, status=403)


def _folder(e: ReadOnlyVoicesError) -> Refusal:
    """403 for a voice folder's id (it changes through its files only)."""
    return Refusal(str(e), "voice_folder", status=403, param="id")


def _exists(voice_id: str) -> Refusal:
    return Refusal(f"voice {voice_id!r} exists; send replace=true to replace it (or DELETE /v1/voices/{voice_id} "
                   "first)", None, status=409)


def _check_room(tts, voice_id: str, max_voices: int | None) -> None:
    """Refuse a new id when the store holds ``max_voices`` already (replacing one is allowed).
    Servers sharing a directory each check before their write, so together they may pass the
    bound by the registrations in flight at that moment."""
    if max_voices is None:
        return
    ids = tts.voices.ids()
    if len(ids) >= max_voices and voice_id not in ids:
        raise Refusal(f"this server holds {len(ids)} voices, its limit (--max-voices {max_voices}); delete one "
                      "(DELETE /v1/voices/{id}) or replace an existing id (replace=true)", "too_many_voices",
                      status=409, param="id")


def _check_transcript(tts, text: str, limits: RequestLimits) -> None:
    """Refuse an over-long transcript before any audio work (``tts.make_voice`` checks the tokens
    again with the system prefix the LLM sees)."""
    try:
        limits.check_chars("transcript", text)
        limits.check_tokens("transcript", len(tts.frontend.tokenize(text)))
    except LimitExceeded as e:  # the mapper's 413, naming this form's field (a speech request's is its voice)
        raise limit_error(e, param="text") from e


@router.post("/v1/voices")
async def add_voice(request: Request, background: BackgroundTasks, audio: UploadFile = File(...),
                    text: str | None = Form(None), id: str | None = Form(None), replace: bool = Form(False)):
    state = state_of(request.app)
    tts, limits, max_prompt_bytes = state.tts, state.limits, state.options.max_prompt_bytes
    _writable(tts)
    voice_id = id if id else f"voice-{secrets.token_hex(4)}"
    check_voice_id(voice_id)  # a bad id is the mapper's 422
    if text:
        problem = text_problem(text)
        if problem is not None:
            raise Refusal(f"text {problem}", "invalid_characters", status=422, param="text")
        _check_transcript(tts, text, limits)
    if not replace and await run_in_threadpool(tts.voices.__contains__, voice_id):
        raise _exists(voice_id)  # before the work; add() checks again, atomically
    await run_in_threadpool(_check_room, tts, voice_id, state.options.max_voices)
    data = await audio.read(max_prompt_bytes + 1)
    if len(data) > max_prompt_bytes:
        raise Refusal(f"the audio file is larger than {max_prompt_bytes} bytes; give a 3-15 s clip (at most 30 s)",
                      None, status=413)
    if not data:
        raise Refusal("the audio file is empty", None)
    g = state.serving.admission()
    watcher = asyncio.create_task(client_gone(request))
    try:
        admitted = await admit(g, gone=watcher)
    finally:
        watcher.cancel()
    if not admitted:  # the client left while the request waited: it leaves the queue at once
        return Response(status_code=499)
    try:
        voice = await run_in_threadpool(tts.make_voice, data, text or None)
    except LimitExceeded as e:  # as _check_transcript's
        raise limit_error(e, param="text") from e
    except CosyllamaError as e:  # a clip that makes no voice: 400, whatever its kind
        raise Refusal(str(e), None) from e
    finally:
        g.release()
    try:
        await run_in_threadpool(_check_room, tts, voice_id, state.options.max_voices)  # again, after the work
        await run_in_threadpool(lambda: tts.voices.add(voice_id, voice, replace=replace))
    except VoiceExistsError as e:
        raise _exists(voice_id) from e
    except ReadOnlyVoicesError as e:
        raise _folder(e) from e
    background.add_task(_warm_voice, request.app, voice_id, voice)
    return {"id": voice_id}


async def _warm_voice(app: FastAPI, voice_id: str, voice) -> None:
    """After answering: solve the voice's shared flow blocks, so its first streaming request
    starts after them too. Takes a slot like a request; skipped when the server is busy."""
    g = state_of(app).serving.admission()
    try:
        await g.admit()
    except ServerBusyError:
        return
    try:
        await run_in_threadpool(state_of(app).tts.warm_voice, voice, state_of(app).serving.options.warm_low_latency)
    except Exception as e:  # a failed warm-up only costs the first request its head start
        log.warning("warming voice %s failed: %s", voice_id, e)
    finally:
        g.release()


@router.get("/v1/voices")
@router.head("/v1/voices", include_in_schema=False)
async def list_voices(request: Request):
    voices = await run_in_threadpool(state_of(request.app).tts.voices.items)  # a directory store reads files
    return {"voices": [{"id": vid, "has_transcript": bool(v.prompt_text), "seconds": round(v.duration, 3),
                        "instructions": v.instruction} for vid, v in voices.items()]}


@router.delete("/v1/voices/{voice_id}")
async def delete_voice(voice_id: str, request: Request):
    tts = state_of(request.app).tts
    _writable(tts)
    check_voice_id(voice_id)
    try:
        await run_in_threadpool(tts.voices.remove, voice_id)
    except ReadOnlyVoicesError as e:
        raise _folder(e) from e
    except UnknownVoiceError as e:  # the mapper's 404, naming this route's field
        raise Refusal(str(e), "voice_not_found", status=404, param="id") from e
    return {"id": voice_id, "deleted": True}

"""The server's voice routes: ``POST /v1/voices`` (register a clip), ``GET /v1/voices``,
``DELETE /v1/voices/{id}``. ``create_app`` includes :data:`router`; the routes read the TTS and
the limits from ``app.state``. Needs the ``server`` extra."""

from __future__ import annotations

import logging
import secrets

from fastapi import APIRouter, BackgroundTasks, FastAPI, File, Form, Request, UploadFile
from starlette.concurrency import run_in_threadpool

from .errors import CosyllamaError, InputError
from .server_common import ApiError, gate
from .voices import check_voice_id

log = logging.getLogger("cosyllama.server")

router = APIRouter()


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
    g = gate(request.app)
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
    g = gate(app)
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

"""The route of ``POST /v1/audio/speech`` (:mod:`cosyllama.server.openai_speech` has its body and checks,
:mod:`cosyllama.server.speech` how it is answered): a text
is one synthesis; an ``input`` that is an SSML ``<speak>`` document is spoken as turns
(:func:`cosyllama.server.dialogue.ssml_speech`). Kept apart from both so that neither imports the other."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..text.ssml import looks_like_ssml
from .common import state_of
from .dialogue import ssml_speech
from .job import SpeechJob
from .openai_speech import SpeechRequest, check_request
from .speech import run_speech_job

router = APIRouter()


@router.post("/v1/audio/speech")
async def speech(body: SpeechRequest, request: Request):
    state = state_of(request.app)
    if looks_like_ssml(body.input):
        return await ssml_speech(body, request, state)
    streaming, synthesis = await check_request(body, state)
    job = SpeechJob(state.tts, synthesis, streaming, body.response_format)
    return await run_speech_job(request, state, job)


__all__ = ["router"]

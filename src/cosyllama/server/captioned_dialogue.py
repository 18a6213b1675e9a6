"""``POST /dev/captioned_dialogue``: a dialogue (``POST /v1/audio/dialogue``'s body) answered with its captions, in
``POST /dev/captioned_speech``'s shapes (Kokoro-FastAPI's; :mod:`cosyllama.server.captioned`): NDJSON lines as the
audio is made (``stream``, the default) or one JSON object with the whole file, every word, every segment and the
captions as SRT and WebVTT. Each segment names its speaker (``voice``; WebVTT ``<v anna>``, SRT ``[anna]``), as
``synth --script --captions`` writes them (docs/dialogue.md). Needs the ``server`` extra; word times need the
``align`` extra."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .captioned import CaptionLines, KokoroCaptionFields, answer, refuse_unsupported, with_words
from .common import state_of
from .dialogue import DialogueJob, DialogueRequest, dialogue_requests

PATH = "/dev/captioned_dialogue"


class CaptionedDialogueRequest(KokoroCaptionFields, DialogueRequest):
    """Body of ``POST /dev/captioned_dialogue``: :class:`DialogueRequest`'s fields and Kokoro-FastAPI's caption
    fields (``stream`` true by default: NDJSON lines)."""


class CaptionedDialogueJob(CaptionLines, DialogueJob):
    """A dialogue whose answer carries its segments' words and speakers."""

    def __init__(self, tts, requests, speakers, pause, streaming: str | None, response_format: str):
        super().__init__(tts, requests, speakers, pause, streaming, response_format)
        self.start_captions(response_format)


router = APIRouter()


@router.post(PATH)
async def captioned_dialogue(body: CaptionedDialogueRequest, request: Request):
    refuse_unsupported(body, PATH)
    state = state_of(request.app)
    # ``stream`` (NDJSON lines) is what streams here, set or not: each turn is checked with it
    body = body.model_copy(update={"stream": body.stream})
    streaming, requests, speakers = await dialogue_requests(body, state)
    requests = [with_words(r, body) for r in requests]
    job = CaptionedDialogueJob(state.tts, requests, speakers, body.pause_between_turns, streaming,
                               body.response_format)
    return await answer(request, state, job, streaming, body)


__all__ = ["PATH", "CaptionedDialogueRequest", "router"]

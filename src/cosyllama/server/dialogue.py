"""``POST /v1/audio/dialogue``: a script of turns, each in its voice, as one audio answer (docs/dialogue.md).
Needs the ``server`` extra.

The body takes the turns in Kokoro-FastAPI's shape (``turns: [{"voice", "text"}]`` with
``pause_between_turns`` in seconds) or ElevenLabs' (``inputs: [{"text", "voice_id"}]``), a turn's own
``instructions`` and ``speed`` where it asks, and every other field of ``POST /v1/audio/speech`` (format,
``stream_format``/``stream``, seed, greedy, speed, mode) but ``input`` and ``voice``, which the turns carry. A
turn's voice is found as ``/v1/audio/speech`` finds one (registered ids, voice folders, ``--voice-alias``,
OpenAI's names with ``--default-voice``); a voice that is not there is a 404 naming its turn. Every turn is
checked, and every voice found, before any audio. The audio is :meth:`cosyllama.tts.TTS.run_turns`: the turns
in order, each when the one before has ended, an exact pause between them; it is sent as ``/v1/audio/speech``
sends (a whole file, a raw stream, or Server-Sent Events).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ..dialogue import MAX_PAUSE_S, MAX_TURNS, turn_seed
from ..errors import CosyllamaError, InputError
from .common import state_of
from .errors import Refusal, api_error
from .job import SpeechJob
from .openai_speech import CustomVoice, SpeechRequest, check_request, speech_options
from .speech import log, run_speech_job

PATH = "/v1/audio/dialogue"


class DialogueTurn(BaseModel):
    """One turn: Kokoro's ``{voice, text}`` or ElevenLabs' ``{text, voice_id}``, with an optional
    ``instructions`` (instruct mode) and ``speed``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(description="what this turn says")
    voice: str | CustomVoice | None = Field(None, description="the turn's voice (Kokoro's field)")
    voice_id: str | None = Field(None, description="the turn's voice (ElevenLabs' field)")
    instructions: str | None = Field(None, description="a style instruction for this turn (instruct mode)")
    speed: float | None = Field(None, description="this turn's speed, as /v1/audio/speech's")

    def voice_name(self) -> str | None:
        v = self.voice if self.voice is not None else self.voice_id
        return v.id if isinstance(v, CustomVoice) else v


class DialogueRequest(SpeechRequest):
    """Body of ``POST /v1/audio/dialogue`` (the module docstring)."""

    input: str = Field("", description="not used: the turns carry the text")
    voice: str | CustomVoice = Field("", description="not used: each turn names its voice")
    turns: list[DialogueTurn] | None = Field(None, max_length=MAX_TURNS, description="Kokoro-FastAPI's turns")
    inputs: list[DialogueTurn] | None = Field(None, max_length=MAX_TURNS, description="ElevenLabs' turns")
    pause_between_turns: float = Field(0.0, ge=0.0, le=MAX_PAUSE_S, description="seconds of silence between turns")
    model_id: str | None = Field(None, description="ElevenLabs' model field: accepted, ignored")
    settings: dict | None = Field(None, description="ElevenLabs' settings: accepted, not used")


def _turns(body: DialogueRequest) -> list[DialogueTurn]:
    if "input" in body.model_fields_set or "voice" in body.model_fields_set:
        field = "input" if "input" in body.model_fields_set else "voice"
        raise Refusal(f"{field} is not a field of a dialogue; give turns (each with voice and text)",
                      "unsupported_field", status=422, param=field)
    if (body.turns is None) == (body.inputs is None):
        raise Refusal("give the dialogue as turns ([{voice, text}]) or as inputs ([{text, voice_id}]), one of them",
                      "missing_field" if body.turns is None else "conflicting_fields", status=422, param="turns")
    turns = body.turns if body.turns is not None else body.inputs
    where = "turns" if body.turns is not None else "inputs"
    if not turns:
        raise Refusal(f"{where} is empty; give at least one turn", "empty_list", status=422, param=where)
    for k, t in enumerate(turns):
        if not t.voice_name():
            raise Refusal(f"{where}[{k}] has no voice", "missing_field", status=422, param=f"{where}[{k}].voice")
        if not t.text.strip():
            raise Refusal(f"{where}[{k}] ({t.voice_name()}) has no text", "empty_string", status=422,
                          param=f"{where}[{k}].text")
    return turns


async def dialogue_requests(body: DialogueRequest, state) -> tuple[str | None, list, list[str]]:
    """Each turn's checked synthesis request, its voice found (a 404 names the turn), in order."""
    turns = _turns(body)
    where = "turns" if body.turns is not None else "inputs"
    state.limits.check_chars("input", "\n".join(t.text for t in turns))  # the script, bounded as one input
    return await turn_requests(body, state, turns, where)


async def turn_requests(body: SpeechRequest, state, turns: list[DialogueTurn], where: str):
    """Each turn of ``turns`` as ``body`` with the turn's text, voice, speed and instructions, checked as
    ``/v1/audio/speech`` checks a request (its voice found: a 404 names the turn ``where[k]``) and seeded by
    the dialogue's seed rule; returns how it streams, the requests and the turns' voice names."""
    streaming, requests = None, []
    # the dialogue's seed as the body runs with it (its own, else the server's --seed), which each turn's
    # explicit seed would hide
    seed = speech_options(body, state.serving.options, None).seed
    for k, t in enumerate(turns):
        update = {"input": t.text, "voice": t.voice_name(), "seed": turn_seed(seed, k)}
        if t.speed is not None:
            update["speed"] = t.speed
        if t.instructions is not None:
            update["instructions"] = t.instructions
        turn_body = SpeechRequest.model_validate({**body.model_dump(include=set(SpeechRequest.model_fields),
                                                                    exclude_unset=True), **update})
        try:
            streaming, request = await check_request(turn_body, state)
        except CosyllamaError as e:  # the mapper's answer, said of the turn: its index, its voice, its field
            err = api_error(e)
            err.message = f"{where}[{k}] ({t.voice_name()}): {err.message}"
            if err.param in ("voice", "input", "speed", "instructions"):
                err.param = f"{where}[{k}].{'text' if err.param == 'input' else err.param}"
            raise err from None
        requests.append(request)
    return streaming, requests, [t.voice_name() for t in turns]


class DialogueJob(SpeechJob):
    """A speech job whose synthesis is the dialogue's turns (:meth:`cosyllama.tts.TTS.run_turns`)."""

    def __init__(self, tts, requests, speakers, pause, streaming: str | None, response_format: str):
        super().__init__(tts, requests[0], streaming, response_format)
        self.requests, self.speakers, self.pause = requests, speakers, pause

    def open(self) -> None:
        with self.lock:
            self.syn = self.tts.run_turns(self.requests, self.speakers, self.pause, cancel=self.token)
            self._opened()

    def usage(self) -> dict:
        tokenize = self.tts.frontend.tokenize
        n_in = sum(len(tokenize(r.text)) + (len(tokenize(r.instruction)) if r.instruction else 0)
                   for r in self.requests)
        n_out = sum(len(t) for t in self.syn.timings.tokens)
        return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}


async def ssml_speech(body: SpeechRequest, request: Request, state):
    """``POST /v1/audio/speech`` of an ``input`` that is an SSML ``<speak>`` document (docs/pronunciation.md):
    its spans are turns in ``body.voice`` (or their ``<voice name>``), its breaks exact silences, answered as any
    speech request is; a document that cannot be used is a 422 naming ``input`` and where it is wrong."""
    from ..dialogue import ScriptError, ssml_turns
    from ..text.ssml import parse_ssml

    try:
        doc = parse_ssml(body.input, state.tts.frontend.tokenizer)
        spans, silences = ssml_turns(doc, body.voice_name())
    except (ScriptError, InputError) as e:
        raise Refusal(str(e), "invalid_ssml", status=422, param="input") from None
    if len(spans) > MAX_TURNS:
        raise Refusal(f"the SSML document has {len(spans)} parts to speak; at most {MAX_TURNS}", "too_many_parts",
                      status=422, param="input")
    if doc.warnings:
        log.info("SSML: %s", "; ".join(doc.warnings))
    turns = [DialogueTurn(text=t.text, voice=t.voice, speed=t.speed) for t in spans]
    streaming, requests, speakers = await turn_requests(body, state, turns, "input")
    job = DialogueJob(state.tts, requests, [t.name for t in spans], silences, streaming, body.response_format)
    return await run_speech_job(request, state, job)


router = APIRouter()


@router.post(PATH)
async def dialogue(body: DialogueRequest, request: Request):
    state = state_of(request.app)
    streaming, requests, speakers = await dialogue_requests(body, state)
    job = DialogueJob(state.tts, requests, speakers, body.pause_between_turns, streaming, body.response_format)
    return await run_speech_job(request, state, job)


__all__ = ["PATH", "DialogueJob", "DialogueRequest", "dialogue_requests", "router"]

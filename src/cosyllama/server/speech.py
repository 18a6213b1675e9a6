"""``POST /v1/audio/speech``: the request body, one synthesis advanced chunk by chunk from the
thread pool, and the audio it answers with: a whole file, a raw audio stream, or Server-Sent Events.
Needs the ``server`` extra.

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
(:class:`~cosyllama.server.voice_names.VoiceNames`, every door's resolver).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Literal

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool

from ..defaults import MAX_RETRIES, RETRIES, SPEED_RANGE
from ..llm.scheduler import CancelToken, RequestCancelled
from ..request import LOUDNESS_RANGE, MODES, SEED_RANGE, SynthesisOptions, SynthesisRequest
from ..text.lexicon import Lexicon, LexiconError
from ..voices import show_id
from .common import AppState, admit, client_gone
from .errors import Refusal, error_body
from .errors import api_error as synthesis_error
from .job import SynthesisJob
from .wire import (
    AAC_HINT,
    DEFAULT_FORMAT,
    FORMATS,
    MEDIA_TYPES,
    STREAMABLE,
    AudioStream,
    StreamEncoder,
    aac_available,
    encode,
)

log = logging.getLogger("cosyllama.server")

SSE_MEDIA_TYPE = "text/event-stream"
# a request's lexicon: entries, characters of a word, characters of its tokens (the body is bounded too)
MAX_LEXICON_ENTRIES, MAX_LEXICON_WORD_CHARS, MAX_LEXICON_TOKENS_CHARS = 1000, 64, 256
class CustomVoice(BaseModel):
    """OpenAI's custom-voice form of ``voice`` (the SDK sends it for ``voice={"id": ...}``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(description="id of a registered voice")


class SpeechRequest(BaseModel):
    """Body of ``POST /v1/audio/speech``. Strict: no type coercion (``"stream": "yes"`` or
    ``"seed": "5"`` is an error, not true or 5); integers are accepted for ``speed``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: str = Field(description="text to speak")
    voice: str | CustomVoice = Field(description="id of a voice registered with POST /v1/voices, as a string or "
                                     "{\"id\": ...}; OpenAI's names speak with --default-voice unless registered")
    model: str | None = Field(None, description="accepted for OpenAI compatibility; ignored")
    response_format: Literal[FORMATS] = Field(DEFAULT_FORMAT, description="mp3 (OpenAI's default); wav and pcm: "
                                              "16-bit, 24 kHz mono; a streamed flac is the whole file")
    speed: float = Field(1.0, description=f"time stretch of the finished audio, {SPEED_RANGE[0]} to "
                         f"{SPEED_RANGE[1]}; a stream of it is non-streaming synthesis sent as it is encoded")
    stream_format: Literal["audio", "sse"] | None = Field(
        None, description="stream the audio as it is made: raw (audio) or as Server-Sent Events (sse); "
        "omitted: the whole file after synthesis")
    stream: bool = Field(False, description="true: the same as stream_format 'audio' (the older field)")
    seed: int | None = Field(None, description=f"{SEED_RANGE[0]} to {SEED_RANGE[1]}: reproducible sampling")
    greedy: bool = False
    loudness: float | None = Field(
        None, description=f"cosyllama's: bring the audio to this integrated loudness, LUFS (ITU-R BS.1770), "
        f"{LOUDNESS_RANGE[0]:g} to {LOUDNESS_RANGE[1]:g}, by one gain never past a -1 dBFS true peak; a stream's "
        "gain comes from the voice's prompt (the X-Loudness-Gain-dB header says the gain); omitted: the "
        "server's --loudness, else off")
    retries: int = Field(RETRIES, description=f"cosyllama's: 0 to {MAX_RETRIES}, how many times a text segment whose "
                         "take loops or runs away is made again (docs/retries.md); omitted: the server's --retries")
    instructions: str | None = Field(None, description="style instruction: selects instruct mode")
    mode: Literal[MODES] | None = Field(
        None, description="cosyllama's: the synthesis mode; omitted: instruct with instructions, else zero-shot "
        "for a voice registered with its transcript, else cross-lingual")
    lexicon: dict[str, str] | None = Field(
        None, description=f"cosyllama's: words this request speaks as pronunciation tokens, {{\"word\": "
        f"\"[T][AH0]...\"}} (docs/pronunciation.md); at most {MAX_LEXICON_ENTRIES} entries, a word of at most "
        f"{MAX_LEXICON_WORD_CHARS} characters, its tokens at most {MAX_LEXICON_TOKENS_CHARS}; added to the voice "
        "folder's and the server's lexicons, its entries winning")

    @field_validator("lexicon", mode="before")
    @classmethod
    def _bounded_lexicon(cls, value):
        """The lexicon's bounds and value types, named ``lexicon`` (its tokens are checked with the tokenizer)."""
        if not isinstance(value, dict):
            return value  # None, or pydantic's own dict_type error
        if len(value) > MAX_LEXICON_ENTRIES:
            _lexicon_invalid(f"{len(value)} entries; at most {MAX_LEXICON_ENTRIES}")
        for word, tokens in value.items():
            if not isinstance(tokens, str):
                _lexicon_invalid(f"entry {show_id(word)}: its tokens must be a string, e.g. \"[T][AH0][M]\", "
                                 f"not {type(tokens).__name__}")
            if len(word) > MAX_LEXICON_WORD_CHARS:
                _lexicon_invalid(f"entry {show_id(word)}: a word has at most {MAX_LEXICON_WORD_CHARS} characters")
            if len(tokens) > MAX_LEXICON_TOKENS_CHARS:
                _lexicon_invalid(f"entry {show_id(word)}: {len(tokens)} characters of tokens; at most "
                                 f"{MAX_LEXICON_TOKENS_CHARS}")
        return value

    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, CustomVoice) else self.voice

    def streaming(self) -> str | None:
        """How the audio is sent: None (the whole file), "audio" or "sse"."""
        if self.stream_format is not None:
            if "stream" in self.model_fields_set and not self.stream:
                raise Refusal(f"stream=false contradicts stream_format {self.stream_format!r}; leave stream out",
                              "conflicting_fields", status=422, param="stream")
            return self.stream_format
        return "audio" if self.stream else None


def _lexicon_invalid(message: str):
    raise PydanticCustomError("invalid_lexicon", "{message}", {"message": message})


def request_lexicon(body: SpeechRequest, tokenizer) -> Lexicon | None:
    """The :class:`~cosyllama.text.lexicon.Lexicon` of a request's ``lexicon`` field, its tokens checked against
    ``tokenizer`` (422 naming ``lexicon`` and the entry); None when it has no entry."""
    if not body.lexicon:
        return None
    try:
        return Lexicon.from_mapping(body.lexicon, tokenizer)
    except LexiconError as e:
        raise Refusal(str(e), "invalid_lexicon", status=422, param="lexicon") from None


class SpeechJob(SynthesisJob):
    """One speech request's synthesis (:class:`~cosyllama.server.job.SynthesisJob`); a streamed job
    also owns the encoder of its response body. Its synthesis streams unless the request's speed or
    format needs the finished audio (then its segments are encoded as they come)."""

    def __init__(self, tts, request: SynthesisRequest, streaming: str | None, response_format: str):
        super().__init__(tts, request)
        self.streaming, self.response_format = streaming, response_format
        self.encoder = None
        self._whole_sent = False

    def _opened(self) -> None:
        if self.streaming:
            self.encoder = StreamEncoder(self.response_format, self.tts.sample_rate)

    def next_bytes(self) -> bytes | None:
        """Streamed: the next piece of the encoded body (maybe empty), or None after the last."""
        with self.lock:
            if self.encoder is None:
                return None
            chunk = self.next_chunk()
            if chunk is not None:
                return self.encoder.write(chunk.samples)
            tail = self.encoder.close()
            self.encoder = None
            return tail

    def output(self) -> bytes | None:
        """What a streamed session sends next (:mod:`cosyllama.server.session`): a streamed job's next
        piece of the encoded stream (maybe empty), else the whole file at once; None after the last."""
        if self.streaming:
            return self.next_bytes()
        if self._whole_sent:
            return None
        self._whole_sent = True
        return self.whole_file()

    def whole_file(self) -> bytes:
        """The rest of the synthesis, encoded as one file (a request without a stream)."""
        parts = []
        while (samples := self.next()) is not None:
            parts.append(samples)
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return encode(audio, self.tts.sample_rate, self.response_format)

    def usage(self) -> dict:
        """Token counts, as OpenAI reports them: ``input_tokens`` counts the text tokens of
        ``input`` and ``instructions`` as given (before normalization), ``output_tokens`` the
        speech tokens the LLM made (after the silent-token filter)."""
        r, tokenize = self.request, self.tts.frontend.tokenize
        n_in = len(tokenize(r.text)) + (len(tokenize(r.instruction)) if r.instruction else 0)
        n_out = sum(len(t) for t in self.syn.timings.tokens)
        return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}

    def retries(self) -> list[dict]:
        """The takes caught so far (docs/retries.md), as :meth:`~cosyllama.llm.takes.BadTake.as_dict`."""
        return [r.as_dict() for r in self.syn.timings.retries] if self.syn is not None else []

    def _closed(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
            self.encoder = None


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


async def check_request(body: SpeechRequest, state: AppState,
                        text: str | None = None) -> tuple[str | None, SynthesisRequest]:
    """The HTTP door of a speech request: its HTTP-only rules (``stream`` against ``stream_format``,
    ``response_format`` aac, the voice's name), the serving options' ``defaults`` (seed, greedy, speed,
    loudness, retries) filled in where the body gives none, then the one
    :class:`~cosyllama.request.SynthesisRequest` it asks for; a broken rule raises the project's exception
    (a :class:`~cosyllama.server.errors.Refusal`, ``RequestError``, ``LimitExceeded``, ``UnknownVoiceError``),
    which the app and the WebSocket answer through the one mapper; ``state``: the app's state (tts, limits,
    voice names); ``text``: instead of ``body.input`` (a streamed session's sentence).
    Returns :meth:`SpeechRequest.streaming` and the request. Shared with ``/v1/audio/speech/stream``
    (:mod:`cosyllama.server.speech_stream`)."""
    defaults = state.serving.options.defaults  # for clients that cannot send cosyllama's fields
    for name, value in (("seed", defaults.seed), ("greedy", defaults.greedy), ("speed", defaults.speed),
                        ("loudness", defaults.loudness), ("retries", defaults.retries)):
        if value != SpeechRequest.model_fields[name].default and name not in body.model_fields_set:
            setattr(body, name, value)
    streaming = body.streaming()
    if body.response_format == "aac" and not aac_available():
        log.warning("a request for aac: %s", AAC_HINT)
        formats = ", ".join(f for f in FORMATS if f != "aac")
        raise Refusal(f"response_format 'aac' is not available on this server; use one of {formats}",
                      "unsupported_value", status=422, param="response_format")
    lexicon = request_lexicon(body, state.tts.frontend.tokenizer)
    synthesis = synthesis_request(body, body.voice_name(), streaming, state.limits, text, lexicon)
    name = body.voice_name()
    if not name.strip():
        raise Refusal("voice is empty; give the id of a registered voice (GET /v1/voices lists them)",
                      "empty_string", status=422, param="voice")
    # found as every door finds one (the store may read a file or make a folder's voice: off the event loop)
    _, voice = await run_in_threadpool(state.voice_names.resolve, state.tts.voices, name)
    return streaming, synthesis.with_voice(voice)  # the rules that need the voice (its transcript, instruction)


def synthesis_request(body: SpeechRequest, voice, streaming: str | None, limits,
                      text: str | None = None, lexicon: Lexicon | None = None) -> SynthesisRequest:
    """The :class:`~cosyllama.request.SynthesisRequest` of ``body`` spoken by ``voice`` (a name, or
    its features), checked against ``limits``. Synthesis streams only when the stream can carry it: ``speed`` 1 (the
    time stretch applies to the finished audio) and a streamable format (flac writes its header last);
    other streams are non-streaming synthesis sent as it is encoded (``stream_format`` is transport).
    ``lexicon``: the request's (:func:`request_lexicon`)."""
    synth_streams = streaming is not None and body.response_format in STREAMABLE and body.speed == 1.0
    options = SynthesisOptions(stream=synth_streams, speed=body.speed, greedy=body.greedy, seed=body.seed,
                               loudness=body.loudness, retries=body.retries, lexicon=lexicon)
    return SynthesisRequest(body.input if text is None else text, body.mode, voice=voice,
                            instruction=body.instructions, options=options, limits=limits)


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
            await run_in_threadpool(job.open)
            first = await run_in_threadpool(first_part)
        except RequestCancelled:
            return Response(status_code=499)  # the client is gone; nobody reads this
        except Exception as e:
            raise synthesis_error(e) from e
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
        data = await run_in_threadpool(job.next_bytes)


async def _audio_body(job: SpeechJob, first: bytes | None):
    try:
        async for data in _pieces(job, first):
            yield data
    except RequestCancelled:
        return
    except Exception as e:  # the status line is gone: end the stream early and say why in the log
        log.error("stream ended early: %s", synthesis_error(e).message)


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
        err = synthesis_error(e)
        log.error("stream ended early: %s", err.message)
        yield _event({"type": "error", **error_body(err.message, err.type, err.param, err.code)})
        return
    yield _event({"type": "speech.audio.done", "usage": usage, **({"retries": retries} if retries else {})})

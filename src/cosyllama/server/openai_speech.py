"""The OpenAI speech request's vocabulary, which ``POST /v1/audio/speech`` (and its siblings: the dialogue, the
captioned speech) and the WebSocket's ``session.config`` (:mod:`cosyllama.server.speech_stream`) share: the body
(:class:`SpeechRequest`, strict), the rules that are the HTTP door's (``stream`` against ``stream_format``,
``response_format`` aac, the voice's name, the request's lexicon) and the one
:class:`~cosyllama.request.SynthesisRequest` a body asks for (:func:`check_request`), its options the server's
defaults overlaid by what the client gave (:meth:`~cosyllama.server.options.ServingOptions.request_options`),
its voice found as every door finds one (:class:`~cosyllama.server.voice_names.VoiceNames`). A rule broken is
one of the project's exceptions (:class:`~cosyllama.server.errors.Refusal`, ``RequestError``, ``LimitExceeded``,
``UnknownVoiceError``), which each door answers through :func:`cosyllama.server.errors.api_error`. Needs the
``server`` extra.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool

from ..defaults import MAX_RETRIES, RETRIES, SPEED_RANGE
from ..request import LOUDNESS_RANGE, MODES, SEED_RANGE, SynthesisOptions, SynthesisRequest
from ..text.lexicon import Lexicon, LexiconError
from ..voices import show_id
from .errors import Refusal
from .options import ServingOptions
from .wire import AAC_HINT, DEFAULT_FORMAT, FORMATS, STREAMABLE, aac_available

log = logging.getLogger("cosyllama.server")

# a request's lexicon: entries, characters of a word, characters of its tokens (the body is bounded too)
MAX_LEXICON_ENTRIES, MAX_LEXICON_WORD_CHARS, MAX_LEXICON_TOKENS_CHARS = 1000, 64, 256
# the body's fields that are synthesis options, which the server's defaults (--seed, --speed ...) fill in
OVERLAID = ("seed", "greedy", "speed", "loudness", "retries")


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


def speech_options(body: SpeechRequest, options: ServingOptions, streaming: str | None,
                   lexicon: Lexicon | None = None) -> SynthesisOptions:
    """The synthesis options ``body`` runs with: the server's ``options.defaults`` overlaid by the fields the client
    set (:meth:`~cosyllama.server.options.ServingOptions.request_options`; the body is left as it came) and its
    ``lexicon`` (:func:`request_lexicon`). Synthesis streams only when the stream can carry it: a streamable format
    (flac writes its header last) at speed 1 (the time stretch applies to the finished audio); other streams are
    non-streaming synthesis sent as it is encoded (``stream_format`` is transport)."""
    given = {name: getattr(body, name) for name in OVERLAID if name in body.model_fields_set}
    if lexicon is not None:
        given["lexicon"] = lexicon
    return options.request_options(given, streams=streaming is not None and body.response_format in STREAMABLE)


async def check_request(body: SpeechRequest, state, text: str | None = None) -> tuple[str | None, SynthesisRequest]:
    """The one :class:`~cosyllama.request.SynthesisRequest` a speech body asks for, and how its audio is sent
    (:meth:`SpeechRequest.streaming`): the HTTP door's rules, the options of :func:`speech_options`, the voice
    found (off the event loop: the store may read a file), then the request's own rules (with the voice: its
    transcript, its instruction); a broken rule raises (the module docstring). ``state``: the app's
    (:class:`~cosyllama.server.common.AppState`: tts, limits, voice names, the serving options); ``text``: instead
    of ``body.input`` (a streamed session's stand-in)."""
    streaming = body.streaming()
    if body.response_format == "aac" and not aac_available():
        log.warning("a request for aac: %s", AAC_HINT)
        formats = ", ".join(f for f in FORMATS if f != "aac")
        raise Refusal(f"response_format 'aac' is not available on this server; use one of {formats}",
                      "unsupported_value", status=422, param="response_format")
    lexicon = request_lexicon(body, state.tts.frontend.tokenizer)
    options = speech_options(body, state.serving.options, streaming, lexicon)
    name = body.voice_name()
    synthesis = SynthesisRequest(body.input if text is None else text, body.mode, voice=name,
                                 instruction=body.instructions, options=options, limits=state.limits)
    if not name.strip():
        raise Refusal("voice is empty; give the id of a registered voice (GET /v1/voices lists them)",
                      "empty_string", status=422, param="voice")
    _, voice = await run_in_threadpool(state.voice_names.resolve, state.tts.voices, name)
    return streaming, synthesis.with_voice(voice)  # the rules that need the voice (its transcript, instruction)


__all__ = ["MAX_LEXICON_ENTRIES", "OVERLAID", "CustomVoice", "SpeechRequest", "check_request", "request_lexicon",
           "speech_options"]

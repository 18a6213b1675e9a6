"""What one synthesis asks for: :class:`SynthesisRequest` (what to say, how, in which voice) and
:class:`SynthesisOptions` (the per-call knobs), the one vocabulary of modes, :data:`MODES`, and every
rule a synthesis request must follow, checked once, here.

Every front door (the Python API's mode methods, ``cosyllama synth``, the HTTP and WebSocket
routes, Wyoming, batch manifest rows, the upstream facade) builds a :class:`SynthesisRequest` and
hands it to :meth:`cosyllama.tts.TTS.run`. A request is checked when it is made: a bad one raises
a :class:`RequestError` naming the field, which each door renders in its own words (the CLI names
its flags, HTTP gives ``param``, a manifest row its JSON field; see :data:`FLAG_NAMES`,
:data:`HTTP_NAMES`, :data:`BATCH_NAMES`). The rules that need to know a registered voice (its
transcript, its instruction) are checked by :meth:`SynthesisRequest.resolve` once the voice is
known (``TTS.run`` does it).

Light on purpose (no torch): a door checks a request before any model work.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .defaults import FIRST_CHUNK_RANGE, MAX_RETRIES, RETRIES, SPEED_RANGE
from .errors import InputError
from .limits import RequestLimits
from .seeds import SEED_RANGE  # seeds every door takes (OpenAI-style JSON integers, torch's generator)
from .text.normalize import text_problem

MODES = ("zero-shot", "cross-lingual", "instruct")  # the modes a text request chooses between
# the frontend's name of each mode (its ModelInput.mode), and "vc" for voice conversion, which takes no text
FRONTEND_MODES = {"zero-shot": "zero_shot", "cross-lingual": "cross_lingual", "instruct": "instruct2"}
VC_MODE = "vc"
# loudness targets every door takes, LUFS (cosyllama.loudness.LOUDNESS_RANGE; kept here so a request is checked
# without importing numpy's side of it)
LOUDNESS_RANGE = (-70.0, -5.0)

# the fields a RequestError may name (SynthesisRequest's, with the options' by their own names)
FIELDS = ("text", "mode", "voice", "prompt_wav", "prompt_text", "instruction", "speed", "seed", "stream", "loudness",
          "retries", "first_chunk_tokens", "lead")
# how each door names them: the Python API (the keywords), `cosyllama synth` (flags), the HTTP body,
# a batch manifest row
API_NAMES = {f: f for f in FIELDS}
FLAG_NAMES = {**API_NAMES, "text": "--text", "mode": "--mode", "voice": "a voice", "prompt_wav": "--prompt-wav",
              "prompt_text": "--prompt-text", "instruction": "--instruct", "speed": "--speed", "seed": "--seed",
              "stream": "--stream", "loudness": "--loudness", "retries": "--retries",
              "first_chunk_tokens": "--first-chunk-tokens"}
HTTP_NAMES = {**API_NAMES, "text": "input", "instruction": "instructions", "stream": "stream_format"}
BATCH_NAMES = {**API_NAMES, "instruction": "instructions"}


class RequestError(InputError):
    """A synthesis request that breaks a rule. ``field`` (one of :data:`FIELDS`) is the field it is
    about; ``template`` the message with each field written ``{field}``, so a door says it in its own
    words (:meth:`render`, :meth:`as_flag`); ``code`` a short machine-readable reason (pydantic's and
    OpenAI's words: ``empty_string``, ``less_than_equal``, ``conflicting_fields`` ...)."""

    def __init__(self, field: str, template: str, code: str = "invalid_value"):
        self.field, self.template, self.code = field, template, code
        super().__init__(self.render(API_NAMES))

    def render(self, names: Mapping[str, str]) -> str:
        """The message with each field named as ``names`` (one of the ``*_NAMES`` tables) names it."""
        return self.template.format_map({f: names.get(f, f) for f in FIELDS})

    def name(self, names: Mapping[str, str]) -> str:
        """The field as ``names`` calls it."""
        return names.get(self.field, self.field)

    def as_flag(self) -> InputError:
        """The error in ``cosyllama synth``'s words (its flags)."""
        return InputError(self.render(FLAG_NAMES))


def _shown(value) -> str:
    """``value`` for a message template (braces doubled: it is formatted once more)."""
    return repr(value).replace("{", "{{").replace("}", "}}")


@dataclass(frozen=True)
class SynthesisOptions:
    """Per-call options.

    stream: yield audio chunk by chunk as tokens are decoded. speed: 0.25-4.0 time stretch of the
    finished mel (non-streaming only). greedy: argmax decoding. seed: makes sampling reproducible
    (segment i uses seed + i, wrapped: cosyllama.seeds), 0 to 2**31 - 1. text_frontend: normalize and split the text.
    russian_numbers: spell numbers in Russian sentences in Russian (else English, as the reference does).
    max_tokens / ignore_stop: decoding overrides used by benchmarks. word_times: align each segment's words
    after its audio has been yielded (``Segment.words``; :mod:`cosyllama.alignment`); the audio is the same.
    word_language: the aligner's language code (None: from each segment's script). loudness: an integrated
    loudness target in LUFS (ITU-R BS.1770, -70 to -5), reached by one gain for the whole output with a -1 dBFS
    true-peak ceiling (a stream's gain from its voice's prompt, fixed before the first chunk;
    :mod:`cosyllama.loudness`, docs/loudness.md); None (default): the audio as the model made it.
    retries: how many times a text segment's take that loops or runs away is made again, 0 to 5 (0: caught
    takes are only reported); attempt k of segment i is seeded seed + i + k * 2**20 (docs/retries.md).
    lexicon: a :class:`~cosyllama.text.lexicon.Lexicon` whose words this call speaks as their pronunciation
    tokens (with the pipeline's own ``TTS.lexicon``, this one's entries winning; docs/pronunciation.md).
    first_chunk_tokens: streaming only, outside the reference's schedule: the first chunk of each segment covers
    this many speech tokens (5 to 24) instead of the reference's 25 or more, so the first audio comes sooner;
    every later chunk is the reference's (docs/streaming.md, "Low-latency first chunk"). None (default): the
    reference's schedule.
    """

    stream: bool = False
    speed: float = 1.0
    greedy: bool = False
    seed: int | None = None
    text_frontend: bool = True
    russian_numbers: bool = True
    max_tokens: int | None = None
    ignore_stop: bool = False
    word_times: bool = False
    word_language: str | None = None
    loudness: float | None = None
    retries: int = RETRIES
    lexicon: Any = None  # cosyllama.text.lexicon.Lexicon | None
    first_chunk_tokens: int | None = None


@dataclass(frozen=True)
class SynthesisRequest:
    """One text synthesis: what to say, in which mode, in which voice, with which options.

    The voice is ``voice`` (a registered id, or a :class:`~cosyllama.frontend.PromptFeatures`) or
    ``prompt_wav`` (a clip) with its ``prompt_text`` (its transcript); ``mode`` None: chosen from
    what is given (:meth:`resolve`). ``limits``: the character limits the request was checked
    against (None: none; ``TTS.run`` checks a request against its own limits when they differ).

    Checked when made (:meth:`check`): a bad request raises :class:`RequestError` (or, over a
    limit, :class:`~cosyllama.limits.LimitExceeded`)."""

    text: str
    mode: str | None = None
    voice: Any = None  # str (registered id) | PromptFeatures | None
    prompt_wav: Any = None  # AudioSource | None
    prompt_text: str | None = None
    instruction: str | None = None
    options: SynthesisOptions = SynthesisOptions()
    limits: RequestLimits | None = None
    # the whitespace before ``text`` in the longer text it continues (a streamed session's sentence after the
    # first): kept before its first segment as that text's own segmentation keeps it
    # (cosyllama.frontend.continued_lead); "" for a text of its own
    lead: str = ""

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Every rule that needs nothing but the request (the table in docs/architecture.md)."""
        _check_text("text", self.text, required=True)
        if not isinstance(self.lead, str) or self.lead.strip():
            raise RequestError("lead", "{lead} is the whitespace before the text in the text it continues",
                               "invalid_lead")
        check_mode(self.mode)
        if self.instruction is not None:
            _check_text("instruction", self.instruction, required=True,
                        empty="{instruction} is empty; give a style instruction or leave it out")
            if self.mode is not None and self.mode != "instruct":
                raise RequestError("mode", f"mode {_shown(self.mode)} takes no {{instruction}}; give {{instruction}} "
                                   "with mode 'instruct' only (or leave {mode} out)", "conflicting_fields")
        if self.prompt_text is not None:
            _check_text("prompt_text", self.prompt_text)
        if self.voice is not None and self.prompt_wav is not None:
            raise RequestError("voice", "give either {voice} or {prompt_wav}, not both", "conflicting_fields")
        if self.voice is None and self.prompt_wav is None:
            raise RequestError("prompt_wav", "this mode needs a prompt: {prompt_wav} (a 16 kHz+ clip of the voice, "
                               "up to 30 s) or a registered voice", "missing")
        if isinstance(self.voice, str) and self.prompt_text is not None:
            raise RequestError("prompt_text", "{prompt_text} goes with {prompt_wav}; a registered voice keeps its "
                               "own transcript", "conflicting_fields")
        check_options(self.options)
        if self.limits is not None:
            for name, value in (("input", self.text), ("instructions", self.instruction),
                                ("transcript", self.prompt_text)):
                self.limits.check_chars(name, value)
        if not isinstance(self.voice, str):  # a clip or a voice's features: the mode rules can be checked now
            self.resolve(self.voice if self.prompt_wav is None else None)

    def with_voice(self, voice) -> SynthesisRequest:
        """This request spoken by ``voice`` in place of its own (e.g. the features of the registered id
        it names, once looked up); the rules that need the voice are checked now (:meth:`resolve`),
        the others were when the request was made (a voice for a voice leaves them as they were)."""
        if (voice is None) != (self.voice is None):
            raise ValueError("with_voice replaces a voice by a voice")
        new = copy.copy(self)
        object.__setattr__(new, "voice", voice)
        if not isinstance(voice, str):
            new.resolve(voice if new.prompt_wav is None else None)
        return new

    def resolve(self, voice=None) -> tuple[str, str | None]:
        """The mode and instruction this request synthesizes with, given its voice's features
        (``voice``: a :class:`~cosyllama.frontend.PromptFeatures`, or None for a clip): ``mode``
        when given, else instruct with an instruction (the request's, else the voice's own, e.g.
        from a voice folder's ``instruct.txt``), zero-shot with a transcript (``prompt_text``, else
        the voice's), else cross-lingual. Raises :class:`RequestError` when the mode lacks what it needs."""
        clip = voice is None
        return resolve_mode(self.mode, self.instruction, prompt_text=bool(self.prompt_text), clip=clip,
                            voice_transcript=False if clip else getattr(voice, "prompt_text", None) is not None,
                            voice_instruction=None if clip else getattr(voice, "instruction", None))


def resolve_mode(mode: str | None, instruction: str | None, *, prompt_text: bool, clip: bool,
                 voice_transcript: bool | None, voice_instruction: str | None,
                 instruction_known: bool = True) -> tuple[str, str | None]:
    """:meth:`SynthesisRequest.resolve` from what is known: ``prompt_text``: the request gives a
    transcript; ``clip``: its voice is a prompt clip; ``voice_transcript``: the voice has one (None:
    not known yet); ``voice_instruction``: the voice's own (``instruction_known`` False: not known
    yet). A rule whose facts are not known yet is left to the synthesis (``TTS.run`` knows them)."""
    if instruction is None:
        instruction = voice_instruction
    has_transcript = prompt_text or bool(voice_transcript)
    if mode is None:
        if instruction is not None:
            mode = "instruct"
        elif not instruction_known or (voice_transcript is None and not prompt_text):
            return mode, instruction  # decided once the voice is known
        else:
            mode = "zero-shot" if has_transcript else "cross-lingual"
    if mode == "instruct" and instruction is None and instruction_known:
        raise RequestError("instruction", "instruct mode needs {instruction} (a style instruction, e.g. 'Speak "
                           "slowly.'), or a voice that has one; give {instruction} with mode 'instruct' only",
                           "conflicting_fields")
    if mode == "zero-shot" and not has_transcript and voice_transcript is not None:
        if clip:
            raise RequestError("prompt_text", "zero-shot needs {prompt_text} (the transcript of {prompt_wav}); "
                               "use cross-lingual mode without one", "missing")
        raise RequestError("voice", "zero-shot needs a voice made with its transcript; use cross-lingual mode for "
                           "a voice without one", "missing")
    return mode, instruction


def _check_text(field: str, text, *, required: bool = False, empty: str | None = None) -> None:
    if not isinstance(text, str):
        raise RequestError(field, f"{{{field}}} must be a string, got {type(text).__name__}", "string_type")
    if required and not text.strip():
        raise RequestError(field, empty or f"{{{field}}} is empty; give the text to speak", "empty_string")
    problem = text_problem(text)
    if problem is not None:
        raise RequestError(field, f"{{{field}}} {problem.replace('{', '{{').replace('}', '}}')}",
                           "invalid_characters")


def check_mode(mode: str | None) -> None:
    """``mode`` is one of :data:`MODES` (or None: chosen from the request)."""
    if mode is not None and mode not in MODES:
        raise RequestError("mode", f"{{mode}} must be one of {', '.join(MODES)}, got {_shown(mode)}", "literal_error")


def check_options(o: SynthesisOptions) -> None:
    """The rules of the options alone (speed, seed, loudness, retries), as :class:`RequestError`."""
    speed = o.speed
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise RequestError("speed", f"{{speed}} must be a number, got {_shown(speed)}", "float_type")
    lo, hi = SPEED_RANGE
    if not math.isfinite(speed):
        raise RequestError("speed", f"{{speed}} must be a finite number between {lo} and {hi}, got {speed}",
                           "finite_number")
    if not lo <= speed <= hi:
        raise RequestError("speed", f"{{speed}} must be between {lo} and {hi}, got {speed}",
                           "less_than_equal" if speed > hi else "greater_than_equal")
    if o.stream and speed != 1.0:
        raise RequestError("speed", "{speed} other than 1.0 needs non-streaming synthesis (the reference only "
                           "time-stretches the finished mel); drop {stream} or use speed 1.0", "conflicting_fields")
    if o.lexicon is not None:
        from .text.lexicon import Lexicon

        if not isinstance(o.lexicon, Lexicon):
            raise TypeError(f"lexicon must be a cosyllama.text.lexicon.Lexicon (Lexicon.load(path)), "
                            f"got {type(o.lexicon).__name__}")
    seed = o.seed
    if seed is not None:
        lo, hi = SEED_RANGE
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise RequestError("seed", f"{{seed}} must be an integer from {lo} to {hi}, got {_shown(seed)}",
                               "int_type")
        if not lo <= seed <= hi:
            raise RequestError("seed", f"{{seed}} must be an integer from {lo} to {hi}, got {seed}",
                               "less_than_equal" if seed > hi else "greater_than_equal")
    loudness = o.loudness
    if loudness is not None:
        lo, hi = LOUDNESS_RANGE
        if isinstance(loudness, bool) or not isinstance(loudness, (int, float)):
            raise RequestError("loudness", f"{{loudness}} must be a number of LUFS from {lo:g} to {hi:g}, got "
                               f"{_shown(loudness)}", "float_type")
        if not math.isfinite(loudness):
            raise RequestError("loudness", f"{{loudness}} must be a finite number of LUFS from {lo:g} to {hi:g}, "
                               f"got {loudness}", "finite_number")
        if not lo <= loudness <= hi:
            raise RequestError("loudness", f"{{loudness}} must be from {lo:g} to {hi:g} LUFS (e.g. -16 for speech "
                               f"on the web, -23 for broadcast), got {loudness:g}",
                               "less_than_equal" if loudness > hi else "greater_than_equal")
    first = o.first_chunk_tokens
    if first is not None:
        lo, hi = FIRST_CHUNK_RANGE
        if isinstance(first, bool) or not isinstance(first, int) or not lo <= first <= hi:
            raise RequestError("first_chunk_tokens", f"{{first_chunk_tokens}} must be an integer from {lo} to {hi} "
                               f"speech tokens (the reference's first chunk is {hi + 1} or more; one of under {lo} "
                               f"would have no audio), got {_shown(first)}",
                               "invalid_value")
        if not o.stream:
            raise RequestError("first_chunk_tokens", "{first_chunk_tokens} shapes a stream's first chunk; "
                               "non-streamed synthesis has one chunk: drop it or stream", "conflicting_fields")
    retries = o.retries
    if isinstance(retries, bool) or not isinstance(retries, int):
        raise RequestError("retries", f"{{retries}} must be an integer from 0 to {MAX_RETRIES}, got {_shown(retries)}",
                           "int_type")
    if not 0 <= retries <= MAX_RETRIES:
        raise RequestError("retries", f"{{retries}} must be an integer from 0 to {MAX_RETRIES} (each is one more take "
                           f"of a segment that loops or runs away), got {retries}",
                           "less_than_equal" if retries > MAX_RETRIES else "greater_than_equal")


__all__ = ["BATCH_NAMES", "FLAG_NAMES", "FRONTEND_MODES", "HTTP_NAMES", "LOUDNESS_RANGE", "MODES", "SEED_RANGE",
           "RequestError", "SynthesisOptions", "SynthesisRequest", "check_mode", "check_options", "resolve_mode"]

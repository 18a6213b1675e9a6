"""Per-request bounds: characters and text tokens of each text field, and the LLM positions one
sequence may use (its prompt plus every speech token it may decode).

:class:`RequestLimits` holds them; the server checks characters before any work, and a
:class:`~cosyllama.tts.TTS` given limits checks tokens and the sequence budget of every segment
after the frontend, before any LLM work, so a request that does not fit is refused whole (never
truncated). Each refusal is a :class:`LimitExceeded` naming the field, the limit and the
``cosyllama serve`` flag that sets it.

Light on purpose (no torch): the CLI builds its ``serve`` flags from :data:`LIMIT_HELP`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .defaults import (
    MAX_INPUT_CHARS,
    MAX_INPUT_TOKENS,
    MAX_INSTRUCTIONS_CHARS,
    MAX_INSTRUCTIONS_TOKENS,
    MAX_SEQ_TOKENS,
    MAX_SESSION_CHARS,
    MAX_TRANSCRIPT_CHARS,
    MAX_TRANSCRIPT_TOKENS,
)
from .errors import InputError

TEXT_FIELDS = ("input", "instructions", "transcript")

_ADVICE = {"input": "split the text over several requests",
           "instructions": "give a short style instruction",
           "transcript": "give only the transcript of the prompt clip (at most 30 s of speech)",
           "session": "open a new session (connection) for more text"}

# what each limit bounds, for `serve --help` (the flag is --max-<name with dashes>)
LIMIT_HELP = {
    "input_chars": "characters of a speech request's input",
    "input_tokens": "text tokens of a speech request's input after normalization (all segments)",
    "instructions_chars": "characters of a speech request's instructions",
    "instructions_tokens": "text tokens of the instructions (with the system prefix)",
    "transcript_chars": "characters of a voice's transcript",
    "transcript_tokens": "text tokens of a voice's transcript (with the system prefix)",
    "seq_tokens": "LLM positions one text segment may use: its prompt (transcript or instructions, "
                  "prompt speech, text) plus up to 20 speech tokens per text token; the llama.cpp context "
                  "is sized for --parallel of these at start and never grows",
    "session_chars": "characters of text one streamed session takes in all (a /v1/audio/speech/stream "
                     "connection, a Wyoming synthesize-start ... -stop; each message counts at least one)",
}


def limit_flag(name: str) -> str:
    """The ``cosyllama serve`` flag of the limit ``name`` (e.g. ``input_chars`` -> ``--max-input-chars``)."""
    return "--max-" + name.replace("_", "-")


class LimitExceeded(InputError):
    """A request is over one of its limits. ``field`` (``input``, ``instructions``, ``transcript``,
    ``sequence`` or ``session``), ``limit`` (its value) and ``flag`` (the ``serve`` option) say which."""

    def __init__(self, message: str, *, field: str, limit: int, flag: str):
        super().__init__(message)
        self.field, self.limit, self.flag = field, limit, flag


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of one request; every value is >= 1. See :data:`LIMIT_HELP`."""

    input_chars: int = MAX_INPUT_CHARS
    input_tokens: int = MAX_INPUT_TOKENS
    instructions_chars: int = MAX_INSTRUCTIONS_CHARS
    instructions_tokens: int = MAX_INSTRUCTIONS_TOKENS
    transcript_chars: int = MAX_TRANSCRIPT_CHARS
    transcript_tokens: int = MAX_TRANSCRIPT_TOKENS
    seq_tokens: int = MAX_SEQ_TOKENS
    session_chars: int = MAX_SESSION_CHARS

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{limit_flag(f.name)} must be an integer >= 1, got {v!r}")

    def check_chars(self, field: str, text: str | None) -> None:
        """Refuse ``text`` (of ``field``: one of :data:`TEXT_FIELDS`) when it has too many characters."""
        limit = getattr(self, f"{field}_chars")
        if text is not None and len(text) > limit:
            flag = limit_flag(f"{field}_chars")
            raise LimitExceeded(f"{field} is too long: {len(text)} characters, at most {limit} allowed ({flag}); "
                                f"{_ADVICE[field]}", field=field, limit=limit, flag=flag)

    def check_session(self, n_chars: int) -> None:
        """Refuse a streamed session that has taken ``n_chars`` characters when they are too many."""
        limit = self.session_chars
        if n_chars > limit:
            flag = limit_flag("session_chars")
            raise LimitExceeded(f"the session's text is too long: {n_chars} characters, at most {limit} allowed "
                                f"({flag}); {_ADVICE['session']}", field="session", limit=limit, flag=flag)

    def check_tokens(self, field: str, n_tokens: int) -> None:
        """Refuse ``n_tokens`` text tokens of ``field`` when they are too many."""
        limit = getattr(self, f"{field}_tokens")
        if n_tokens > limit:
            flag = limit_flag(f"{field}_tokens")
            raise LimitExceeded(f"{field} is too long: {n_tokens} text tokens as the LLM sees them, "
                                f"at most {limit} allowed ({flag}); {_ADVICE[field]}",
                                field=field, limit=limit, flag=flag)

    def check_sequence(self, n_prompt: int, n_new: int, segment: str) -> None:
        """Refuse an LLM sequence of ``n_prompt`` prompt positions that may decode ``n_new`` speech
        tokens when together they exceed the per-sequence budget; ``segment`` is its text."""
        limit = self.seq_tokens
        if n_prompt + n_new > limit:
            flag = limit_flag("seq_tokens")
            head = segment if len(segment) <= 60 else segment[:57] + "..."
            raise LimitExceeded(
                f"the text segment {head!r} needs up to {n_prompt + n_new} LLM positions ({n_prompt} of prompt "
                f"+ up to {n_new} speech tokens), at most {limit} allowed ({flag}); split long sentences with "
                "punctuation, or shorten the transcript or instructions",
                field="sequence", limit=limit, flag=flag)


__all__ = ["LIMIT_HELP", "TEXT_FIELDS", "LimitExceeded", "RequestLimits", "limit_flag"]
